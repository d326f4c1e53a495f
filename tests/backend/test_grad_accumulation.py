"""The workbench's main_grad accumulation (workbench.backend.grad_accumulation) against megatron DDP's own add."""

import pytest
import torch

from workbench import kernel_rule
from workbench.config import preset
from tests.support import ROOT


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


def test_the_kernel_rule_fuses_weight_gradients_only_where_the_compiled_layer_can_add_them_itself():
    base = {"parallel.device": "cuda", "train.precision": "bf16", "train.compile_kernels": True}
    assert kernel_rule.choose(preset("tiny", **base), te=False).wgrad_fused  # the step graph's default
    assert kernel_rule.choose(preset("tiny", **base, **{"train.cuda_graphs": False}), te=False).wgrad_fused
    for why in ({"train.fp8": "tensorwise"}, {"parallel.recompute": "selective"}, {"parallel.tensor_parallel": 2},
                {"train.compile_kernels": False}, {"train.forward_step": "my_hooks:forward_step"}):
        choice = kernel_rule.choose(preset("tiny", **{**base, **why}), te=False)
        assert not choice.wgrad_fused, (why, choice)
    te = kernel_rule.choose(preset("tiny", **base, **{"model.attention_backend": "te", "train.cuda_graphs": True}), te=True)
    assert te.layer == "stock" and not te.wgrad_fused


def _fused_ddp(cfg, fused: bool):
    """``cfg``'s model on the compiled layer (eagerly, on CPU) under megatron DDP, the workbench's hooks installed;
    ``fused``: as the kernel rule built it (its GEMM weights' gradients added in their GEMMs), else with that
    switched off before DDP (every weight through ``.grad`` and the hooks)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from workbench.backend import grad_accumulation, tied_embedding
    from workbench.backend.compiled_layer import CompiledTransformerLayer
    from workbench.backend.model import transformer_config
    from workbench.rank.build import build_model

    torch.manual_seed(0)
    tc = transformer_config(cfg)
    model = build_model(cfg, config=tc)
    layers = [m for m in model.modules() if isinstance(m, CompiledTransformerLayer)]
    assert layers and all(m.wgrad_fused for m in layers)
    if not fused:
        for m in layers:
            m.wgrad_fused = False
            for linear in m._gemm_linears():
                del linear.weight._workbench_wgrad_fused
    ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    tied = tied_embedding.install([ddp]) if fused else 0  # (as the trainer does with wgrad_fused, before the hooks)
    assert tied == (1 if fused else 0)  # (tiny ties its embedding and LM head)
    return ddp, grad_accumulation.install([ddp], min_numel=0), layers


@pytest.fixture()
def fused_pair(dist_group):
    """The tiny model on the compiled layer (eagerly, on CPU) twice, as :func:`_fused_ddp` builds it: ``(hooks,
    fused)``, each ``(ddp, hooks installed, compiled layers)``."""
    from workbench.backend import compiled_layer

    compiled_layer.allow_on_cpu()
    compiled_layer.set_compile(False)
    try:
        cfg = preset("tiny", **{"train.compile_kernels": True})
        yield _fused_ddp(cfg, fused=False), _fused_ddp(cfg, fused=True)
    finally:
        compiled_layer.set_compile(True)
        compiled_layer.allow_on_cpu(False)


def test_fused_weight_gradients_sum_what_the_hooks_sum(fused_pair):
    """``KernelChoice.wgrad_fused``: the compiled layer's GEMM weights get their gradients added into main_grad by
    :func:`grad_accumulation.linear`, and the tied embedding / LM head weight its two parts (the head's GEMM, the
    lookup's rows) -- over three micro-batches and two steps the same sums as ``.grad`` and the workbench's hooks;
    those weights get no hook of ours, and megatron's drops their placeholder ``.grad``."""
    (hooks, n_hooks, _), (fused, n_fused, layers) = fused_pair
    tied = fused.module.embedding.word_embeddings.weight  # the tied embedding / LM head (workbench.backend.tied_embedding)
    assert tied is fused.module.shared_embedding_or_output_weight()
    assert tied.zero_out_wgrad is False  # (else DDP's hook would add the head's unwritten placeholder)
    gemm = {id(linear.weight) for m in layers for linear in m._gemm_linears()} | {id(tied)}
    assert len(gemm) == 4 * len(layers) + 1 and n_hooks - n_fused == len(gemm)  # no hook of ours on them
    for step_seeds in ([1, 2, 3], [4, 5]):
        for m in (hooks, fused):
            m.zero_grad_buffer()
            _micro_batches(m, step_seeds)
        a, b = _main_grads(hooks), _main_grads(fused)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].abs().sum() > 0, name
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(m.fast_calls for m in layers) == 5 * len(layers)  # every micro-batch took the compiled path
    for p in fused.module.parameters():
        assert p.grad is None
        if id(p) in gemm:
            assert p.grad_added_to_main_grad  # set in forward: DDP's hook dropped the placeholder


