"""Subprocess helper for tests/backend/test_compiled_layer.py (own process: megatron parallel state is global).

    python tests/support/compiled_layer_check.py layer [--compile]   -> JSON: stock vs fast-layer loss / grad diffs
    python tests/support/compiled_layer_check.py reference           -> JSON: workbench GPT vs bench reference GPT, same weights
    python tests/support/compiled_layer_check.py trainer --fast 0|1  -> JSON: losses of 3 Trainer steps
    torchrun --nproc_per_node 2 tests/support/compiled_layer_check.py tp2  -> JSON: TP=2 fast layer vs stock (CPU, gloo)
    python tests/support/compiled_layer_check.py tp2-order -> JSON: GEMM / collective order in the compiled backward of one rank
                                                        of TP=2 (a fake process group of two ranks; under torchrun: gloo)
    python tests/support/compiled_layer_check.py families            -> JSON: BERT / T5 / RoPE GPT Trainer steps, stock vs fast
    python tests/support/compiled_layer_check.py fp8                 -> JSON: RoPE GPT Trainer steps, fast layer without / with FP8 GEMMs
    python tests/support/compiled_layer_check.py all                 -> all of the above in one process (stock trainer first)
    python tests/support/compiled_layer_check.py all+families        -> all, then families, in one process
    CHECK_COMPILE=1 python tests/support/compiled_layer_check.py compiled -> {"layer": layer --compile, "families", "fp8"}
                                                                            in one process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workbench import kernel_rule  # noqa: E402
from workbench.config import preset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/support: live_bytes.py
from live_bytes import LiveBytes  # noqa: E402

VARIANTS = {
    "gpt": {},
    "llama-like": {"model.normalization": "rmsnorm", "model.activation": "swiglu", "model.attention_type": "grouped",
                   "model.num_query_groups": 2, "model.add_bias_linear": False},
    # activation recompute on the dense path: the MLP inside the layer's graph, or megatron's
    # full (per-block) checkpoint around the compiled layers
    "recompute-selective": {"parallel.recompute": "selective"},
    "recompute-full": {"parallel.recompute": "full"},
    # the rotary embedding's freqs arrive per call and are applied inside the graph
    "rope": {"model.position_embedding": "rope"},
    # not on the dense path: ALiBi is refused at build (dropout is on it: tests/support/dropout_check.py)
    "alibi": {"model.position_embedding": "alibi"},
}


def _env(port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def _build(cfg, layer_cls):
    from workbench.rank.build import build_model
    from workbench.models.gpt import model as gm

    spec = gm.layer_spec(cfg)
    spec.module = layer_cls
    orig = gm.layer_spec
    gm.layer_spec = lambda *_args: spec
    try:
        torch.manual_seed(0)
        return build_model(cfg)
    finally:
        gm.layer_spec = orig


def _stock_vs_fast(cfg, measure_kept: bool = False):
    """Stock and compiled-layer GPTs with the same weights, one forward/backward each on the same
    batch: (stock, fast, [loss_stock, loss_fast], max relative grad difference over parameters,
    [bytes each forward left for backward] when ``measure_kept``: eager, one process)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from workbench.backend import compiled_layer

    stock = _build(cfg, TransformerLayer)
    fast = _build(cfg, compiled_layer.CompiledTransformerLayer)
    fast.load_state_dict(stock.state_dict())
    g = torch.Generator().manual_seed(1)
    b, s = 2, cfg.model.seq_length
    tok = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    lab = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    losses, kept = [], []
    for m in (stock, fast):
        # the activation bytes the forward left for backward (plus the loss)
        live = LiveBytes(known=[*m.parameters(), tok, lab, pos]) if measure_kept else contextlib.nullcontext()
        with live:
            loss = m(tok, pos, None, labels=lab).mean()
        kept.append(live.cur if isinstance(live, LiveBytes) else None)
        loss.backward()
        losses.append(loss.item())
    grad_rel = 0.0
    for (_, p), (_, q) in zip(stock.named_parameters(), fast.named_parameters()):
        grad_rel = max(grad_rel, ((p.grad - q.grad).norm() / (p.grad.norm() + 1e-12)).item())
    return stock, fast, losses, grad_rel, kept


