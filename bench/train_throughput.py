"""Training throughput: the workbench backend vs a compiled plain-PyTorch GPT, side by side.

One launch runs every variant that fits the GPUs present, each in its own ``torchrun``
process group (fresh CUDA context, fresh compile caches, no memory left over from the
previous variant), then prints one table and appends one JSON line per variant to
``--out`` (default ``bench/results/train_throughput.jsonl``) with device name, date and git
commit.

Variants (``--variants`` picks a subset by name):

========================  ====  ==============================================================
name                      GPUs  what runs
========================  ====  ==============================================================
reference                 1     bench/reference_gpt.py (Llama models: reference_llama.py): SDPA, fused AdamW, torch.compile, bf16 autocast
fsdp2                     2     Llama models: bench/reference_fsdp2.py, plain FSDP2 (per-block compile + fully_shard, bf16
                                params / fp32 reduce, fused AdamW): the plain-FSDP2 yardstick
torchtitan                2     Llama models: bench/reference_torchtitan.py, torchtitan 0.3.0's Llama-3 model,
                                parallelize_llama (FSDP2 + per-block compile), loss and fused AdamW (carried wheels:
                                bench/README.md); rows carry ``torchtitan_version`` and the torch-2.11 shims
torchtitan-1gpu           1     the same on one GPU (Llama models; its "scaling" is torchtitan over the workbench row)
workbench                 1     the backend's train step, default kernels (SDPA + workbench fusions)
workbench-eager           1     same, ``train.compile_kernels: false`` (SDPA, no fusions)
workbench-local           1     stock megatron-core local spec (unfused DotProductAttention, no fusions)
workbench-te              1     Transformer Engine spec (only when transformer_engine is importable)
workbench-fp8-tensorwise  1     workbench with ``train.fp8: tensorwise`` (torch-native FP8 GEMMs; "scaling": vs bf16 workbench)
workbench-fp8-rowwise     1     same, ``train.fp8: rowwise``
workbench-fp8-delayed     1     same, ``train.fp8: delayed`` (tensorwise from the previous step's maxima: casts fused)
workbench-te-fp8-<r>      1     Transformer Engine spec with TE's FP8 recipe ``tensorwise`` or ``delayed`` ("scaling": vs workbench-te)
dropout                   1     workbench with dropout 0.1, default kernels (the compiled layer applies the dropout)
dropout-stock             1     same, ``train.compile_kernels: false``: megatron's stock layer on SDPA ("scaling": vs dropout)
dropout-te                1     same on Transformer Engine's layer ("scaling": vs dropout)
recompute-selective       1     workbench with ``parallel.recompute: selective`` ("scaling": speed vs workbench)
recompute-full            1     workbench with ``parallel.recompute: full`` (1 layer per block)
dp2                       2     workbench, data parallel 2 (grad-reduce overlap on)
dp2-distopt               2     dp2 + distributed optimizer (param-gather overlap on)
tp2/gpt2-large            2     GPT-2 large (and Llama-3.2-3B when listed), tensor parallel 2 (against
                                ``workbench/<model>`` on one GPU)
tp2-8queues               2     tp2 launched with ``CUDA_DEVICE_MAX_CONNECTIONS=8`` (the backend's 1 is not applied)
tp2-no-overlap            2     tp2 with ``parallel.tp_comm_overlap: false`` (backward collectives exposed)
tp2-nograph               2     tp2 without CUDA graphs
tp2-sp                    2     tp2 plus sequence parallelism (also ``-no-overlap``, ``-nograph``)
tp2-sp-async              2     tp2-sp with ``parallel.async_tp`` (inductor's micro-pipelined TP over symmetric memory;
                                no CUDA graphs: against ``-nograph`` for its own effect)
tp2-sp-chunked            2     tp2-sp with ``parallel.tp_chunked`` (each GEMM in two row chunks, each collective an
                                exchange with the peer under the other chunk's GEMM)
tp2-bound                 2     diagnostic, not the maths: tp2 with its TP all-reduces skipped (``tp2-sp-bound``:
                                tp2-sp with its all-gathers / reduce-scatters local copies of the same shapes)
tp2-te                    2     TE's layer at TP=2 with sequence parallelism (only when TE is importable)
tp2-te-ub                 2     tp2-te with ``parallel.te_userbuffers`` (TE userbuffers, ``UB_SKIPMC=1``); also
                                ``-nograph``; ``tp2-te-fp8`` / ``tp2-te-ub-fp8``: both with TE's delayed FP8
pp2-m8                    2     GPT-2 medium / Llama-3.2-1B, pipeline parallel 2 with 8 micro-batches (against
                                ``pp1-m8``: the one-GPU default path, 8 micro-batches); also ``pp2-vpp2-m8``
                                (interleaved, 2 chunks per stage) and ``pp2-m8-nograph`` (CUDA graphs off)
workbench-<L>             1     Llama-3.2-1B at sequence ``L`` (``16k``, ``32k``: CP_LENGTHS), micro-batch 1,
                                CP_TOKENS tokens a step: the one-GPU default path with the recompute the planner
                                says it needs to fit (``cp_one_gpu_recompute``): the CP rows' baseline
cp2-<L>                   2     the same sequences split over 2 GPUs: ``parallel.context_parallel: 2`` (ring
                                attention, flash blocks), the same global batch (against ``workbench-<L>``)
torchtitan-cp2-<L>        2     the yardstick: torchtitan 0.3.0 with ``context_parallel_degree: 2`` at the same
                                length and batch (bench/reference_torchtitan.py; against ``workbench-<L>``)
cp2-te-<L>                2     ``cp2-<L>`` through megatron-core's CP in TE's attention (``attention_backend: te``;
                                only when TE is importable; against ``workbench-<L>``, reference ``cp2-<L>``)
========================  ====  ==============================================================

Per variant: tokens/s, MFU (Megatron's formula via ``derive(cfg).flops_per_step`` over
``--peak-tflops`` per GPU, 989 by default), peak memory, ratio to the reference of the same
model, and (workbench variants) the cost of the event stream (micro-batch timing on every
step vs off).  ``--profile`` adds a torch-profiler summary (top kernels, time by category)
for the reference and the default workbench variant.

Models: ``gpt2-small`` / ``-medium`` / ``-large`` (seq 1024) and ``llama3.2-1b`` / ``-3b`` (seq 2048, GQA,
RoPE, RMSNorm, SwiGLU; the reference is ``bench/reference_llama.py``).

``--quick``: fewer steps.  ``--cpu-smoke``: tiny config, 2 steps, on CPU (CI tests the script); a Llama
model in ``--models`` smokes ``tiny-llama`` (the tiny preset in the Llama layout) instead of ``tiny``.

Run on a GPU machine from the repository root::

    python bench/train_throughput.py --quick --profile
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness, profiling  # noqa: E402
# the models, the Variant and the config each trains (SEQ_LENGTH, TINY_LLAMA: kept importable from here)
from bench.variants import MODELS, SEQ_LENGTH, TINY_LLAMA, Variant, bench_config, is_llama  # noqa: E402,F401

DEFAULT_OUT = ROOT / "bench" / "results" / "train_throughput.jsonl"
PEAK_TFLOPS = 989.0

#: models one GPU cannot train (the planner: Llama-3.1-8B's one-GPU default path needs ~146 GiB at micro-batch 1):
#: their two-GPU layouts are compared with torchtitan on the same two GPUs at this global batch, not with one GPU
TWO_GPU_ONLY = {"llama3.1-8b": 8}
#: context parallelism's rows (#53): these models at these sequence lengths, micro-batch 1, CP_TOKENS tokens a step
#: (1 or 2 sequences), CP=2 on two GPUs against the one-GPU way at that length, on this GPU (the planner's name)
CP_MODELS = ("llama3.2-1b",)
CP_LENGTHS = {"16k": 16384, "32k": 32768}
CP_TOKENS = 32768
CP_GPU = "H200-141GB"


def smoke_model(model: str) -> str:
    return "tiny-llama" if is_llama(model) else "tiny"


def plan(models: list[str], gpus: int, have_te: bool, microbatches: int) -> list[Variant]:
    """Every variant that fits ``gpus`` GPUs, single-GPU rows first."""
    rows: list[Variant] = []
    one_gpu = [m for m in models if m not in TWO_GPU_ONLY]  # the others do not fit one GPU
    for m in one_gpu:  # the headline comparison first, so a cut-short launch still has it
        rows.append(Variant(f"reference/{m}", "reference", m, microbatches=microbatches))
        if is_llama(m):  # the peer project on one GPU (its FSDP over one rank: its model, compile and optimizer)
            rows.append(Variant(f"torchtitan-1gpu/{m}", "torchtitan", m, microbatches=microbatches, baseline=f"workbench/{m}"))
        rows.append(Variant(f"workbench/{m}", "workbench", m, microbatches=microbatches))
        rows.append(Variant(f"workbench-nograph/{m}", "workbench", m, microbatches=microbatches,
                            overrides={"train.cuda_graphs": False}))
    for m in one_gpu:
        for recipe in ("tensorwise", "rowwise", "delayed"):  # torch-native FP8 GEMMs ("scaling": speed vs bf16 workbench)
            rows.append(Variant(f"workbench-fp8-{recipe}/{m}", "workbench", m, microbatches=microbatches,
                                baseline=f"workbench/{m}", overrides={"train.fp8": recipe}))
        rows.append(Variant(f"workbench-eager/{m}", "workbench", m, microbatches=microbatches,  # SDPA, TE or not
                            overrides={"train.compile_kernels": False, "model.attention_backend": "sdpa"}))
        rows.append(Variant(f"workbench-local/{m}", "workbench", m, microbatches=microbatches,
                            overrides={"train.compile_kernels": False, "model.attention_backend": "local"}))
        if have_te:
            rows.append(Variant(f"workbench-te/{m}", "workbench", m, microbatches=microbatches,
                                overrides={"model.attention_backend": "te"}))
            for recipe in ("tensorwise", "delayed"):  # TE's FP8 recipes, beside the torch-native rows
                rows.append(Variant(f"workbench-te-fp8-{recipe}/{m}", "workbench", m, microbatches=microbatches,
                                    baseline=f"workbench-te/{m}", overrides={"model.attention_backend": "te", "train.fp8": recipe}))
        # dropout on the default path (the compiled layer applies it), against megatron's stock layer and TE's
        drop = harness.DROPOUT
        rows.append(Variant(f"dropout/{m}", "workbench", m, microbatches=microbatches, overrides=dict(drop)))
        rows.append(Variant(f"dropout-stock/{m}", "workbench", m, microbatches=microbatches, baseline=f"dropout/{m}",
                            overrides={**drop, "train.compile_kernels": False, "model.attention_backend": "sdpa"}))
        if have_te:
            rows.append(Variant(f"dropout-te/{m}", "workbench", m, microbatches=microbatches, baseline=f"dropout/{m}",
                                overrides={**drop, "model.attention_backend": "te"}))
        for mode in ("selective", "full"):  # what recompute costs in speed ("scaling") and saves in memory
            rows.append(Variant(f"recompute-{mode}/{m}", "workbench", m, microbatches=microbatches,
                                baseline=f"workbench/{m}", overrides={"parallel.recompute": mode}))
    if gpus >= 2:
        for m in models:
            base = f"workbench/{m}"
            if m in TWO_GPU_ONLY:  # no one-GPU baseline: the yardstick at the model's global batch (below)
                mb = TWO_GPU_ONLY[m] // (2 * MODELS[m])
                rows.append(Variant(f"torchtitan/{m}", "torchtitan", m, gpus=2, microbatches=mb))
                rows.append(Variant(f"fsdp2/{m}", "fsdp2", m, gpus=2, microbatches=mb, baseline=f"torchtitan/{m}"))
                continue
            if is_llama(m):  # the multi-GPU yardstick (bench/reference_fsdp2.py): plain FSDP2 + compile, the same batch
                rows.append(Variant(f"fsdp2/{m}", "fsdp2", m, gpus=2, microbatches=microbatches, baseline=base))
                # torchtitan's own Llama-3 model, parallelize_llama (FSDP2 + compile), loss and optimizer
                # (bench/reference_torchtitan.py; torchtitan from the carried wheels, see bench/README.md)
                rows.append(Variant(f"torchtitan/{m}", "torchtitan", m, gpus=2, microbatches=microbatches, baseline=base))
            rows.append(Variant(f"dp2/{m}", "workbench", m, gpus=2, microbatches=microbatches, baseline=base,
                                overrides={"parallel.overlap_grad_reduce": True}))
            dopt = {"parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True,
                    "parallel.overlap_param_gather": True}
            rows.append(Variant(f"dp2-distopt/{m}", "workbench", m, gpus=2, microbatches=microbatches, baseline=base,
                                overrides=dopt))
            if is_llama(m):  # the host step's cost where a protocol row of it fits one call (8B: ~6 s a step)
                rows.append(Variant(f"dp2-distopt-offload/{m}", "workbench", m, gpus=2, microbatches=microbatches,
                                    baseline=f"dp2-distopt/{m}", overrides={**dopt, "parallel.optimizer_cpu_offload": 1.0}))
        for m in [m for m in models if m in TWO_GPU_ONLY]:  # every layout at one global batch, against torchtitan
            gb, titan = TWO_GPU_ONLY[m], f"torchtitan/{m}"
            m_dp = gb // (2 * MODELS[m])  # micro-batches a rank when both ranks hold data
            assert 2 * m_dp == 8, "the TP and PP rows of a two-GPU-only model are named for 8 micro-batches"
            dopt = {"parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True,
                    "parallel.overlap_param_gather": True}
            rows.append(Variant(f"dp2-distopt/{m}", "workbench", m, gpus=2, microbatches=m_dp, baseline=titan, overrides=dopt))
            # optimizer CPU offload (what 80 GB cards need for this layout): its cost, over the same layout without it
            rows.append(Variant(f"dp2-distopt-offload/{m}", "workbench", m, gpus=2, microbatches=m_dp,
                                baseline=f"dp2-distopt/{m}", overrides={**dopt, "parallel.optimizer_cpu_offload": 1.0}))
            tp_sp = {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}
            for name, over in (("tp2-sp", tp_sp), ("tp2-sp-async", {**tp_sp, "parallel.async_tp": True}),
                               ("pp2-m8", {"parallel.pipeline_parallel": 2})):
                rows.append(Variant(f"{name}/{m}", "workbench", m, gpus=2, microbatches=2 * m_dp, baseline=titan,
                                    overrides=over))
        tp_models = ["gpt2-large"] + [m for m in models if m == "llama3.2-3b"]
        for m in tp_models:
            if m not in models:  # TP=2's one-GPU baseline: the default path of the same model and batch
                rows.append(Variant(f"workbench/{m}", "workbench", m, microbatches=microbatches))
        # TP=2 layouts: the compiled layer is one graph with its collectives inside
        no_overlap = {"parallel.tp_comm_overlap": False}
        # the backend sets CUDA_DEVICE_MAX_CONNECTIONS=1 for TP comm overlap; a launch value is kept
        eight_queues = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
        tp_rows = {  # name: (overrides, env, bound)
            "tp2": ({}, {}, None),
            "tp2-8queues": ({}, eight_queues, None),
            "tp2-no-overlap": (no_overlap, {}, None),
            "tp2-nograph": ({"train.cuda_graphs": False}, {}, None),
            "tp2-sp": ({"parallel.sequence_parallel": True}, {}, None),
            "tp2-sp-no-overlap": ({"parallel.sequence_parallel": True, **no_overlap}, {}, None),
            "tp2-sp-nograph": ({"parallel.sequence_parallel": True, "train.cuda_graphs": False}, {}, None),
            "tp2-sp-async": ({"parallel.sequence_parallel": True, "parallel.async_tp": True}, {}, None),
            "tp2-sp-chunked": ({"parallel.sequence_parallel": True, "parallel.tp_chunked": True}, {}, None),
            "tp2-bound": ({}, {}, "no-tp-comm"),
            "tp2-sp-bound": ({"parallel.sequence_parallel": True}, {}, "no-tp-comm"),  # SP's own bound (its norms on
            # a sequence shard): TP=2 + SP's "collectives hidden" target
            # NCCL picked its low-latency protocol (RING_LL, ~105 GB/s) for the 21 MB all-reduces of GPT-2 large on
            # 2 H100s: these rows exclude it
            "tp2-nccl-simple": ({}, {"NCCL_PROTO": "Simple"}, None),
            "tp2-sp-nccl-simple": ({"parallel.sequence_parallel": True}, {"NCCL_PROTO": "Simple"}, None),
        }
        if have_te:  # TE's layer at TP=2 under SP, without and with TE's userbuffers (parallel.te_userbuffers)
            te_sp = {"model.attention_backend": "te", "parallel.sequence_parallel": True}
            ub = {**te_sp, "parallel.te_userbuffers": True}
            no_multicast = {"UB_SKIPMC": "1"}  # CUDA IPC: shared hosts keep NVLink multicast off (the backend
            # sets it too where NCCL_NVLS_ENABLE=0; named here so the row never creates multicast objects)
            tp_rows.update({
                "tp2-te": (te_sp, {}, None),
                "tp2-te-ub": (ub, no_multicast, None),
                "tp2-te-ub-nograph": ({**ub, "train.cuda_graphs": False}, no_multicast, None),
                "tp2-te-fp8": ({**te_sp, "train.fp8": "delayed"}, {}, None),
                "tp2-te-ub-fp8": ({**ub, "train.fp8": "delayed"}, no_multicast, None),
            })
        for m in tp_models:
            for name, (over, env, bound) in tp_rows.items():
                rows.append(Variant(f"{name}/{m}", "workbench", m, gpus=2, microbatches=microbatches,
                                    baseline=f"workbench/{m}", overrides={"parallel.tensor_parallel": 2, **over},
                                    env=env, bound=bound))
        # PP=2 with 8 micro-batches against the one-GPU default path (CUDA graphs on) of the same global batch;
        # ideal p*m/(m+p-1) = 1.78x.  "-nograph": the same layout without CUDA graphs (what PP ran before).
        # With --microbatches 8 the default row is that baseline already.
        rows += cp_variants([m for m in models if m in CP_MODELS], have_te)
        pp2 = {"parallel.pipeline_parallel": 2}
        for m in [m for m in models if m in ("gpt2-medium", "llama3.2-1b", "llama3.2-3b")]:
            pp_base = f"workbench/{m}" if microbatches == 8 else f"pp1-m8/{m}"
            if microbatches != 8:
                rows.append(Variant(pp_base, "workbench", m, microbatches=8))
            for name, over in (("pp2-m8", pp2), ("pp2-vpp2-m8", {**pp2, "parallel.virtual_pipeline_parallel": 2}),
                               ("pp2-m8-nograph", {**pp2, "train.cuda_graphs": False})):
                rows.append(Variant(f"{name}/{m}", "workbench", m, gpus=2, microbatches=8, baseline=pp_base,
                                    overrides=over))
    return rows


def cp_one_gpu_recompute(model: str, seq: int, gpu: str = CP_GPU) -> str:
    """The recompute the one-GPU default path needs at sequence ``seq`` (micro-batch 1) to fit ``gpu`` by the planner:
    the first of none, selective, full that fits (full when none does: the row then shows the OOM)."""
    from workbench.planner import predict

    for mode in ("none", "selective", "full"):
        v = Variant("probe", "workbench", model, overrides={"model.seq_length": seq, "train.micro_batch_size": 1,
                                                            "parallel.recompute": mode})
        if predict(bench_config(v), gpu, suggest=False).fits:
            return mode
    return "full"


def cp_variants(models: list[str], have_te: bool = False) -> list[Variant]:
    """Context parallelism's rows: per model and length of CP_LENGTHS, the one-GPU way (``workbench-<L>``), CP=2
    (``cp2-<L>``) and torchtitan's CP=2 (``torchtitan-cp2-<L>``), each of CP_TOKENS tokens a step; with TE
    importable, CP=2 through megatron-core's CP in TE's attention (``cp2-te-<L>``, against the same one-GPU row)."""
    rows = []
    for m in models:
        for tag, seq in CP_LENGTHS.items():
            base, k = f"workbench-{tag}/{m}", max(CP_TOKENS // seq, 1)
            at = {"model.seq_length": seq, "train.micro_batch_size": 1}
            rows.append(Variant(base, "workbench", m, microbatches=k,
                                overrides={**at, "parallel.recompute": cp_one_gpu_recompute(m, seq)}))
            cp2 = {**at, "parallel.context_parallel": 2}
            rows.append(Variant(f"cp2-{tag}/{m}", "workbench", m, gpus=2, microbatches=k, baseline=base, overrides=cp2,
                                reference=f"torchtitan-cp2-{tag}/{m}"))
            rows.append(Variant(f"torchtitan-cp2-{tag}/{m}", "torchtitan", m, gpus=2, microbatches=k, baseline=base,
                                overrides=cp2))
            if have_te:
                rows.append(Variant(f"cp2-te-{tag}/{m}", "workbench", m, gpus=2, microbatches=k, baseline=base,
                                    overrides={**cp2, "model.attention_backend": "te"}, reference=f"cp2-{tag}/{m}"))
    return rows


# --------------------------------------------------------------------------- worker side


def _git_commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _fast_layer_stats(tr: Any) -> dict[str, Any]:
    """Did the compiled layer really run (fast_calls), and did dynamo recompile or fall back?"""
    calls, layers = 0, 0
    for chunk in tr.model:
        for mod in chunk.modules():
            if hasattr(mod, "fast_calls"):
                layers += 1
                calls += int(mod.fast_calls)
    out: dict[str, Any] = {"layers": layers, "fast_calls": calls}
    try:
        from torch._dynamo.utils import counters

        out["dynamo_counters"] = {k: dict(v) for k, v in counters.items() if v}
    except Exception as e:  # best effort
        out["dynamo_counters"] = repr(e)
    return out


def _profiled(v: "Variant", a: argparse.Namespace) -> bool:
    """--profile: the variants named by --profile-variants, else the reference and default
    workbench rows of --profile-model."""
    if not a.profile or a.repeat_index:  # the first repeat alone is profiled
        return False
    if a.profile_variants:
        return v.name in a.profile_variants.split(",")
    return v.model == a.profile_model and v.name.startswith(("reference/", "workbench/"))


def run_reference(v: Variant, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    if is_llama(v.model):  # the same architecture as the workbench side: plain-PyTorch Llama or GPT-2
        from bench.reference_llama import LlamaTrainer as ReferenceTrainer
    else:
        from bench.reference_gpt import ReferenceTrainer

    cfg = bench_config(v, a.cpu_smoke)
    cuda = not a.cpu_smoke
    dev = "cuda" if cuda else "cpu"
    trainer = ReferenceTrainer(cfg, device=dev, compile=cuda and not a.no_compile_reference)
    mbs, s, vocab = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    pool = [torch.randint(0, vocab, (mbs, s + 1), generator=g) for _ in range(8)]
    pool = [(t[:, :-1].contiguous().to(dev), t[:, 1:].contiguous().to(dev)) for t in pool]
    k = trainer.num_microbatches
    state = {"i": 0}

    def step() -> float:
        i = state["i"]
        state["i"] += 1
        return trainer.step([pool[(i * k + j) % len(pool)] for j in range(k)])

    first_loss = step()
    measured = harness.measure_steps(step, cuda, harness.protocol(a), before_timing=torch.cuda.reset_peak_memory_stats if cuda else None)
    prof = profiling.profile_steps(step, cuda, _profiled(v, a), top=a.profile_top)
    host = profiling.host_profile(step, cuda, a.host_profile and v.model == a.profile_model and a.repeat_index == 0)
    return {
        "host_profile": host,
        **measured,
        "first_loss": first_loss,
        "mem_peak": int(torch.cuda.max_memory_allocated()) if cuda else None,
        "mem_reserved_peak": int(torch.cuda.max_memory_reserved()) if cuda else None,
        "profile": prof,
        "kernel_path": {"model": type(trainer.model).__name__, "attention": "torch SDPA",
                        "optimizer": "torch fused AdamW" if cuda else "torch AdamW",
                        "compile": "torch.compile(whole model)" if cuda and not a.no_compile_reference else "eager"},
    }


def _skip_tp_collectives(tp: int) -> None:
    """Diagnostic bound (wrong maths, bench only): the compiled layer's TP collectives become local copies of the
    right shapes, so TP runs its 1/tp GEMMs and its element-wise work without talking: all-reduces return their
    input; under SP an all-gather repeats this rank's sequence shard ``tp`` times and a reduce-scatter keeps the
    first 1/tp of the sequence."""
    from workbench.backend import compiled_layer

    compiled_layer._all_reduce_sum = lambda x, group: x.contiguous()
    compiled_layer._all_gather_seq = lambda x, group: x.repeat(tp, *([1] * (x.dim() - 1)))
    compiled_layer._reduce_scatter_seq = lambda x, group: x.narrow(0, 0, x.shape[0] // tp).contiguous()


def run_workbench(v: Variant, a: argparse.Namespace) -> dict[str, Any]:
    """Train with the backend's own Trainer (real mcore model, DDP, Megatron optimizer, schedules)."""
    import torch

    from workbench.rank.train import Trainer

    cfg = bench_config(v, a.cpu_smoke)
    cuda = not a.cpu_smoke
    if v.bound == "no-tp-comm":
        _skip_tp_collectives(cfg.parallel.tensor_parallel)
    run_dir = Path(tempfile.mkdtemp(prefix="wb-bench-"))
    t0 = time.perf_counter()
    tr = Trainer(cfg, run_dir)
    tr.setup()
    setup_s = time.perf_counter() - t0  # process groups, model build and init, DDP, optimizer, data
    tr.collector.start()  # the training loop's garbage collection (this worker process ends with its row)
    t = tr.cfg.train
    t.microbatch_timing_interval = 0  # the timed steps: no micro-batch timing, no events
    t0 = time.perf_counter()
    first = tr.train_step()
    harness.sync(cuda)
    first_step_s = time.perf_counter() - t0  # compiles (cold or from the on-disk cache), first allocations
    measured = harness.measure_steps(tr.train_step, cuda, harness.protocol(a),
                                     before_timing=torch.cuda.reset_peak_memory_stats if cuda else None,
                                     agree=harness.rank_vote(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu"))
    mem_peak = int(torch.cuda.max_memory_allocated()) if cuda else None
    stream = None
    if not a.no_stream_cost and v.name.startswith("workbench/") and a.repeat_index == 0:
        # The event stream's own cost: the Trainer's full loop (step + microbatch events every
        # step, micro-batch CUDA-event timing every step, the per-step stop agreement) against
        # bare train steps with timing off.  Each loop call also emits run_start (one-time
        # imports, a git call): timing a loop of n and one of 2n steps and taking the
        # difference leaves exactly the per-step cost.  An upper bound on what monitoring costs.
        # a difference of two loops: on GPUs enough steps that run-to-run noise stays under 1%
        n = max(a.steps, 3) if a.cpu_smoke else max(3 * a.steps, 10)
        t.log_interval, t.eval_interval = 1, 0
        tr.cfg.checkpoint.save_on_exit, tr.cfg.checkpoint.save_interval = False, 0

        from workbench.run.events import EventWriter

        def loop(k: int) -> float:
            t.microbatch_timing_interval, t.train_iters = 1, tr.iteration + k
            tr.events, tr._ended = EventWriter(tr.run_dir, tr.rank), False  # _loop closes them at run_end
            harness.sync(cuda)
            t0 = time.perf_counter()
            tr._loop()
            harness.sync(cuda)
            return time.perf_counter() - t0

        def bare(k: int) -> float:  # the same steps with timing off and nothing around them
            t.microbatch_timing_interval = 0
            harness.sync(cuda)
            t0 = time.perf_counter()
            for _ in range(k):
                tr.train_step()
            harness.sync(cuda)
            return time.perf_counter() - t0

        # Both sides the same estimator (a mean per step from the difference of an n- and a
        # 2n-step run), interleaved so that clock / thermal drift hits both alike.  (A median
        # of single steps against a loop's mean read 1% high: step times have a slow tail.)
        loop(1)  # first run_start: one-time imports
        bare(1)  # and the first step with timing off (its own first-call costs out of the difference)
        t_n, b_n = loop(n), bare(n)
        t_2n, b_2n = loop(2 * n), bare(2 * n)
        on, off = (t_2n - t_n) / n, (b_2n - b_n) / n
        stream = {"step_s_loop_events_timing_every_step": on, "step_s_bare": off, "overhead": on / off - 1.0,
                  "loop_s_n": t_n, "loop_s_2n": t_2n, "bare_s_n": b_n, "bare_s_2n": b_2n, "n": n}
    prof = profiling.profile_steps(tr.train_step, cuda, _profiled(v, a), top=a.profile_top)
    host = profiling.host_profile(tr.train_step, cuda, a.host_profile and v.model == a.profile_model and a.repeat_index == 0)
    losses = first.get("losses") or {}
    return {
        **measured,
        "first_loss": losses.get("lm loss"),
        "setup_s": round(setup_s, 3),
        "first_step_s": round(first_step_s, 3),
        "mem_peak": mem_peak,
        # CUDA-graph replays allocate nothing: their pool shows up as reserved, not allocated
        "mem_reserved_peak": int(torch.cuda.max_memory_reserved()) if cuda else None,
        "stream_cost": stream,
        "profile": prof,
        "host_profile": host,
        "fast_layer": _fast_layer_stats(tr),
        "kernel_path": tr.kernel_path,
        "kernels": tr.kernel_choice,  # the one kernel rule's decision (workbench.kernel_rule.choose)
        "libraries": _libraries(),
    }


def _libraries() -> dict[str, Any]:
    """Whether TE was imported in this process and the cuDNN torch sees (TE's core library can load the system's)."""
    import torch

    try:
        cudnn: Any = torch.backends.cudnn.version()
    except RuntimeError as e:
        cudnn = f"refused: {str(e)[:120]}"
    sdpa = None
    if torch.cuda.is_available():  # the backend torch's SDPA takes for a causal bf16 call of this process
        q = torch.zeros(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
        sdpa = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}.get(int(torch._fused_sdp_choice(q, q, q, is_causal=True)))
    cp = sys.modules.get("workbench.backend.context_parallel")  # the ring's block kernel, where the ring ran
    return {"transformer_engine_imported": sys.modules.get("transformer_engine.pytorch") is not None, "cudnn": cudnn,
            "sdpa_causal_bf16": sdpa, "ring_blocks": cp.ring_block_kernels() if cp is not None else {}}


def worker(a: argparse.Namespace) -> NoReturn:
    v = Variant(**json.loads(a.worker))
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("WORKBENCH_BENCH_STACKS_AFTER"):
        import faulthandler

        # each rank's stacks into a file of its own beside the result (the launcher keeps their innermost frames,
        # which a shared log's tail cuts off); stderr without a result file.  faulthandler holds the file open.
        out = open(Path(a.result_file).with_name(f"stacks-{rank}.txt"), "w") if a.result_file else sys.stderr
        faulthandler.dump_traceback_later(float(os.environ["WORKBENCH_BENCH_STACKS_AFTER"]), exit=False, file=out)
    if v.kind == "workbench":  # as the backend's entry point does, before anything starts CUDA
        from workbench.config import apply_rank_environment

        apply_rank_environment(bench_config(v, a.cpu_smoke))
    try:
        if v.kind == "fsdp2":
            from bench import reference_fsdp2

            res = reference_fsdp2.run_variant(v, a)
        elif v.kind == "torchtitan":
            from bench import reference_torchtitan

            res = reference_torchtitan.run_variant(v, a)
        else:
            res = run_reference(v, a) if v.kind == "reference" else run_workbench(v, a)
        res["ok"] = True
    except Exception as e:  # the row records the failure; the launch goes on with the next variant
        import traceback

        traceback.print_exc()
        res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if rank == 0 and a.result_file:
        res["result_at"] = time.time()  # the launcher's exit_s: how long the process took to end after its result
        Path(a.result_file).write_text(json.dumps(res, default=str))
    code = 0 if res["ok"] else 1
    sys.stdout.flush()  # the log so far, whatever the end below does
    sys.stderr.flush()
    if hold := float(os.environ.get("WORKBENCH_BENCH_HOLD_AFTER_RESULT_S", "0")):  # the launcher's own test: a
        time.sleep(hold)  # process that does not end after its result (the teardown hangs seen on two H200s)
    t_end = time.perf_counter()
    _leave_later(45.0, code)  # whatever below hangs ends after 45 s (not the variant's limit; teardown's own 30 s first)
    if v.kind == "workbench":  # the backend's own end: graphs freed before the communicators, groups destroyed
        from workbench.rank.train import teardown

        code = teardown(code, timeout_s=30.0)
    # the row is written and the groups are gone: nothing the interpreter's exit does (freeing the model object by
    # object, exit handlers, the compile workers' shutdown) is worth device time (workbench workers took 15-26 s
    # from their result to their end at fd12390, torchtitan's 3.5 s)
    print(f"[bench] rank {rank}: teardown {time.perf_counter() - t_end:.1f} s, leaving", file=sys.stderr, flush=True)
    _leave(code)


def _leave(code: int) -> NoReturn:
    """End this process now with ``code``, its output flushed (no interpreter exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not keep the process
            pass
    os._exit(code)


def _leave_later(seconds: float, code: int) -> None:
    """A daemon timer that ends this process with ``code`` after ``seconds`` (it dies with a process that ends first)."""
    import threading

    timer = threading.Timer(seconds, _leave, (code,))
    timer.daemon = True
    timer.start()


def _rank_stacks(folder: Path, keep: int = 24000) -> dict[str, str]:
    """Each rank's dumped stacks (``stacks-<rank>.txt``), the main thread's first: faulthandler writes the threads
    newest first (the main thread last), each innermost frame first; ``keep`` characters of that order."""
    found = {}
    for f in sorted(folder.glob("stacks-*.txt")):
        lines = f.read_text(errors="replace").splitlines(keepends=True)
        starts = [i for i, ln in enumerate(lines) if ln.startswith(("Thread 0x", "Current thread 0x"))]
        if not starts:
            continue
        blocks = ["".join(lines[i:j]) for i, j in zip(starts, starts[1:] + [len(lines)])]
        found[f.stem.removeprefix("stacks-")] = "".join(lines[:starts[0]] + [blocks[-1]] + blocks[:-1])[:keep]
    return found


# --------------------------------------------------------------------------- launcher side


def _past_deadline(deadline: float, elapsed: float, done: dict[str, list[dict[str, Any]]], name: str) -> str:
    """Why the next repeat of ``name`` would end past ``deadline`` seconds (the longest wall time of its own earlier
    repeats, else of any repeat so far, as its estimate), or "" when it fits."""
    own = [r.get("wall_s") or 0.0 for r in done.get(name, [])]
    every = [r.get("wall_s") or 0.0 for rs in done.values() for r in rs]
    guess = max(own or every or [0.0])
    if elapsed + guess <= deadline:
        return ""
    return f"{elapsed:.0f} s gone + {guess:.0f} s (the longest repeat so far) > --deadline {deadline:g} s"


def _device_name(cpu_smoke: bool) -> str:
    if cpu_smoke:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _launch(v: Variant, a: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="wb-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={v.gpus}",
               str(Path(__file__).resolve()), "--worker", json.dumps(asdict(v)), "--result-file", str(result), *passthrough]
        env = dict(os.environ)
        env.setdefault("PYTHONPATH", "")
        env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}".rstrip(os.pathsep)
        env.setdefault("OMP_NUM_THREADS", "1" if a.cpu_smoke else "8")
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
        env.update(v.env)
        # a rank still running near the variant's limit writes its Python stacks (a hang says where it is)
        env["WORKBENCH_BENCH_STACKS_AFTER"] = str(max(a.variant_timeout - 20.0, 1.0))
        strangers = harness.check_gpus(v.name)  # an earlier call's orphan on the GPUs would share this repeat's
        t0 = time.perf_counter()
        try:
            proc = harness.run_group(cmd, a.variant_timeout, env=env, cwd=ROOT)  # a timeout ends its workers too
            rc, log = proc.returncode, proc.stdout + proc.stderr
            tail = log[-3000:]
        except subprocess.TimeoutExpired as e:  # the output so far, with the ranks' stacks dumped before the limit
            rc, log = 124, (e.output or "") + (e.stderr or "")
            tail = f"timed out after {a.variant_timeout}s\n" + log[-6000:]
        wall, ended = time.perf_counter() - t0, time.time()
        if result.exists():
            res = json.loads(result.read_text())
            # seconds from the result to the process's end: teardown, or a hang the variant's limit cut (rc 124)
            res["exit_s"] = round(ended - res.pop("result_at", ended), 1)
        else:
            res = {"ok": False, "error": f"worker exited {rc} without a result"}
        if rc == 124:  # where each rank was when the limit came, the innermost frames first
            res["exit_hung" if res.get("ok") else "hung"] = True
            res["stacks"] = _rank_stacks(Path(tmp))
        if not res.get("ok"):
            res["log_tail"] = tail
            # the slow steps' times (harness.progress) from the whole log: the stacks dumped at the end bury them
            res["progress"] = [ln for ln in log.splitlines() if ln.startswith("[harness] ")][-40:]
        res["wall_s"] = round(wall, 1)
        res["gpu_strangers"] = strangers  # always stored: [] says the GPUs were checked and found clean
        return res


def summarise(v: Variant, res: dict[str, Any], cfg, peak: float, gpus: int) -> dict[str, Any]:
    from workbench.config import derive

    d = derive(cfg)
    row: dict[str, Any] = {"variant": v.name, "kind": v.kind, "model": v.model, "gpus": v.gpus,
                           "tp": cfg.parallel.tensor_parallel, "pp": cfg.parallel.pipeline_parallel,
                           "cp": cfg.parallel.context_parallel, "recompute": cfg.parallel.recompute,
                           "dp": d.data_parallel, "micro_batch_size": cfg.train.micro_batch_size,
                           "microbatches": d.num_microbatches, "global_batch_size": cfg.train.global_batch_size,
                           "seq_length": cfg.model.seq_length, "tokens_per_step": d.tokens_per_step,
                           "overrides": v.overrides, "env": v.env, "bound": v.bound, "reference_variant": v.reference,
                           "ok": bool(res.get("ok")), "wall_s": res.get("wall_s")}
    if "gpu_strangers" in res:  # processes already on the GPUs when the repeat started ([]: checked, none)
        row["gpu_strangers"] = res["gpu_strangers"]
    row.update({k: res[k] for k in ("exit_s", "exit_hung", "hung", "stacks") if k in res})
    if not res.get("ok"):
        row["error"] = res.get("error")
        row["log_tail"] = res.get("log_tail")
        return row
    step_s = harness.median(res["step_times"])
    row.update({
        "step_s": step_s,
        "step_s_min": min(res["step_times"]),
        "steps_timed": len(res["step_times"]),
        "tokens_per_s": d.tokens_per_step / step_s,
        "flops_per_step": d.flops_per_step,
        "tflops_per_gpu": d.flops_per_step / step_s / v.gpus / 1e12,
        "mfu": d.flops_per_step / step_s / v.gpus / (peak * 1e12),
        "mem_peak_gib": (res["mem_peak"] / 2**30) if res.get("mem_peak") else None,
        "mem_reserved_peak_gib": (res["mem_reserved_peak"] / 2**30) if res.get("mem_reserved_peak") else None,
        "warmup_s": res.get("warmup_s"),
        "warmup_steps": res.get("warmup_steps"),
        "steady": res.get("steady"),
        "setup_s": res.get("setup_s"),  # where a repeat's wall time goes besides its steps (workbench variants)
        "first_step_s": res.get("first_step_s"),
        "first_loss": res.get("first_loss"),
        "kernel_path": res.get("kernel_path"),
        "kernels": res.get("kernels"),
    })
    if res.get("stream_cost"):
        row["event_stream_overhead"] = res["stream_cost"]["overhead"]
        row["stream_cost"] = res["stream_cost"]
    for key in ("profile", "host_profile", "fast_layer", "libraries", "torchtitan_version", "torchtitan_shims", "yardstick"):
        if res.get(key):
            row[key] = res[key]
    return row


def merge_repeats(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's row from its repeats (the protocol): the median repeat's row, with every repeat's tokens/s,
    their median and spread (``repeats``), each repeat's brief (``repeat_rows``), and the first repeat's profile
    and event-stream cost (only it measures them).  A failed repeat fails the row (its error kept)."""
    brief = [{k: r.get(k) for k in ("repeat", "ok", "tokens_per_s", "step_s", "warmup_steps", "steady", "wall_s", "exit_s", "mem_peak_gib",
                                     "error", "gpu_strangers", "exit_hung", "hung")}
             for r in rs]
    ok = [r for r in rs if r["ok"]]
    if len(ok) < len(rs):
        bad = next(r for r in rs if not r["ok"])
        return {**bad, "ok": False, "repeat_rows": brief}
    tps = [r["tokens_per_s"] for r in ok]
    row = dict(next(r for r in ok if r["tokens_per_s"] == harness.median(tps)))  # the upper median is a repeat
    for key in ("profile", "host_profile", "stream_cost", "event_stream_overhead", "fast_layer"):
        row.pop(key, None)
        if rs[0].get(key) is not None:
            row[key] = rs[0][key]
    row.pop("repeat", None)
    row.update(repeats=harness.side(tps), repeat_rows=brief)
    return row


def _range(r: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """``r`` over ``base`` under the protocol: the ratio of medians and its worst and best pairing."""
    return harness.ratio(r["repeats"]["repeats"], base["repeats"]["repeats"])


def print_table(rows: list[dict[str, Any]]) -> None:
    by_name = {r["variant"]: r for r in rows}
    # allocated peak, and reserved: CUDA-graph pools (the compiled layers' activations) count only there
    hdr = (f"{'variant':28s} {'gpus':>4s} {'tok/s':>10s} {'spread':>7s} {'MFU':>6s} {'mem GiB':>8s} {'resv GiB':>8s} "
           f"{'vs ref [worst, best]':>22s} {'scaling [worst, best]':>22s} {'events':>7s}")
    print(hdr)
    print("-" * len(hdr))
    fmt = lambda c: f"{c['ratio']:.2f}x [{c['worst']:.2f}, {c['best']:.2f}]" if c else "-"  # noqa: E731
    for r in rows:
        if not r["ok"]:
            print(f"{r['variant']:28s} {r['gpus']:>4d}  FAILED: {str(r.get('error'))[:80]}")
            continue
        ref = by_name.get(r.get("reference_variant") or f"reference/{r['model']}")
        vs = _range(r, ref) if ref and ref.get("ok") else None
        r["ratio_to_reference"] = vs["ratio"] if vs else None
        r["ratio_to_reference_range"] = [vs["worst"], vs["best"]] if vs else None
        sc = {"ratio": r["scaling"], "worst": r["scaling_range"][0], "best": r["scaling_range"][1]} if r.get("scaling") else None
        ev = r.get("event_stream_overhead")
        print(f"{r['variant']:28s} {r['gpus']:>4d} {r['tokens_per_s']:>10.0f} {r['repeats']['spread'] * 100:>6.1f}% {r['mfu'] * 100:>5.1f}% "
              f"{(r['mem_peak_gib'] or 0):>8.2f} {(r.get('mem_reserved_peak_gib') or 0):>8.2f} {fmt(vs):>22s} {fmt(sc):>22s} "
              f"{('%+.1f%%' % (ev * 100)) if ev is not None else '-':>7s}")


def add_scaling(rows: list[dict[str, Any]], variants: list[Variant]) -> None:
    """Speed-up over the variant's single-GPU baseline (ratio of medians, with its worst and best pairing), and the
    target it is judged against: met only when the worst pairing clears it."""
    by_name = {r["variant"]: r for r in rows}
    for v in variants:
        r = by_name.get(v.name)
        base = by_name.get(v.baseline or "")
        if not (r and base and r["ok"] and base["ok"]):
            continue
        c = _range(r, base)
        r["scaling"], r["scaling_range"] = c["ratio"], [c["worst"], c["best"]]
        worst = c["worst"]
        if v.baseline.startswith("torchtitan/") and v.kind == "workbench":  # a model one GPU cannot hold (issue #50)
            r["target"] = ">= 1.1x torchtitan on the same GPUs and MFU >= 45%"
            r["meets_target"] = worst >= 1.1 and r["mfu"] >= 0.45
        elif v.name.startswith("pp"):
            m, p = r["microbatches"], r["pp"]
            ideal = p * m / (m + p - 1)  # 1F1B with bubble (p-1)/m relative to the work
            r["scaling_ideal"] = ideal
            r["scaling_vs_ideal"] = r["scaling"] / ideal
            if "-nograph" in v.name:
                r["target"], r["meets_target"] = "none (CUDA graphs off: the layout as it ran before)", None
            elif "-vpp" in v.name:
                plain = by_name.get(v.name.replace("-vpp2", ""))
                r["target"] = ">= 1.6x one GPU and >= pp2-m8"
                r["meets_target"] = worst >= 1.6 and bool(plain and plain["ok"] and _range(r, plain)["worst"] >= 1.0)
            else:
                r["target"], r["meets_target"] = ">= 1.6x one GPU (ideal 1.78x)", worst >= 1.6
        elif v.name.startswith("tp"):
            bar = 1.7 if "llama3.2-3b" in v.name else 1.6
            r["target"], r["meets_target"] = f">= {bar}x one GPU", worst >= bar
        elif "-fp8-" in v.name:
            r["target"], r["meets_target"] = f">= 1.2x {v.baseline}", worst >= 1.2
        elif v.name.startswith("dp"):
            r["target"], r["meets_target"] = ">= 1.9x one GPU", worst >= 0.95 * r["gpus"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run, NOT the protocol (one repeat, 3 warm-up + 6 timed steps; rows say so)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny config, 2 steps, on CPU (for CI)")
    ap.add_argument("--models", default="gpt2-small,gpt2-medium", help="comma list of gpt2-small, gpt2-medium, gpt2-large, llama3.2-1b, llama3.2-3b, llama3.1-8b (two GPUs only)")
    ap.add_argument("--variants", default="", help="comma list of variant-name prefixes to run (default: all that fit)")
    ap.add_argument("--microbatches", type=int, default=4, help="micro-batches per step and data-parallel rank")
    harness.add_protocol_args(ap)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="peak dense TFLOP/s per GPU for MFU (default 989)")
    ap.add_argument("--profile", action="store_true", help="torch-profiler summary for the reference and default workbench")
    ap.add_argument("--profile-model", default="gpt2-small")
    ap.add_argument("--profile-variants", default="", help="with --profile: profile these variants (comma list of full names) instead")
    ap.add_argument("--profile-top", type=int, default=15, help="with --profile: how many kernels the summary lists")
    ap.add_argument("--host-profile", action="store_true", help="cProfile summary of the host's Python time for --profile-model")
    ap.add_argument("--no-stream-cost", action="store_true", help="skip the event-stream cost measurement")
    ap.add_argument("--no-compile-reference", action="store_true", help="run the reference eagerly")
    ap.add_argument("--variant-timeout", type=float, default=900.0, help="seconds before a variant is abandoned")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds from the start: launch no repeat that would end past it by the longest repeat so far "
                         "(its variant's, else any); the rows so far stay in OUT's .partial.jsonl and the exit code is 3 "
                         "(0: none)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON-lines file to append results to")
    ap.add_argument("--gpus", type=int, default=None, help="use at most this many GPUs (default: all visible)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repeat-index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.repeats = 6, 3, 1
    if a.cpu_smoke:  # the protocol at its smallest (harness.SMOKE)
        a.microbatches, a.steps, a.repeats = 2, min(a.steps, harness.SMOKE.steps), harness.SMOKE.repeats
    if a.steps < 1 or a.warmup < 0 or a.microbatches < 1 or a.repeats < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --microbatches >= 1, --repeats >= 1")
    if not a.deadline >= 0:  # NaN too
        ap.error("--deadline must be >= 0 seconds (0: none)")

    if a.worker:
        return worker(a)

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    if a.cpu_smoke:
        gpus, have_te = 0, False
        variants = [Variant(f"{kind}/{m}", kind, m, microbatches=a.microbatches)
                    for m in dict.fromkeys(smoke_model(m) for m in models) for kind in ("reference", "workbench")]
    else:
        import torch

        from workbench import kernel_rule

        if not torch.cuda.is_available():
            ap.error("no CUDA GPU visible: run on a GPU machine, or use --cpu-smoke")
        gpus = torch.cuda.device_count() if a.gpus is None else min(a.gpus, torch.cuda.device_count())
        have_te = kernel_rule.te_available()  # a broken TE install counts as absent, as in the backend
        variants = plan(models, gpus, have_te, a.microbatches)
    if a.variants:
        wanted = [w.strip() for w in a.variants.split(",") if w.strip()]
        variants = [v for v in variants if any(v.name.startswith(w) for w in wanted)]
        if not variants:
            ap.error(f"--variants {a.variants!r} matches nothing")

    passthrough = [f"--steps={a.steps}", f"--warmup={a.warmup}", f"--warmup-max={a.warmup_max}", f"--repeats={a.repeats}",
                   f"--profile-model={a.profile_model}",
                   f"--profile-variants={a.profile_variants}", f"--profile-top={a.profile_top}"]
    for flag in ("cpu_smoke", "profile", "host_profile", "no_stream_cost", "no_compile_reference"):
        if getattr(a, flag):
            passthrough.append("--" + flag.replace("_", "-"))

    device = _device_name(a.cpu_smoke)
    commit, date = _git_commit(), _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    proto = harness.protocol(a)
    measured = "quick: one short pass, not the protocol" if a.quick else "protocol"
    partial = Path(a.out).with_suffix(".partial.jsonl")
    partial.parent.mkdir(parents=True, exist_ok=True)
    repeats: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    t_start = time.monotonic()
    for i in range(proto.repeats):  # interleaved: every variant once, then again (fresh processes each time)
        for v in variants:
            if a.deadline > 0 and (late := _past_deadline(a.deadline, time.monotonic() - t_start, repeats, v.name)):
                print(f"[bench] stopped before {v.name} repeat {i + 1}/{proto.repeats}: {late}; the rows so far are in "
                      f"{partial} (not a protocol row)", flush=True)
                return 3
            print(f"[bench] {v.name} on {v.gpus or 'cpu'} GPU(s), repeat {i + 1}/{proto.repeats} ...", flush=True)
            res = _launch(v, a, passthrough + [f"--repeat-index={i}"])
            row = summarise(v, res, bench_config(v, a.cpu_smoke), a.peak_tflops, gpus)
            row.update({"device": device, "date": date, "git_commit": commit, "repeat": i})
            repeats[v.name].append(row)
            print(f"[bench] {v.name}: " + (f"{row['tokens_per_s']:.0f} tok/s, MFU {row['mfu'] * 100:.1f}%, wall {row['wall_s']} s (exit {row.get('exit_s')} s), "
                                           f"warm-up {row.get('warmup_steps')} steps{'' if row.get('steady') else ' (NOT steady)'}"
                                           if row["ok"] else f"FAILED: {row.get('error')}\n{row.get('log_tail', '')}"), flush=True)
            with open(partial, "a") as fh:  # survives a launch that is cut short
                fh.write(json.dumps(row, default=str) + "\n")
    rows = [merge_repeats(repeats[v.name]) for v in variants]
    for row in rows:
        row.update({"device": device, "date": date, "git_commit": commit, "peak_tflops": a.peak_tflops, "quick": bool(a.quick),
                    "cpu_smoke": bool(a.cpu_smoke), "measured": measured, "protocol": proto.record()})
    add_scaling(rows, variants)
    print()
    print(f"device: {device}   commit: {commit[:10]}   peak: {a.peak_tflops:g} TFLOP/s per GPU")
    print_table(rows)
    for r in rows:
        if r.get("profile"):
            p = r["profile"]
            print(f"\nprofile {r['variant']}: {p['device_ms_per_step']:.1f} ms device time/step, {p['kernels_per_step']} kernels/step, "
                  f"wall {p.get('wall_ms_per_step')} ms/step, host waited {p.get('host_sync_wait_ms_per_step')} ms/step in syncs")
            for cat, ms in p["by_category_ms"].items():
                print(f"  {cat:34s} {ms:8.2f} ms")
        if r.get("host_profile"):
            h = r["host_profile"]
            print(f"\nhost profile {r['variant']}: {h['wall_ms_per_step_under_cprofile']} ms/step under cProfile; top by own time:")
            for f in h["by_tottime"][:12]:
                print(f"  {f['tottime_ms']:8.2f} ms {f['calls']:6d}x  {f['fn']}")
        if r.get("fast_layer"):
            print(f"fast layer {r['variant']}: {r['fast_layer'].get('fast_calls')} compiled calls over {r['fast_layer'].get('layers')} layers")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r, default=str) + "\n")
    partial.unlink(missing_ok=True)
    print(f"\n[bench] {len(rows)} rows appended to {out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
