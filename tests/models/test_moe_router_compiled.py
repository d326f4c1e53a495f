"""The workbench's MoE router (``workbench.backend.moe_router``, ``KernelChoice.moe_router``) against megatron's
``TopKRouter`` on one CPU rank (gloo, eager: the function that CUDA compiles): the same probabilities, routing map,
gradients of the gating weight and of the input, and the same values in megatron's metrics tracker (the z-loss and
load-balancing loss each divided by its coefficient), bitwise, for moe-tiny with and without each loss, the softmax
before or after the top-k, per-token loss scaling and a top-k scaling factor; the layer's output and gradients equal
with either router; what the router cannot do runs megatron's."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter

from workbench import kernel_rule
from workbench.config import preset

from tests.support import free_port

pytestmark = pytest.mark.filterwarnings("ignore")

BASE = {"model.num_layers": 1, "model.moe.router_stats_interval": 0, "train.micro_batch_size": 3,
        "model.seq_length": 16, "model.init_method_std": 0.2, "train.compile_kernels": True}


@pytest.fixture(scope="module")
def build():
    from workbench.backend import cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests
    from workbench.rank.build import build_model

    initialize_for_tests(preset("moe-tiny", **BASE), port=free_port())
    kernel_rule.allow_fast_paths_on_cpu(True)

    def make(**over):
        cfg = preset("moe-tiny", **{**BASE, **over})
        torch.manual_seed(7)
        return cfg, build_model(cfg).decoder.layers[0].mlp.train()

    try:
        yield make
    finally:
        kernel_rule.allow_fast_paths_on_cpu(False)
        destroy()
        cpu_mode.disable()


def _run(router, x, grad, megatron: bool):
    """One training forward and backward of ``router`` (megatron's routing where ``megatron``)."""
    saved = router.refusal
    router.refusal = "the test's reference" if megatron else saved
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    router.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    try:
        probs, routing_map = router(xi)
        (probs * grad).sum().backward()
    finally:
        router.refusal = saved
    logged = {name: e.values.clone() for name, e in tracker.metrics.items()}
    return {"probs": probs.detach(), "map": routing_map, "x_grad": xi.grad, "w_grad": router.weight.grad,
            "logged": logged, "ran": router.last}


CASES = {
    "z-and-aux": ({}, {"z_loss", "load_balancing_loss"}),
    "aux-only": ({"model.moe.z_loss_coeff": 0.0}, {"load_balancing_loss"}),
    "z-only": ({"model.moe.load_balancing": "none"}, {"z_loss"}),
    "no-losses": ({"model.moe.load_balancing": "none", "model.moe.z_loss_coeff": 0.0}, set()),
    "pre-softmax": ({"model.moe.router_pre_softmax": True}, {"z_loss", "load_balancing_loss"}),
    "pre-softmax-top3": ({"model.moe.router_pre_softmax": True, "model.moe.top_k": 3}, {"z_loss", "load_balancing_loss"}),
    "top1-pre-softmax-aux-only": ({"model.moe.top_k": 1, "model.moe.router_pre_softmax": True, "model.moe.z_loss_coeff": 0.0}, {"load_balancing_loss"}),
    "per-token-loss": ({}, {"z_loss", "load_balancing_loss"}),
    "scaling-factor": ({"model.moe.router_pre_softmax": True}, {"z_loss", "load_balancing_loss"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_workbench_router_equals_megatrons_topk_router(build, case):
    over, losses = CASES[case]
    cfg, mlp = build(**over)
    router = mlp.router
    assert type(router).__name__ == "WorkbenchRouter" and router.refusal is None
    assert kernel_rule.choose(cfg).moe_router == "workbench"
    if case == "per-token-loss":
        router.calculate_per_token_loss = True
    if case == "scaling-factor":
        router.config.moe_router_topk_scaling_factor = 2.5
    g = torch.Generator().manual_seed(11)
    x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size, generator=g)
    # a gradient that varies per token and expert, so every path into the logits is exercised
    grad = torch.randn(x.shape[0] * x.shape[1], cfg.model.moe.num_experts, generator=g)
    for _ in range(2):  # (a second step: the autoscaler's loss scale set by the first)
        ours, want = _run(router, x, grad, megatron=False), _run(router, x, grad, megatron=True)
    assert ours["ran"] == "workbench" and want["ran"] == "megatron"
    assert set(ours["logged"]) == set(want["logged"]) >= losses  # (the tracker keeps earlier cases' names, zeroed)
    for name, values in want["logged"].items():
        assert torch.equal(ours["logged"][name], values), name
        assert bool(values.ne(0).any()) == (name in losses), name
    assert torch.equal(ours["map"], want["map"]) and ours["map"].dtype == torch.bool
    assert int(ours["map"].sum()) == x.shape[0] * x.shape[1] * cfg.model.moe.top_k
    for key in ("probs", "x_grad", "w_grad"):
        assert torch.equal(ours[key], want[key]), key
    # evaluation: no losses, megatron's unsorted top-k
    with torch.no_grad():
        router.eval()
        got, want_eval = router(x), TopKRouter.forward(router, x)
        router.train()
    assert torch.equal(got[0], want_eval[0]) and torch.equal(got[1], want_eval[1])


def test_the_layer_is_the_same_with_either_router_and_the_dispatcher_takes_the_counts(build):
    cfg, mlp = build()
    router, dispatcher = mlp.router, mlp.token_dispatcher
    assert dispatcher.router is router
    x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size,
                    generator=torch.Generator().manual_seed(3))
    taken = []
    take = router.take_counts
    router.take_counts = lambda m: taken.append(take(m)) or taken[-1]
    results = []
    for megatron in (False, True):
        router.refusal = "the test's reference" if megatron else None
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y, _ = mlp(xi)
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad for _, p in sorted(mlp.named_parameters()) if p.grad is not None])
    router.refusal = None
    del router.take_counts
    assert taken[0] is not None and taken[1] is None  # the workbench router's counts; megatron's: counted again
    assert router._counts is None
    assert len(results[0]) == len(results[1]) > 3
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_what_the_router_cannot_do_runs_megatrons(build):
    from workbench.backend.moe_router import refusal

    cfg, mlp = build(**{"model.moe.load_balancing": "seq_aux_loss"})
    choice = kernel_rule.choose(cfg)
    assert choice.moe_dispatch == "workbench" and choice.moe_router == "megatron"
    assert type(mlp.router) is TopKRouter and "megatron's router" in choice.describe()

    cfg, mlp = build()
    assert "workbench's router" in kernel_rule.choose(cfg).describe()
    router = mlp.router
    x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size)
    mask = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.bool)  # megatron's layout
    router(x, padding_mask=mask.t())
    assert router.last == "megatron"
    router(x)
    assert router.last == "workbench"
    c = router.config
    for field, value, why in (("moe_router_score_function", "sigmoid", "score function"),
                              ("moe_router_group_topk", 2, "grouped top-k"),
                              ("moe_expert_capacity_factor", 1.0, "capacity factor"),
                              ("moe_router_load_balancing_type", "global_aux_loss", "load balancing")):
        old = getattr(c, field)
        setattr(c, field, value)
        try:
            assert why in refusal(router)
        finally:
            setattr(c, field, old)
    assert refusal(router) is None