def check_layer(compile_: bool) -> dict:
    from workbench.backend import compiled_layer, distributed

    compiled_layer.set_compile(compile_)
    out = {}
    for i, (name, over) in enumerate(VARIANTS.items()):
        cfg = preset("tiny", **over)
        if i == 0:
            distributed.initialize_for_tests(cfg, port=int(os.environ.get("CHECK_PORT", "29611")))
        stock, fast, losses, grad_rel, kept = _stock_vs_fast(cfg, measure_kept=not compile_)
        out[name] = {
            "loss_stock": losses[0], "loss_fast": losses[1], "grad_rel_max": grad_rel,
            "kept_bytes_stock": kept[0], "kept_bytes_fast": kept[1],
            "fast_calls": sum(getattr(l, "fast_calls", 0) for l in fast.decoder.layers),
            "blockers": [l.fast_path_blocker for l in fast.decoder.layers],
            "stock_keys_equal": sorted(stock.state_dict()) == sorted(fast.state_dict()),
        }
        if name == "gpt" and not compile_:  # asserted eagerly only (test_compiled_layer.py): no extra inference graph
            out[name]["eval_calls"] = _eval_calls(cfg, stock, fast)
    return out


def _eval_calls(cfg, stock, fast) -> dict:
    """Eval-mode forwards (no grad): at the trained shape the compiled layer serves them; at another
    length (a prompt) the stock forward does.  {length: [compiled calls, |logits difference|]}."""
    out = {}
    stock.eval(), fast.eval()
    for s in (cfg.model.seq_length, cfg.model.seq_length // 2 + 3):
        tok = torch.randint(0, cfg.model.vocab_size, (2, s), generator=torch.Generator().manual_seed(s))
        pos = torch.arange(s)[None].expand(2, s)
        before = sum(l.fast_calls for l in fast.decoder.layers)
        with torch.no_grad():
            diff = (stock(tok, pos, None) - fast(tok, pos, None)).abs().max().item()
        out[s] = [sum(l.fast_calls for l in fast.decoder.layers) - before, diff]
    return out


#: the sequence length of the TP=2 checks (the tiny preset's shape otherwise, micro-batch 2): that of
#: check_tp2_order's layer, so the C++ kernels of check_tp2's compiled cases are largely the kernels tp2-order needs
#: (inductor's kernel cache is keyed by their source, and the tp2-order process runs after the torchrun)
TP2_SEQ = 16


CHUNKED = {"parallel.sequence_parallel": True, "parallel.tp_chunked": True, "train.compile_kernels": True}


def check_tp2() -> dict:
    """Under torchrun --nproc_per_node 2 (CPU, gloo): the TP=2 fast layer vs stock, per rank.

    ``CHECK_COMPILE=1``: the layer under torch.compile; ``CHECK_CASES``: only these cases (comma-separated).
    ``CHECK_THEN_COMPILE``: after those, these cases again under torch.compile in the same ranks, as
    ``"compile:<case>"`` (their ``graph_breaks`` counted from the start of that phase)."""
    import torch.distributed as dist

    from workbench.backend import compiled_layer, distributed

    out = {}
    first = True
    # one compiled graph per layer with functional collectives; "+sp": sequence parallelism
    # (all-gather / reduce-scatter inside that graph)
    cases = {"gpt": VARIANTS["gpt"], "llama-like": VARIANTS["llama-like"],
             "gpt+sp": {**VARIANTS["gpt"], "parallel.sequence_parallel": True},
             "llama-like+sp": {**VARIANTS["llama-like"], "parallel.sequence_parallel": True},
             # the rotary embedding on the sequence-parallel layer (each rank rotates the gathered sequence)
             "rope+sp": {**VARIANTS["llama-like"], **VARIANTS["rope"], "parallel.sequence_parallel": True},
             # selective recompute: the checkpointed MLP's partial product is reduced outside the checkpoint
             "gpt+sp+selective": {**VARIANTS["gpt"], "parallel.sequence_parallel": True, "parallel.recompute": "selective"},
             # full recompute: megatron's checkpoint re-runs the layer, collectives included, in backward
             "gpt+full": {**VARIANTS["gpt"], "parallel.recompute": "full"},
             # parallel.tp_chunked: each GEMM in two row chunks, its collective an exchange with the peer (the kernel
             # rule's choice for the compiled layer: compile_kernels on)
             "gpt+sp+chunked": {**VARIANTS["gpt"], **CHUNKED},
             "rope+sp+chunked": {**VARIANTS["llama-like"], **VARIANTS["rope"], **CHUNKED},
             "gpt+sp+selective+chunked": {**VARIANTS["gpt"], **CHUNKED, "parallel.recompute": "selective"}}
    phases = [(os.environ.get("CHECK_COMPILE") == "1", os.environ.get("CHECK_CASES"), "")]
    if os.environ.get("CHECK_THEN_COMPILE"):
        phases.append((True, os.environ["CHECK_THEN_COMPILE"], "compile:"))
    for compile_, only, prefix in phases:
        compiled_layer.set_compile(compile_)
        breaks_before = _graph_breaks()
        for name, over in cases.items():
            if only and name not in only.split(","):
                continue
            cfg = preset("tiny", **over, **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2,
                                            "model.seq_length": TP2_SEQ})
            if first:
                distributed.initialize(cfg)
                first = False
            # tp_chunked is the kernel rule's choice for the compiled layer, which on CPU runs only when allowed
            kernel_rule.allow_fast_paths_on_cpu(bool(over.get("parallel.tp_chunked")))
            stock, fast, losses, rel, _ = _stock_vs_fast(cfg)
            kernel_rule.allow_fast_paths_on_cpu(False)
            worst = torch.tensor([rel, abs(losses[0] - losses[1])])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            calls = torch.tensor([float(sum(l.fast_calls for l in fast.decoder.layers))])
            dist.all_reduce(calls)
            out[prefix + name] = {
                "loss_stock": losses[0], "loss_fast": losses[1], "grad_rel_max": worst[0].item(),
                "loss_diff_max": worst[1].item(), "fast_calls_all_ranks": calls.item(),
                "blockers": [l.fast_path_blocker for l in fast.decoder.layers],
                "one_graph": ["tp_group" in getattr(l, "_static", {}) for l in fast.decoder.layers],
                "chunked": ["tp_chunk_rank" in getattr(l, "_static", {}) for l in fast.decoder.layers],
                "graph_breaks": _graph_breaks() - breaks_before,
                "local_qkv_rows": int(fast.decoder.layers[0].self_attention.linear_qkv.weight.shape[0])}
    return out