def test_the_tied_weight_path_only_where_every_training_forward_runs_the_head(dist_group):
    """``workbench.backend.tied_embedding``: installed on a tied BERT (its masked-LM head runs in every training
    forward), not on one with a sequence classifier (its forward skips the head: the lookup alone would leave DDP's hook
    without the placeholder ``.grad`` it expects under ``overlap_grad_reduce``), nor on an untied model."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from workbench.backend import tied_embedding
    from workbench.backend.model import transformer_config
    from workbench.rank.build import build_model

    def installed(name: str, **over) -> int:
        cfg = preset(name, **{"train.compile_kernels": True, **over})
        tc = transformer_config(cfg)
        ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                      module=build_model(cfg, config=tc))
        return tied_embedding.install([ddp])

    assert installed("bert-tiny") == 1
    assert installed("bert-tiny", **{"model.num_labels": 2}) == 0
    assert installed("tiny", **{"model.tie_embeddings": False}) == 0


def test_a_stock_call_among_fused_ones_keeps_its_weight_gradients(fused_pair, monkeypatch):
    """A training micro-batch that takes megatron's stock forward on a ``wgrad_fused`` layer writes real ``.grad``s:
    its forward clears the flag the fused micro-batch before it set, so DDP's hook adds them (without it the hook
    would drop them and main_grad would lack that micro-batch)."""
    from workbench.backend.compiled_layer import CompiledTransformerLayer

    (hooks, _, _), (fused, _, layers) = fused_pair
    for m in (hooks, fused):
        m.zero_grad_buffer()
    _micro_batches(hooks, [1, 2, 3])
    _micro_batches(fused, [1])
    with monkeypatch.context() as patch:
        patch.setattr(CompiledTransformerLayer, "_call_is_plain", lambda self, args, kwargs: False)
        _micro_batches(fused, [2])
    _micro_batches(fused, [3])
    assert sum(m.fast_calls for m in layers) == 2 * len(layers)  # micro-batch 2 took the stock forward
    a, b = _main_grads(hooks), _main_grads(fused)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def _moe_ddp(precision: str, direct: bool):
    """moe-tiny (8 grouped-GEMM experts a layer, the workbench's dispatch) under megatron DDP with fp32 main_grad;
    ``direct``: the experts add their stacked gradients into main_grad themselves (install_experts)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from workbench.backend import grad_accumulation
    from workbench.backend.model import transformer_config
    from workbench.rank.build import build_model

    cfg = preset("moe-tiny", **{"train.compile_kernels": True, "train.precision": precision,
                                "model.moe.router_stats_interval": 0, "model.seq_length": 16})
    torch.manual_seed(0)
    tc = transformer_config(cfg)
    model = build_model(cfg, config=tc)
    if precision == "bf16":
        model = Float16Module(tc, model)
    ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    return ddp, grad_accumulation.install_experts([ddp]) if direct else {}


def _expert_layers(ddp):
    from workbench.backend.moe_experts import GroupedGemmMLP

    return [m for m in ddp.module.modules() if isinstance(m, GroupedGemmMLP)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["ddp", "not-strided"])
def test_grouped_experts_add_into_main_grad_as_ddps_per_weight_hooks(dist_group, monkeypatch, precision, layout):
    """The grouped experts' own accumulation (install_experts) sums exactly what megatron DDP's per-weight hooks
    sum, over two micro-batches and two steps: through one strided view of DDP's buffer (megatron's layout: the
    experts' weights one uniform distance apart, in reverse order) and, where the layout is not found, through the
    stacked gradient cast to fp32 and one foreach add."""
    from workbench.backend import moe_experts

    kernel_rule.allow_fast_paths_on_cpu(True)
    try:
        if layout == "not-strided":
            monkeypatch.setattr(moe_experts, "_strided_view", lambda mains: None)
        stock, none = _moe_ddp(precision, direct=False)
        ours, paths = _moe_ddp(precision, direct=True)
        assert none == {} and paths == {"strided" if layout == "ddp" else "foreach": 2}, paths  # moe-tiny: 2 layers
        layers = _expert_layers(ours)
        assert len(layers) == 2 and all(m.main_grad_direct for m in layers) and not any(m.main_grad_direct for m in _expert_layers(stock))
        for m in layers:
            w = m.local_experts[0].linear_fc1.weight
            assert w.dtype == (torch.bfloat16 if precision == "bf16" else torch.float32) and w.main_grad.dtype == torch.float32
            if layout == "ddp":  # the view is DDP's buffer itself, the experts in reverse order
                view, flipped = m._sinks[0].view, m._sinks[0].flipped
                assert flipped and view[-1].data_ptr() == w.main_grad.data_ptr()
                assert view.untyped_storage().data_ptr() == ours.buffers[0].grad_data.untyped_storage().data_ptr()
        reached = {id(m): 0 for m in (stock, ours)}  # autograd reaching an expert weight's accumulator
        for m in (stock, ours):
            for layer in _expert_layers(m):
                for e in layer.local_experts:
                    for w in (e.linear_fc1.weight, e.linear_fc2.weight):
                        w.register_post_accumulate_grad_hook(lambda p, k=id(m): reached.__setitem__(k, reached[k] + 1))
        for step_seeds in ([1, 2], [3, 4]):  # two micro-batches a step: accumulated, not assigned
            for m in (stock, ours):
                m.zero_grad_buffer()
                for s in step_seeds:
                    g = torch.Generator().manual_seed(s)
                    toks = torch.randint(0, 4000, (2, 16), generator=g)
                    m(toks, torch.arange(16)[None].expand(2, -1), None, labels=toks).float().mean().backward()
            a, b = _main_grads(stock), _main_grads(ours)
            assert a.keys() == b.keys()
            experts = [n for n in a if "local_experts" in n]
            assert len(experts) == 2 * 2 * 8  # 2 layers x 8 experts x (fc1, fc2)
            for name in a:
                assert torch.equal(a[name], b[name]), name
            assert all(a[n].abs().sum() > 0 for n in experts)
        # stock: each expert weight's accumulator (and DDP's hook) ran per micro-batch; ours: autograd never reached them
        assert reached[id(stock)] == 2 * 2 * 2 * 2 * 8 and reached[id(ours)] == 0, reached
        for m in layers:  # the experts' weights got no .grad: DDP's hooks found nothing to add
            assert all(e.linear_fc1.weight.grad is None and e.linear_fc2.weight.grad is None for e in m.local_experts)
    finally:
        kernel_rule.allow_fast_paths_on_cpu(False)


def test_the_strided_layout_is_found_only_where_it_holds():
    from types import SimpleNamespace

    from workbench.backend.moe_experts import _MainGradSink, _strided_view

    buf = torch.zeros(200)
    rows = [buf[10 + 30 * i:10 + 30 * i + 24].view(4, 6) for i in range(5)]  # one distance apart, gaps between
    view, flipped = _strided_view(tuple(rows))
    assert not flipped and all(view[i].data_ptr() == r.data_ptr() for i, r in enumerate(rows))
    view, flipped = _strided_view(tuple(rows[::-1]))  # megatron's order: the stack's first weight highest
    assert flipped and view[0].data_ptr() == rows[0].data_ptr()
    assert _strided_view(tuple(rows[:2] + rows[3:])) is None  # one missing: not one distance
    assert _strided_view(tuple(buf[i * 10:i * 10 + 24].view(4, 6) for i in range(3))) is None  # overlapping
    assert _strided_view((rows[0], rows[1].clone(), rows[2])) is None  # another storage
    assert _strided_view((rows[0], rows[1], buf[70:94].view(6, 4))) is None  # another shape
    assert _strided_view(rows[:1]) is None  # one weight: nothing to stride over

    for dtype in (torch.bfloat16, torch.float32):  # each path adds what main_grad.add_(grad) adds, twice
        for mains, path in ((tuple(rows[::-1]), "strided"), (tuple(torch.zeros(4, 6) for _ in range(5)), "foreach"),
                            (tuple(torch.zeros(4, 6, dtype=torch.float64 if i % 2 else torch.float32) for i in range(5)), "per-tensor")):
            for m in mains:
                m.zero_()
            want = [torch.zeros_like(m) for m in mains]
            weights = tuple(SimpleNamespace(main_grad=m) for m in mains)
            sink = _MainGradSink(weights)
            assert sink.path == path
            for s in (1, 2):
                grad = torch.randn(len(mains), 4, 6, generator=torch.Generator().manual_seed(s)).to(dtype)
                sink.add(grad)
                for w, g in zip(want, grad.unbind(0)):
                    w.add_(g)
            assert all(torch.equal(m, w) for m, w in zip(mains, want)), (dtype, path)
            assert sink.current(weights) and not sink.current(weights[:-1] + (SimpleNamespace(main_grad=mains[-1].clone()),))


def test_the_rows_kernel_adds_each_stacked_gradient_into_its_strided_row_in_either_order():
    """The CUDA path of the strided sink, one Triton kernel, under Triton's interpreter (CPU): rows a stride apart with
    gaps, the stack read in reverse for megatron's order, a row length that is no multiple of the block; the sums are
    torch's fp32 sums of the bf16 values, and the gaps stay untouched."""
    import subprocess
    import sys

    code = """
import torch
from workbench.backend.moe_experts import _strided_view, add_rows
for rows_n, shape, block in ((5, (4, 6), 16), (3, (7, 9), 32)):
    n = shape[0] * shape[1]
    buf = torch.full((10 + (n + 6) * rows_n,), 0.25)
    rows = [buf[10 + (n + 6) * i:10 + (n + 6) * i + n].view(shape) for i in range(rows_n)]
    for order in (rows, rows[::-1]):
        view, flipped = _strided_view(tuple(order))
        assert flipped == (order is not rows)
        before = buf.clone()
        want = [r.clone() for r in order]
        for s in (1, 2):
            g = torch.randn(rows_n, *shape, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
            add_rows(view, g, flipped, block=block)
            for w, gi in zip(want, g.unbind(0)):
                w.add_(gi)
        assert all(torch.equal(r, w) for r, w in zip(order, want)), (rows_n, flipped)
        gaps = torch.ones_like(buf, dtype=torch.bool)
        for r in rows:
            gaps[r.storage_offset():r.storage_offset() + n] = False
        assert torch.equal(buf[gaps], before[gaps])
        for r in rows:
            r.fill_(0.25)
print("ok")
"""
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
