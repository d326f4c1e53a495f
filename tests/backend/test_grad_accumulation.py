"""The workbench's main_grad accumulation (workbench.backend.grad_accumulation) against megatron DDP's own add."""

import pytest
import torch

from workbench import kernel_rule
from workbench.config import preset


def _ddp(cfg, workbench_hooks: bool, min_numel: int = 0):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from workbench.backend import grad_accumulation
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    torch.manual_seed(0)
    tc = transformer_config(cfg)
    ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(), module=build_model(cfg, config=tc))
    installed = grad_accumulation.install([ddp], min_numel=min_numel) if workbench_hooks else 0
    return ddp, installed


def _micro_batches(ddp, seeds):
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        toks = torch.randint(0, 4000, (2, 16), generator=g)
        ddp(toks, torch.arange(16)[None].expand(2, -1), None, labels=toks).mean().backward()


def _main_grads(ddp):
    return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if getattr(p, "main_grad", None) is not None}


def test_main_grads_equal_megatrons_own_accumulation_over_steps(dist_group):
    stock, _ = _ddp(dist_group, workbench_hooks=False)
    ours, installed = _ddp(dist_group, workbench_hooks=True)
    tied = {n for n, p in stock.module.named_parameters() if getattr(p, "zero_out_wgrad", False)}
    assert tied == {"embedding.word_embeddings.weight"}  # tied to the output layer: megatron's hook adds it always ...
    assert installed == len(_main_grads(ours)) > 0  # ... unless told otherwise (no fused wgrad here: see install)
    for step_seeds in ([1, 2, 3], [4, 5]):  # two steps: the second starts from zero_grad_buffer again
        for m in (stock, ours):
            m.zero_grad_buffer()
            _micro_batches(m, step_seeds)
        a, b = _main_grads(stock), _main_grads(ours)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
            assert a[name].abs().sum() > 0, name  # the micro-batches reached every parameter
    for n, p in ours.module.named_parameters():  # megatron's hook ran after ours and skipped its add
        assert p.grad is None and p.grad_added_to_main_grad, n


def test_small_parameters_keep_megatrons_add_and_sum_the_same(dist_group):
    from workbench.backend import grad_accumulation

    stock, _ = _ddp(dist_group, workbench_hooks=False)
    sizes = sorted(p.numel() for p in stock.module.parameters())
    least = sizes[len(sizes) // 2]  # about half the parameters get the hook
    ours, installed = _ddp(dist_group, workbench_hooks=True, min_numel=least)
    large = [p for p in ours.module.parameters() if p.numel() >= least]
    assert installed == len(large) == sum(hasattr(p, "_workbench_grad_hook") for p in ours.module.parameters())
    assert 0 < installed < len(sizes)
    assert grad_accumulation.MIN_NUMEL > max(sizes)  # the shipped bound leaves a tiny model to megatron entirely
    assert grad_accumulation.install([_ddp(dist_group, workbench_hooks=False)[0]]) == 0
    for m in (stock, ours):
        m.zero_grad_buffer()
        _micro_batches(m, [3, 4, 5])
    a, b = _main_grads(stock), _main_grads(ours)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_a_second_install_adds_no_second_hook(dist_group):
    from workbench.backend import grad_accumulation

    stock, _ = _ddp(dist_group, workbench_hooks=False)
    ours, installed = _ddp(dist_group, workbench_hooks=True)
    assert installed > 0 and grad_accumulation.install([ours]) == 0
    for m in (stock, ours):
        m.zero_grad_buffer()
        _micro_batches(m, [7, 8])
    a, b = _main_grads(stock), _main_grads(ours)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("field, value", [("gradient_accumulation_fusion", True), ("cuda_graph_impl", "local"),
                                          ("delay_wgrad_compute", True)])
def test_a_model_where_megatron_writes_main_grad_itself_is_refused(dist_group, field, value):
    from types import SimpleNamespace

    from workbench.backend import grad_accumulation

    ours, _ = _ddp(dist_group, workbench_hooks=False)
    with pytest.raises(ValueError, match=field):
        grad_accumulation.install([SimpleNamespace(config=SimpleNamespace(**{field: value}), module=ours.module)])


def test_the_first_micro_batch_of_a_step_copies_and_later_ones_add():
    from workbench.backend.grad_accumulation import accumulate

    acc = torch.full((8,), 5.0)
    g = torch.arange(8, dtype=torch.bfloat16)
    accumulate(acc, g, first=True)
    assert torch.equal(acc, g.float())
    accumulate(acc, g, first=False)
    assert torch.equal(acc, 2 * g.float())


def test_the_kernel_rule_leaves_megatrons_graphed_te_layer_to_megatrons_hook():
    cfg = preset("tiny", **{"parallel.device": "cuda", "train.precision": "bf16", "train.compile_kernels": True})
    assert kernel_rule.choose(cfg, te=False).grad_accumulation == "workbench"
    te = kernel_rule.choose(preset("tiny", **{"parallel.device": "cuda", "train.precision": "bf16",
                                          "model.attention_backend": "te", "train.cuda_graphs": True}), te=True)
    assert te.cuda_graphs_impl == "megatron" and te.grad_accumulation == "megatron"