def check_tp2_order() -> dict:
    """One process under a fake two-rank process group (or under torchrun on two gloo ranks): the order of GEMMs and
    collectives in inductor's generated backward of the TP=2 layer, with ``tp_overlap`` on and off, with and
    without SP (per case a list of "mm" / "start" / "wait" in code order); with ``async_tp`` on and off, the
    collectives and fused symmetric-memory ops the forward's and the backward's code call."""
    import torch.distributed as dist
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor

    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun (which sets it): two gloo ranks
        dist.init_process_group("gloo")
    else:  # one process: torch's fake process group of two ranks (collectives compile and run, exchanging nothing);
        # the code inductor generates for one rank does not depend on the backend, and the ranks' code is the same
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    # the code is generated, not loaded from a cache: no FX-graph or AOTAutograd cache, so every case lowers its graph
    # and runs its post-grad passes (the overlap pass among them) afresh.  The C++ kernel cache stays on (keyed by the
    # kernel's source and compile command: the same source gives the same binary), so cases whose kernels are the same
    # (the overlap on and off differ only in their order) and ranks under torchrun compile each kernel once
    inductor.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    out = {}
    cases = [(overlap, sp, None) for overlap in (True, False) for sp in (False, True)]
    cases += [(overlap, False, "tensorwise") for overlap in (True, False)]  # FP8 wgrad GEMMs are _scaled_mm
    for overlap, sp, fp8 in cases:
        out[f"overlap={overlap},sp={sp}" + (f",fp8={fp8}" if fp8 else "")] = _tp2_code(overlap, sp, fp8)[1]
    # parallel.async_tp: the forward's and the backward's code (the symmetric-memory ops replace the collectives)
    for async_tp, bias in ((True, False), (True, True), (False, False)):
        fwd, bwd = _tp2_code(False, True, None, async_tp=async_tp, bias=bias, events=False)
        out[f"async_tp={async_tp},bias={bias}"] = {"forward": _collective_calls(fwd), "backward": _collective_calls(bwd)}
    # parallel.tp_chunked (each rank of two: their halves join in opposite orders; SP, Llama's no biases): the
    # exchanges and GEMMs of forward and backward
    kinds = ("gemm", "start", "exchange", "wait")
    for rank in (0, 1):
        fwd, bwd = _tp2_code(False, True, None, bias=False, events=False, chunk=rank)
        out[f"chunked,rank={rank}"] = {"forward": _events(fwd, kinds), "backward": _events(bwd, kinds)}
    return out