def test_the_kernel_rule_names_the_router():
    gpu = preset("moe-research")

    def router(**over):
        return kernel_rule.choose(gpu.replace(**over), te=False).moe_router

    assert kernel_rule.choose(preset("tiny")).moe_router == ""
    assert router() == "workbench"
    assert router(**{"model.moe.load_balancing": "none"}) == "workbench"
    assert router(**{"model.moe.load_balancing": "seq_aux_loss"}) == "megatron"
    assert router(**{"model.moe.capacity_factor": 1.25}) == "megatron"  # megatron's dispatcher, megatron's router
    assert router(**{"model.moe.token_dispatcher": "allgather"}) == "megatron"


@pytest.mark.slow
@pytest.mark.parametrize("pre_softmax", [False, True])
def test_the_compiled_routing_equals_the_eager_one(pre_softmax):
    """:func:`route` through ``torch.compile`` (inductor, here on the CPU; on CUDA the trainer's path): one graph, the
    same routing map and counts, the losses and probabilities to an ulp or so, the gradient of the logits to 1e-6
    (the fused kernels sum in their own order)."""
    import torch._dynamo

    from workbench.backend.moe_router import route

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(512, 64, generator=g, requires_grad=True)
    w = torch.randn(512, 64, generator=g)
    args = (8, pre_softmax, None, 1e-3, 0.01, False, True)
    assert torch._dynamo.explain(route)(logits, *args).graph_break_count == 0
    got, want = torch.compile(route, dynamic=False)(logits, *args), route(logits, *args)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for a, b in zip((got[0],) + got[3:], (want[0],) + want[3:]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    grads = [torch.autograd.grad((out[0] * w).sum() + out[3], logits)[0] for out in (got, want)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6 * float(grads[1].abs().max()))