def _collective_calls(code: str) -> dict:
    """How many times the generated code calls each TP collective and each fused symmetric-memory op."""
    import re

    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "fused_all_gather_matmul", "fused_matmul_reduce_scatter")
    return {n: len(re.findall(rf"\.{n}\.default\(", code)) for n in names}


_KINDS = (("mm", r"extern_kernels\.mm\(|_scaled_mm(\.default)?\("),
          ("gemm", r"extern_kernels\.(mm|addmm)\("),  # a GEMM, its epilogue's add included (tp_chunked's wgrads)
          ("start", r"_c10d_functional\.(all_reduce_?|reduce_scatter_tensor|all_gather_into_tensor)\.default\("),
          ("exchange", r"_c10d_functional\.all_to_all_single\.default\("),
          ("wait", r"_c10d_functional\.wait_tensor\.default\("))


def _events(code: str, kinds=("mm", "start", "exchange", "wait")) -> list[str]:
    """The GEMMs ("mm"; "gemm": an addmm too), collective starts ("start", "exchange": an all-to-all) and waits of
    generated code, in order."""
    import re

    pats = [(k, re.compile(p)) for k, p in _KINDS if k in kinds]
    found = []
    for line in code.split("def call", 1)[1].splitlines():
        for kind, pattern in pats:
            if pattern.search(line):
                found.append(kind)
    return found


def _tp2_code(overlap: bool, sp: bool, fp8, async_tp: bool = False, bias: bool = True, events: bool = True,
              chunk: int | None = None):
    """Inductor's generated (forward, backward) code of one rank of the TP=2 layer (backward as "mm" / "start" / "wait"
    events with ``events``; ``bias``: the linear layers' and norms' biases, as GPT-2's, else none, as Llama's).  ``async_tp``: under torch's symmetric-memory test mode (no GPU: its ops run their
    reference implementations, registered here for CPU tensors; what is checked is the code inductor generates).
    ``chunk``: ``parallel.tp_chunked``'s ``tp_chunk_rank`` (the code of that rank of two)."""
    import contextlib

    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from workbench.backend import compiled_layer

    h, heads, s, b, tp = 64, 4, TP2_SEQ, 2, 2
    compiled_layer._compiled.cache_clear()
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    def pb(*shape):
        return p(*shape) if bias else None

    args = [p(s // tp if sp else s, b, h), p(h), pb(h), p(3 * h // tp, h), pb(3 * h // tp), p(h, h // tp), pb(h),
            p(h), pb(h), p(4 * h // tp, h), pb(4 * h // tp), p(h, 4 * h // tp), pb(h)]
    fn = compiled_layer._compiled("layer", False, overlap, async_tp, chunk is not None)
    kw = dict(norm="layernorm", eps1=1e-5, eps2=1e-5, heads=heads // tp, groups=heads // tp, head_dim=h // heads,
              scale=0.25, activation="gelu", tp_group=dist.group.WORLD.group_name, sequence_parallel=sp, fp8=fp8)
    if chunk is not None:
        kw["tp_chunk_rank"] = chunk
    with _symm_mem_test_mode() if async_tp else contextlib.nullcontext():
        _, codes = run_and_get_code(lambda: fn(*args, **kw).sum().backward())
    backward = next(c for c in codes if "tangents_1" in c.split("def call", 1)[-1].split("\n", 2)[1])
    forward = next(c for c in codes if c is not backward)
    if not events:
        return forward, backward
    return forward, _events(backward, ("mm", "start", "wait"))


@contextlib.contextmanager
def _symm_mem_test_mode():
    """torch's symmetric-memory test mode, with its ops' reference implementations registered for CPU tensors (they
    have CUDA kernels only)."""
    import torch.distributed._symmetric_memory as symm_mem

    for op, ref in (("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul_fallback),
                    ("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter_fallback)):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{op}", "CPU"):
            torch.library.impl(f"symm_mem::{op}", "CPU")(ref)
    with symm_mem._test_mode():
        yield


def _graph_breaks() -> int:
    """torch.compile graph breaks so far in this process (0: every compiled piece stayed one graph)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


def check_reference() -> dict:
    """Copy the workbench GPT's weights into the bench reference GPT; the losses must agree."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench.reference_gpt import ReferenceGPT, spec_from_config
    from workbench.backend import distributed
    from workbench.config import derive

    cfg = preset("tiny")
    distributed.initialize_for_tests(cfg, port=int(os.environ.get("CHECK_PORT", "29612")))
    from megatron.core.transformer.transformer_layer import TransformerLayer

    wb = _build(cfg, TransformerLayer)
    ref = ReferenceGPT(spec_from_config(cfg))
    sd = wb.state_dict()
    h, heads = cfg.model.hidden_size, cfg.model.num_attention_heads
    d = h // heads
    new = {"wte.weight": sd["embedding.word_embeddings.weight"], "wpe.weight": sd["embedding.position_embeddings.weight"],
           "ln_f.weight": sd["decoder.final_layernorm.weight"], "ln_f.bias": sd["decoder.final_layernorm.bias"]}
    for i in range(cfg.model.num_layers):
        p = f"decoder.layers.{i}."
        qkv_w = sd[p + "self_attention.linear_qkv.weight"].view(heads, 3, d, h).transpose(0, 1).reshape(3 * h, h)
        qkv_b = sd[p + "self_attention.linear_qkv.bias"].view(heads, 3, d).transpose(0, 1).reshape(3 * h)
        new.update({
            f"blocks.{i}.ln_1.weight": sd[p + "input_layernorm.weight"], f"blocks.{i}.ln_1.bias": sd[p + "input_layernorm.bias"],
            f"blocks.{i}.c_attn.weight": qkv_w, f"blocks.{i}.c_attn.bias": qkv_b,
            f"blocks.{i}.c_proj.weight": sd[p + "self_attention.linear_proj.weight"],
            f"blocks.{i}.c_proj.bias": sd[p + "self_attention.linear_proj.bias"],
            f"blocks.{i}.ln_2.weight": sd[p + "pre_mlp_layernorm.weight"], f"blocks.{i}.ln_2.bias": sd[p + "pre_mlp_layernorm.bias"],
            f"blocks.{i}.c_fc.weight": sd[p + "mlp.linear_fc1.weight"], f"blocks.{i}.c_fc.bias": sd[p + "mlp.linear_fc1.bias"],
            f"blocks.{i}.mlp_proj.weight": sd[p + "mlp.linear_fc2.weight"], f"blocks.{i}.mlp_proj.bias": sd[p + "mlp.linear_fc2.bias"],
        })
    new["lm_head.weight"] = new["wte.weight"]
    missing, unexpected = ref.load_state_dict(new, strict=True), None
    g = torch.Generator().manual_seed(2)
    b, s = 2, cfg.model.seq_length
    tok = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    lab = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    wb_loss = wb(tok, pos, None, labels=lab).mean().item()
    ref_loss = ref(tok, lab).item()
    n_ref = sum(p.numel() for p in ref.parameters())
    n_wb = sum(p.numel() for p in wb.parameters())
    return {"wb_loss": wb_loss, "ref_loss": ref_loss, "ref_params": n_ref, "wb_params": n_wb,
            "derived_params": derive(cfg).params.total}


#: the compiled layer beyond GPT's causal layer: (preset, overrides) per case, trained stock and fast
FAMILY_CASES = {
    # BERT: bidirectional attention under the [b, 1, 1, s] padding mask, MLM + sentence-order losses
    "bert": ("bert-tiny", {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}),
    # T5: padding-masked encoder with the relative bias, causal decoder with the bias, cross-attention, GEGLU
    "t5": ("t5-tiny", {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}),
    # T5 with padded encoder inputs: the padding mask (encoder self-attention with the bias, and the
    # decoder's cross-attention context_mask) masks real keys (see _padded_t5)
    "t5-padded": ("t5-tiny", {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}),
    # T5 v1.0's ReLU MLP
    "t5-relu": ("t5-tiny", {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0, "model.activation": "relu",
                            "model.gelu_approximate": "none"}),
    # GPT with the rotary embedding (half the head rotated) and GQA
    "gpt-rope": ("tiny", {"model.position_embedding": "rope", "model.rotary_percent": 0.5, "model.normalization": "rmsnorm",
                          "model.activation": "swiglu", "model.attention_type": "grouped", "model.num_query_groups": 2,
                          "model.add_bias_linear": False}),
    # mixture of experts, every second layer (one dense, one MoE): the MoE layer's attention half compiled, its MLP
    # half (router, dispatch, grouped experts) megatron's
    "moe": ("moe-tiny", {"model.moe.layer_freq": 2, "model.moe.router_stats_interval": 0}),
}


@contextlib.contextmanager
def _padded_t5():
    """Synthetic T5 samples whose encoder input ends in 5..17 padding positions (enc_mask 0, token 0)."""
    from workbench.models.t5.data import SyntheticT5Dataset

    get = SyntheticT5Dataset.__getitem__

    def padded(self, idx):
        item = dict(get(self, idx))
        n = 5 + int(idx) % 13
        item["enc_mask"] = item["enc_mask"].clone()
        item["enc_mask"][-n:] = 0
        item["tokens"] = item["tokens"].clone()
        item["tokens"][-n:] = 0
        return item

    SyntheticT5Dataset.__getitem__ = padded
    try:
        yield
    finally:
        SyntheticT5Dataset.__getitem__ = get


def check_families() -> dict:
    """Per FAMILY_CASES entry: three Trainer steps stock vs fast (eager), one process."""
    from megatron.core import parallel_state

    out = {}
    for name, (preset_name, over) in FAMILY_CASES.items():
        runs = {}
        for fast in (False, True):
            with _padded_t5() if name == "t5-padded" else contextlib.nullcontext():
                runs["fast" if fast else "stock"] = check_trainer(fast, preset_name, {**over, "data.source": "synthetic"})
            parallel_state.destroy_model_parallel()
        out[name] = runs
    return out


def check_fp8() -> dict:
    """Three Trainer steps of a RoPE/GQA/SwiGLU GPT on the compiled layer without FP8 and under both FP8 recipes."""
    from megatron.core import parallel_state

    over = {**FAMILY_CASES["gpt-rope"][1], "data.source": "synthetic"}
    out = {}
    from workbench.backend import fp8

    for recipe in ("off", "tensorwise", "rowwise"):
        casts = fp8.weight_casts()
        out[recipe] = check_trainer(True, "tiny", {**over, "train.fp8": recipe})
        out[recipe]["weight_casts"] = fp8.weight_casts() - casts
        parallel_state.destroy_model_parallel()
    return out


def check_compiled() -> dict:
    """Under ``CHECK_COMPILE=1``: ``layer --compile``, ``families`` and ``fp8`` in one process, in that order, each
    starting from dynamo's empty caches and a torn-down megatron parallel state (as in a process of its own; what
    they share is the process's start, its imports and inductor's on-disk caches, which separate processes share
    too)."""
    import torch._dynamo
    from megatron.core import parallel_state

    out = {}
    for name, check in (("layer", lambda: check_layer(True)), ("families", check_families), ("fp8", check_fp8)):
        torch._dynamo.reset()
        out[name] = check()
        parallel_state.destroy_model_parallel()
    return out


def check_trainer(fast: bool, preset_name: str = "tiny", over: dict | None = None) -> dict:
    from workbench.backend import compiled_layer
    from workbench.rank.train import Trainer

    compiled_layer.allow_on_cpu(fast)
    compiled_layer.set_compile(fast and os.environ.get("CHECK_COMPILE") == "1")
    over = over or {"data.source": "synthetic"}
    cfg = preset(preset_name, **{"train.compile_kernels": fast, "train.eval_interval": 0, **over})
    _env(int(os.environ.get("CHECK_PORT", "29613")))
    run_dir = tempfile.mkdtemp(prefix="compiled-layer-check-")
    try:
        tr = Trainer(cfg, run_dir)
        tr.setup()
        losses, norms = [], []
        for _ in range(3):
            res = tr.train_step()
            losses.append(sum(res["losses"].values()))
            norms.append(float(res["grad_norm"]))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    layers = [m for m in tr.model[0].modules() if hasattr(m, "fast_calls")]
    return {"losses": losses, "grad_norms": norms, "kernel_path": tr.kernel_path, "layers": len(layers),
            "fast_calls": sum(m.fast_calls for m in layers), "blockers": [m.fast_path_blocker for m in layers]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["layer", "reference", "trainer", "all", "tp2", "tp2-order", "families", "fp8",
                                     "compiled", "all+families"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fast", type=int, default=1)
    a = ap.parse_args()
    if a.what in ("all", "all+families"):
        from megatron.core import parallel_state

        res = {"layer": check_layer(a.compile), "reference": None, "trainer_stock": None, "trainer_fast": None}
        parallel_state.destroy_model_parallel()
        res["reference"] = check_reference()
        parallel_state.destroy_model_parallel()
        res["trainer_stock"] = check_trainer(False)  # before the fast run patches megatron's fallbacks
        parallel_state.destroy_model_parallel()
        res["trainer_fast"] = check_trainer(True)
        if a.what == "all+families":  # then the families, as `families` runs them (stock and fast alternate there too)
            parallel_state.destroy_model_parallel()
            res["families"] = check_families()
    elif a.what in ("tp2", "tp2-order"):
        res = check_tp2() if a.what == "tp2" else check_tp2_order()
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    elif a.what == "compiled":
        res = check_compiled()
    elif a.what == "layer":
        res = check_layer(a.compile)
    elif a.what == "families":
        res = check_families()
    elif a.what == "fp8":
        res = check_fp8()
    elif a.what == "reference":
        res = check_reference()
    else:
        res = check_trainer(bool(a.fast))
    print("RESULT " + json.dumps(res, default=str))
    return 0


def _exit(code: int) -> None:
    """Tear down the process group, then leave without interpreter finalisation.

    CI (torch 2.14.1, 2 cores) saw this helper abort after printing its result ("terminate
    called without an active exception", exit -6): a gloo/compile worker thread still alive
    while Python finalised the process group.  The result is already printed; nothing is
    left to clean up that the OS does not.
    """
    from workbench.backend import distributed

    distributed.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
