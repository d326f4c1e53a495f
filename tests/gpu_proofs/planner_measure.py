"""GPU proof for the memory planner (issues 5 and 26): measured peak allocated AND reserved vs predicted, every rank.

Two sets of configs::

    # one GPU: GPT-2 small/medium/large, a Llama-3.2-1B shape, demo-small; recompute
    # none/selective/full; distributed optimizer; the default compiled path with CUDA graphs,
    # compiled without graphs, and compile off.  Jobs share the one GPU (a memory budget).
    python tests/gpu_proofs/planner_measure.py --set 1gpu --out evidence/planner_1gpu.jsonl --deadline 500

    # the earlier 2-GPU matrix: TP, TP+SP, PP, PP x VPP, DP + distributed optimizer
    python tests/gpu_proofs/planner_measure.py --set 2gpu --out evidence/planner_measurements.jsonl

    # every family's two-GPU layouts (GPT-2, a GQA Llama, BERT, T5) on the default compiled path, the
    # issue-40 rows that missed on reserved (GPT-2 small TP=2 eager, GPT-2 medium PP=2 x VPP=2 eager)
    # and Llama-3.2-1B TP=2 / PP=2 at its preset batch; jobs share both GPUs under --gpu-bytes
    python tests/gpu_proofs/planner_measure.py --set 2gpu-all --out evidence/planner_2gpu.jsonl --concurrent 3 --deadline 330

    # CPU self-check of the script (tiny shapes, gloo, no memory statistics)
    python tests/gpu_proofs/planner_measure.py --device cpu --only g2s-default,g2m-full

Every config is a real ``torchrun`` job whose ranks run the backend's own ``Trainer`` (the same
setup and training loop as ``python -m workbench.rank``; 4 steps, synthetic data, no eval, no
checkpoint) through this script's ``--child`` entry, which records on every rank what the
backend's step events cannot: ``torch.cuda.max_memory_allocated()`` and
``max_memory_reserved()`` over the whole run (set-up included, the compile / CUDA-graph
warm-up and recording steps included), per step, and the allocator's segments by pool at the
end (the CUDA-graph trees' private pool vs the default pool).  To find reserved terms the planner
misses, each rank also records the allocator's own counters (``torch.cuda.memory_stats``: reserved /
allocated / active / requested peaks, segment counts, device mallocs, retries), the reserved bytes by
stream and the largest segments, and the device memory outside torch's allocator (CUDA context,
NCCL communicators and buffers, cuBLAS handles) at five points: CUDA context only, after the
process groups are made, after set-up (the first collectives: NCCL communicators are created
lazily), after step 1 and at the end -- as ``torch.cuda.mem_get_info`` (device-wide: valid when the
job has its GPUs alone) and as this process's own use (``nvidia-smi --query-compute-apps``, valid
under concurrent jobs), each minus ``torch.cuda.memory_reserved()``.

One JSON line per rank and config: config name, overrides, the full config, rank coordinates,
measured peaks, the planner's predictions (``predicted_allocated``, ``predicted_reserved``,
breakdown), megatron's theoretical formula, errors in percent, the backend's kernel path, plus
device, date and git commit (``GIT_COMMIT`` overrides the checkout's).  A failed job writes
one line with ``status: failed`` and the log's tail.  ``--only NAME,...`` runs a subset;
``--list`` prints the configs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from workbench.run.files import free_port  # noqa: E402

GiB = 2**30
SMALL = {"model.num_layers": 12, "model.hidden_size": 768, "model.num_attention_heads": 12}
MEDIUM = {"model.num_layers": 24, "model.hidden_size": 1024, "model.num_attention_heads": 16}
LARGE = {"model.num_layers": 36, "model.hidden_size": 1280, "model.num_attention_heads": 20}
# Llama-3.2-1B's shape (RoPE: the compiled layer does not apply; the stock layer runs)
LLAMA_1B = {"model.num_layers": 16, "model.hidden_size": 2048, "model.num_attention_heads": 32,
            "model.attention_type": "grouped", "model.num_query_groups": 8, "model.ffn_hidden_size": 8192,
            "model.vocab_size": 128256, "model.seq_length": 2048, "model.max_position_embeddings": 2048,
            "model.position_embedding": "rope", "model.rotary_base": 500000.0, "model.normalization": "rmsnorm",
            "model.activation": "swiglu", "model.add_bias_linear": False, "model.tie_embeddings": True,
            "model.norm_epsilon": 1e-5}
OFF = {"train.compile_kernels": False}
NOGRAPHS = {"train.cuda_graphs": False}

# The earlier matrix (2x H200): name -> (GPUs, overrides on top of base("gpt2-small")), compile off
# unless named.  `--set 2gpu`.
TWO_GPU: dict[str, tuple[int, dict]] = {
    "small-tp1-mbs4-compiled": (1, {**SMALL, "train.micro_batch_size": 4, "train.compile_kernels": True}),
    "small-tp1-mbs8": (1, {**SMALL, "train.micro_batch_size": 8}),
    "small-tp1-mbs4-local-attn": (1, {**SMALL, "train.micro_batch_size": 4, "model.attention_backend": "local"}),
    "medium-tp1-mbs4-full": (1, {**MEDIUM, "train.micro_batch_size": 4, "parallel.recompute": "full"}),
    "medium-tp1-mbs4-selective": (1, {**MEDIUM, "train.micro_batch_size": 4, "parallel.recompute": "selective"}),
    "small-tp2-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.tensor_parallel": 2}),
    "small-tp2-sp-mbs8": (2, {**SMALL, "train.micro_batch_size": 8, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}),
    "small-pp2-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.pipeline_parallel": 2}),
    "small-dp2-distopt-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.distributed_optimizer": True}),
    "medium-tp2-sp-selective-mbs8": (2, {**MEDIUM, "train.micro_batch_size": 8, "parallel.tensor_parallel": 2,
                                         "parallel.sequence_parallel": True, "parallel.recompute": "selective"}),
    "medium-pp2-vpp2-mbs4": (2, {**MEDIUM, "train.micro_batch_size": 4, "parallel.pipeline_parallel": 2,
                                 "parallel.virtual_pipeline_parallel": 2}),
}
_TWO_GPU_BASE = {"train.compile_kernels": False}

NO_DROPOUT = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}

# Every family's two-GPU layouts: name -> (GPUs, preset, overrides); the preset's default
# kernel path (compiled layer + CUDA graphs on GPUs) unless OFF says otherwise; dropout 0 so the encoder
# families run the compiled layer too.  `--set 2gpu-all`.
GQA_SMALL = {"model.num_layers": 12, "model.hidden_size": 768, "model.num_attention_heads": 12,
             "model.num_query_groups": 4, "model.seq_length": 1024, "model.max_position_embeddings": 1024}
TP2, SP = {"parallel.tensor_parallel": 2}, {"parallel.sequence_parallel": True}
PP2, VPP2 = {"parallel.pipeline_parallel": 2}, {"parallel.virtual_pipeline_parallel": 2}
DISTOPT = {"parallel.distributed_optimizer": True}
CP2 = {"parallel.context_parallel": 2}
TWO_GPU_ALL: dict[str, tuple[int, str, dict]] = {
    # the rows found low on reserved, first (eager, as measured there)
    "g2s-tp2-eager": (2, "gpt2-small", {"train.micro_batch_size": 4, **TP2, **OFF}),
    "g2m-pp2-vpp2-eager": (2, "gpt2-medium", {"train.micro_batch_size": 4, **PP2, **VPP2, **OFF}),
    "g2s-tp2": (2, "gpt2-small", {"train.micro_batch_size": 8, **TP2}),
    "g2s-tp2-sp": (2, "gpt2-small", {"train.micro_batch_size": 8, **TP2, **SP}),
    "g2s-pp2": (2, "gpt2-small", {"train.micro_batch_size": 8, **PP2}),
    "g2m-pp2-vpp2": (2, "gpt2-medium", {"train.micro_batch_size": 4, **PP2, **VPP2}),
    "g2s-dp2-distopt": (2, "gpt2-small", {"train.micro_batch_size": 8, **DISTOPT}),
    # optimizer CPU offload: master weights and moments leave the GPU (the planner's host bytes are not measured here)
    "g2s-dp2-distopt-offload": (2, "gpt2-small", {"train.micro_batch_size": 8, **DISTOPT, "parallel.optimizer_cpu_offload": 1.0}),
    "llama-gqa-tp2-sp": (2, "llama-small", {**GQA_SMALL, "train.micro_batch_size": 4, **TP2, **SP}),
    "llama-gqa-pp2": (2, "llama-small", {**GQA_SMALL, "train.micro_batch_size": 4, **PP2}),
    "bert-base-tp2-sp": (2, "bert-base", {"train.micro_batch_size": 8, **NO_DROPOUT, **TP2, **SP}),
    "bert-base-pp2": (2, "bert-base", {"train.micro_batch_size": 8, **NO_DROPOUT, **PP2}),
    "bert-base-pp2-vpp2": (2, "bert-base", {"train.micro_batch_size": 8, **NO_DROPOUT, **PP2, **VPP2}),
    "bert-base-dp2": (2, "bert-base", {"train.micro_batch_size": 8, **NO_DROPOUT}),
    "t5-base-tp2": (2, "t5-base", {"train.micro_batch_size": 16, **NO_DROPOUT, **TP2}),
    "t5-base-dp2-distopt": (2, "t5-base", {"train.micro_batch_size": 16, **NO_DROPOUT, **DISTOPT}),
    # Llama-3.2-1B at its preset batch (micro-batch 4, sequence 2048)
    "llama1b-tp2": (2, "llama3.2-1b", {**TP2}),
    "llama1b-pp2": (2, "llama3.2-1b", {**PP2}),
    # context parallelism: the CP rows' shape (bench/train_throughput.cp_variants), 32k tokens a step, micro-batch 1
    "llama1b-cp2-16k": (2, "llama3.2-1b", {**CP2, "model.seq_length": 16384, "train.micro_batch_size": 1,
                                           "train.global_batch_size": 2}),
    "llama1b-cp2-32k": (2, "llama3.2-1b", {**CP2, "model.seq_length": 32768, "train.micro_batch_size": 1,
                                           "train.global_batch_size": 1}),
}

# One GPU, in priority order (the deadline drops the tail): name -> (preset, overrides).
# The workbench defaults (compile_kernels and cuda_graphs on) unless OFF / NOGRAPHS say otherwise.
ONE_GPU: dict[str, tuple[str, dict]] = {
    "g2s-default": ("gpt2-small", {"train.micro_batch_size": 16}),
    "g2m-default": ("gpt2-medium", {"train.micro_batch_size": 8}),
    "demo-small": ("demo-small", {}),
    "llama1b": ("gpt2-small", {**LLAMA_1B, "train.micro_batch_size": 4}),
    "g2l-default": ("gpt2-large", {"train.micro_batch_size": 8}),
    "g2s-eager": ("gpt2-small", {"train.micro_batch_size": 16, **OFF}),
    "g2m-selective": ("gpt2-medium", {"train.micro_batch_size": 8, "parallel.recompute": "selective"}),
    "g2m-full": ("gpt2-medium", {"train.micro_batch_size": 8, "parallel.recompute": "full"}),
    "g2l-distopt": ("gpt2-large", {"train.micro_batch_size": 8, "parallel.distributed_optimizer": True}),
    "demo-small-eager": ("demo-small", {**OFF}),
    "g2s-nographs": ("gpt2-small", {"train.micro_batch_size": 16, **NOGRAPHS}),
    "g2m-eager-selective": ("gpt2-medium", {"train.micro_batch_size": 8, "parallel.recompute": "selective", **OFF}),
    "llama1b-selective": ("gpt2-small", {**LLAMA_1B, "train.micro_batch_size": 4, "parallel.recompute": "selective"}),
    "g2l-eager-distopt-full": ("gpt2-large", {"train.micro_batch_size": 8, "parallel.distributed_optimizer": True,
                                              "parallel.recompute": "full", **OFF}),
    "g2s-eager-full": ("gpt2-small", {"train.micro_batch_size": 16, "parallel.recompute": "full", **OFF}),
    "llama1b-eager": ("gpt2-small", {**LLAMA_1B, "train.micro_batch_size": 2, **OFF}),
    # q/k norms (the stock megatron layer keeps them): Qwen3's per-head norms, OLMoE's norms over all heads
    "llama1b-qknorm": ("gpt2-small", {**LLAMA_1B, "train.micro_batch_size": 4, "model.qk_layernorm": True}),
    "llama1b-qknorm-all-heads": ("gpt2-small", {**LLAMA_1B, "train.micro_batch_size": 4, "model.qk_layernorm": True,
                                                "model.qk_norm_scope": "all_heads"}),
    # the other families (issues 20, 21): their default path (the kernel rule's stock layer for encoders)
    "bert-base": ("bert-base", {"train.micro_batch_size": 8}),
    "bert-large": ("bert-large", {"train.micro_batch_size": 8}),
    "t5-base": ("t5-base", {"train.micro_batch_size": 16}),
    "t5-v1_1-base": ("t5-v1_1-base", {"train.micro_batch_size": 16}),  # gated-GELU MLP, untied head
    "t5-small": ("t5-small", {"train.micro_batch_size": 32}),
    "t5-base-full": ("t5-base", {"train.micro_batch_size": 16, "parallel.recompute": "full"}),
    # the encoder families on the compiled layer (dropout 0: the benchmark's setting; issues 20, 21)
    "bert-base-compiled": ("bert-base", {"train.micro_batch_size": 8, **NO_DROPOUT}),
    "bert-large-compiled": ("bert-large", {"train.micro_batch_size": 8, **NO_DROPOUT}),
    "t5-base-compiled": ("t5-base", {"train.micro_batch_size": 16, **NO_DROPOUT}),
    "t5-v1_1-base-compiled": ("t5-v1_1-base", {"train.micro_batch_size": 16, **NO_DROPOUT}),
}
STEPS = 4  # CUDA graphs: warm-up, recording, two replays


def _common(device: str) -> dict:
    return {"data.source": "synthetic", "parallel.device": device, "train.precision": "bf16", "train.train_iters": STEPS,
            "train.eval_interval": 0, "train.log_interval": 1, "train.microbatch_timing_interval": 0,
            "train.lr_warmup_iters": 1, "checkpoint.save_on_exit": False}


def names_of(which: str) -> list[str]:
    return list({"1gpu": ONE_GPU, "2gpu": TWO_GPU, "2gpu-all": TWO_GPU_ALL}[which])


def make_config(name: str, device: str = "cuda", tiny: bool = False):
    """(GPUs, RunConfig) of a named config of either set."""
    from workbench.config import preset

    if name in ONE_GPU:
        gpus, (base, ov) = 1, ONE_GPU[name]
        ov = {**ov}
        micro = 4 if base != "demo-small" else None  # demo-small keeps its preset's batch (16 x 2)
    elif name in TWO_GPU_ALL:
        gpus, base, ov = TWO_GPU_ALL[name]
        ov = {**ov}
        micro = 4 if not base.startswith("llama3") else None  # Llama-3.2-1B keeps its preset's batch (4 x 16)
    else:
        gpus, ov = TWO_GPU[name]
        base, ov, micro = "gpt2-small", {**_TWO_GPU_BASE, **ov}, 4
    if tiny:  # script self-check on CPU: same layouts, tiny shapes
        keep_h = ov.get("model.num_query_groups")
        for k in list(ov):
            if k.startswith("model.") and k not in ("model.attention_type", "model.position_embedding", "model.normalization",
                                                    "model.activation", "model.add_bias_linear", "model.tie_embeddings",
                                                    "model.attention_backend"):
                ov.pop(k)
        ov.update({"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.seq_length": 64,
                   "model.max_position_embeddings": 128, "model.vocab_size": 4096, "train.micro_batch_size": 2,
                   "train.compile_kernels": False})
        if keep_h or base.startswith("llama"):
            ov["model.num_query_groups"] = 2
        if base.startswith("t5"):
            ov.update({"model.decoder_num_layers": 4, "model.decoder_seq_length": 16, "model.kv_channels": 16,
                       "model.ffn_hidden_size": 128})
        if base.startswith("llama3"):
            ov.update({"model.ffn_hidden_size": 128, "model.rotary_base": 10000.0})
        micro = micro or 2
    mbs = ov.get("train.micro_batch_size", preset(base).train.micro_batch_size)
    dp = gpus // (ov.get("parallel.tensor_parallel", 1) * ov.get("parallel.pipeline_parallel", 1)
                  * ov.get("parallel.context_parallel", 1))
    ov.update({"parallel.nproc_per_node": gpus})
    if micro is not None:
        ov["train.global_batch_size"] = mbs * dp * micro
    cfg = preset(base, **{**_common(device), **ov})
    if name in ONE_GPU or name in TWO_GPU_ALL:
        cfg = cfg.replace(name=name)
    return gpus, cfg


def _stamp() -> dict:
    from workbench.provenance import stamp

    out = stamp()
    if os.environ.get("GIT_COMMIT"):
        out["commit"] = os.environ["GIT_COMMIT"]
        out["git_commit"] = os.environ["GIT_COMMIT"]
    return out


# --------------------------------------------------------------------------- rank side


def _pools(torch) -> dict:
    """Reserved bytes by allocator pool ((0, 0): the default pool; others: CUDA-graph pools) and segment sizes."""
    pools: dict[str, dict] = {}
    for seg in torch.cuda.memory_snapshot():
        key = str(tuple(seg.get("segment_pool_id") or (0, 0)))
        p = pools.setdefault(key, {"reserved": 0, "allocated": 0, "segments": 0, "large_segments": 0, "small_segments": 0})
        p["reserved"] += int(seg["total_size"])
        p["allocated"] += int(seg.get("allocated_size", 0))
        p["segments"] += 1
        p["large_segments" if seg.get("segment_type") == "large" else "small_segments"] += 1
    return pools


#: the allocator counters kept per rank (``torch.cuda.memory_stats`` keys)
STAT_KEYS = ("reserved_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.large_pool.peak",
             "reserved_bytes.small_pool.peak", "allocated_bytes.all.peak", "allocated_bytes.all.current",
             "active_bytes.all.peak", "active_bytes.all.current", "requested_bytes.all.peak",
             "inactive_split_bytes.all.peak", "inactive_split_bytes.all.current", "segment.all.peak",
             "segment.all.current", "segment.large_pool.current", "segment.small_pool.current", "num_device_alloc",
             "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams", "max_split_size")


def _alloc_stats(torch) -> dict:
    st = torch.cuda.memory_stats()
    return {k: int(st[k]) for k in STAT_KEYS if k in st}


def _pid_used_bytes() -> int | None:
    """This process's device memory as the driver counts it (``nvidia-smi``): everything it holds on its
    GPU -- CUDA context, torch's segments, NCCL's buffers -- whatever other jobs share the GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0] == str(os.getpid()) and parts[1].isdigit():
            return int(parts[1]) * 2**20
    return None


def _device_point(torch, where: str) -> dict:
    """Device memory at one moment: what torch's allocator holds, and what lies outside it (device-wide
    and this process's own)."""
    free, total = torch.cuda.mem_get_info()
    reserved = int(torch.cuda.memory_reserved())
    pid = _pid_used_bytes()
    return {"where": where, "device_used": int(total - free), "device_total": int(total), "torch_reserved": reserved,
            "torch_allocated": int(torch.cuda.memory_allocated()), "outside_torch_device": int(total - free) - reserved,
            "process_used": pid, "outside_torch_process": None if pid is None else pid - reserved}


def _segments(torch, top: int = 12) -> dict:
    """Reserved bytes by (stream, pool) and the largest segments (size, allocated, blocks, stream)."""
    by: dict[str, dict] = {}
    segs = []
    for seg in torch.cuda.memory_snapshot():
        key = f"stream {seg.get('stream', 0)} pool {tuple(seg.get('segment_pool_id') or (0, 0))}"
        b = by.setdefault(key, {"reserved": 0, "allocated": 0, "segments": 0})
        b["reserved"] += int(seg["total_size"])
        b["allocated"] += int(seg.get("allocated_size", 0))
        b["segments"] += 1
        segs.append({"size": int(seg["total_size"]), "allocated": int(seg.get("allocated_size", 0)),
                     "active": int(seg.get("active_size", 0)), "blocks": len(seg.get("blocks", [])),
                     "stream": int(seg.get("stream", 0)), "type": seg.get("segment_type")})
    segs.sort(key=lambda x: -x["size"])
    sizes = [x["size"] for x in segs]
    hist = {"<=2MiB": sum(1 for n in sizes if n <= 2 * 2**20), "<=20MiB": sum(1 for n in sizes if 2 * 2**20 < n <= 20 * 2**20),
            "<=256MiB": sum(1 for n in sizes if 20 * 2**20 < n <= 256 * 2**20), ">256MiB": sum(1 for n in sizes if n > 256 * 2**20)}
    free_in_segments = sum(x["size"] - x["allocated"] for x in segs)
    return {"by_stream_pool": by, "largest": segs[:top], "count_by_size": hist, "unallocated_in_segments": free_in_segments}


def child(args: argparse.Namespace) -> int:
    """One rank: the backend's Trainer, with the allocator's peaks recorded per step."""
    from workbench.config import apply_rank_environment, load_config

    cfg = load_config(args.config)
    apply_rank_environment(cfg)
    import torch

    from workbench.backend import distributed
    from workbench.rank.train import Trainer, teardown

    run_dir = Path(args.run_dir)
    rank = int(os.environ.get("RANK", "0"))
    cuda = cfg.parallel.device == "cuda"
    rec: dict = {"rank": rank, "steps": [], "points": []}
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.init()
        rec["points"].append(_device_point(torch, "cuda_context"))
        made = distributed.initialize

        def initialize(*a, **kw):  # the process groups (NCCL communicators come at their first collective)
            out = made(*a, **kw)
            rec["points"].append(_device_point(torch, "process_groups"))
            return out

        distributed.initialize = initialize
    tr = Trainer(cfg, run_dir)

    def mem() -> dict:
        if not cuda:
            return {}
        st = torch.cuda.memory_stats()
        return {"peak_allocated": int(torch.cuda.max_memory_allocated()), "peak_reserved": int(torch.cuda.max_memory_reserved()),
                "allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved()),
                "alloc_retries": int(st.get("num_alloc_retries", 0)), "ooms": int(st.get("num_ooms", 0))}

    tr.setup()
    rec["setup"] = mem()
    if cuda:
        rec["points"].append(_device_point(torch, "after_setup"))
        rec["stats_setup"] = _alloc_stats(torch)
    inner = tr.train_step

    def step() -> dict:
        if cuda:
            torch.cuda.reset_peak_memory_stats()  # per-step windows; the run's peak is their max
        t0 = time.time()
        res = inner()
        if cuda:
            torch.cuda.synchronize()
        rec["steps"].append({**mem(), "seconds": round(time.time() - t0, 2)})
        if cuda:
            rec["steps"][-1]["stats"] = _alloc_stats(torch)  # peaks of this step's window
        if len(rec["steps"]) == 1 and cuda:
            rec["pools_after_step1"] = _pools(torch)
            rec["points"].append(_device_point(torch, "after_step1"))
            rec["segments_after_step1"] = _segments(torch)
        return res

    tr.train_step = step
    code = tr._loop()
    if cuda:
        rec["pools"] = _pools(torch)
        rec["points"].append(_device_point(torch, "end"))
        rec["segments"] = _segments(torch)
        rec["stats_end"] = _alloc_stats(torch)
        rec["peak_allocated"] = max([s["peak_allocated"] for s in rec["steps"]] + [rec["setup"]["peak_allocated"]])
        rec["peak_reserved"] = max([s["peak_reserved"] for s in rec["steps"]] + [rec["setup"]["peak_reserved"]])
        rec["device"] = torch.cuda.get_device_name()
        rec["kernel_path"] = tr.kernel_path
        rec["kernels"] = tr.kernel_choice  # the rule's decision (cuda_graphs_impl: how the run was graphed)
        rec["step_graph_failed"] = bool(tr.step_graph is not None and tr.step_graph.failed)
    (run_dir / f"memory-rank{rank}.json").write_text(json.dumps(rec))
    return teardown(code)


# --------------------------------------------------------------------------- launcher side


def launch(name: str, cfg, gpus: int, work: Path, port: int, visible: str | None) -> subprocess.Popen:
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-port", str(port),
           str(Path(__file__).resolve()), "--child", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "2"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    log = open(run_dir / "launcher.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _pct(pred: int, meas: int | None) -> float | None:
    return None if not meas else round(100.0 * (pred - meas) / meas, 2)


def records(name: str, cfg, gpus: int, overrides: dict, run_dir: Path, rc: int, seconds: float, stamp: dict) -> list[dict]:
    from workbench import planner

    mems = {}
    for f in sorted(run_dir.glob("memory-rank*.json")):
        r = json.loads(f.read_text())
        mems[int(r["rank"])] = r
    first = mems.get(0) or {}
    common = {"config": name, "overrides": overrides, "run_config": cfg.to_dict(), "gpus": gpus,
              "seconds": round(seconds, 1), "kernel_path": first.get("kernel_path") or {},
              **{k: first[k] for k in ("kernels", "step_graph_failed") if k in first}, **stamp}
    if mems.get(0, {}).get("device"):
        common["device"] = mems[0]["device"]
    cuda = cfg.parallel.device == "cuda"
    if rc != 0 or len(mems) != gpus or (cuda and not all("peak_allocated" in m for m in mems.values())):
        tail = ""
        for p in sorted(run_dir.glob("**/*.log")):
            try:
                tail += f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            except OSError:
                pass
        return [{**common, "status": "failed", "returncode": rc, "log_tail": tail[-6000:]}]
    te = "Transformer Engine" in json.dumps(common["kernel_path"])
    plan = planner.predict(cfg, assumptions=planner.PlannerAssumptions(transformer_engine=te))
    out = []
    for rk in plan.ranks:
        m = mems[rk.rank]
        st = plan.stages[rk.pp_rank]
        alloc, res = m.get("peak_allocated"), m.get("peak_reserved")
        retries = sum(s.get("alloc_retries", 0) for s in m["steps"])
        out.append({
            **common, "rank": rk.rank, "tp_rank": rk.tp_rank, "pp_rank": rk.pp_rank, "dp_rank": rk.dp_rank,
            "status": ("ok" if not retries else "alloc_retries") if cuda else "no_memory_stats (cpu)",
            "measured_allocated": alloc, "measured_reserved": res,
            "measured_peak": alloc,  # the older records' name for the allocated peak
            "setup": m.get("setup"), "steps": m["steps"], "pools": m.get("pools"), "pools_after_step1": m.get("pools_after_step1"),
            "device_points": m.get("points"), "segments": m.get("segments"), "segments_after_step1": m.get("segments_after_step1"),
            "stats_setup": m.get("stats_setup"), "stats_end": m.get("stats_end"),
            "predicted_overheads": st.overheads, "predicted_detail": {k: v for k, v in st.detail.items() if k != "params"},
            "predicted_allocated": rk.peak_allocated, "predicted_reserved": rk.peak_reserved, "predicted_total": rk.total,
            "predicted": rk.peak_allocated, "predicted_components": st.components, "predicted_phase": st.peak_phase,
            "predicted_reserved_terms": st.reserved_terms, "decides": plan.decides,
            "planner_kernel_path": plan.kernel_path.to_dict(),
            "megatron_formula": plan.megatron.total, "megatron_formula_kind": plan.megatron.formula,
            "error_allocated_pct": _pct(rk.peak_allocated, alloc), "error_reserved_pct": _pct(rk.peak_reserved, res),
            "error_pct": _pct(rk.peak_allocated, alloc), "megatron_error_pct": _pct(plan.megatron.total, res),
        })
    return out


def _budget_bytes(cfg) -> float:
    """What a job may take on the shared GPU (generous: the planner is what is being tested)."""
    from workbench import planner

    plan = planner.predict(cfg, suggest=False)
    return 1.3 * max(r.peak_reserved for r in plan.ranks) + 2 * GiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="1gpu", choices=["1gpu", "2gpu", "2gpu-all"],
                    help="1gpu: the one-GPU matrix; 2gpu: the earlier 2-GPU matrix; 2gpu-all: every family's two-GPU layouts")
    ap.add_argument("--out", default=None, help="JSON lines to append to (default evidence/planner_1gpu.jsonl or planner_measurements.jsonl)")
    ap.add_argument("--only", default="", help="comma-separated config names (default: all of the set)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script itself (tiny shapes, gloo)")
    ap.add_argument("--keep", default=None, help="keep run directories here (default: a temp dir, removed)")
    ap.add_argument("--deadline", type=float, default=0, help="seconds: start no job after 85%% of it, stop running ones at it (0: none)")
    ap.add_argument("--concurrent", type=int, default=4, help="one-GPU jobs sharing a GPU at once (memory budget permitting)")
    ap.add_argument("--concurrent-multi", type=int, default=1,
                    help="multi-GPU jobs at once (1: alone, so the device-wide memory outside torch is this job's)")
    ap.add_argument("--gpu-bytes", type=float, default=76 * GiB, help="memory budget of one GPU for concurrent jobs")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from workbench.config import ConfigError

    every = {**{n: 1 for n in ONE_GPU}, **{n: g for n, (g, _) in TWO_GPU.items()}, **{n: g for n, (g, _, _) in TWO_GPU_ALL.items()}}
    if args.list:
        for n in names_of(args.set):
            print(f"{n:32s} {every[n]} GPU(s)  {(ONE_GPU.get(n) or TWO_GPU.get(n) or TWO_GPU_ALL.get(n))}")
        return 0
    names = [n for n in (args.only.split(",") if args.only else names_of(args.set)) if n]
    unknown = [n for n in names if n not in every]
    if unknown:
        print(f"unknown config(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    tiny = args.device == "cpu"
    stamp = _stamp()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="planner-measure-"))
    out = Path(args.out or (ROOT / "evidence" / {"1gpu": "planner_1gpu.jsonl", "2gpu": "planner_measurements.jsonl",
                                                  "2gpu-all": "planner_2gpu.jsonl"}[args.set]))
    out.parent.mkdir(parents=True, exist_ok=True)
    fh = open(out, "a")
    t_all = time.time()
    overrides = {n: (ONE_GPU[n][1] if n in ONE_GPU else TWO_GPU_ALL[n][2] if n in TWO_GPU_ALL else TWO_GPU[n][1]) for n in names}

    def finish(name: str, cfg, gpus: int, rc: int, t0: float) -> None:
        recs = records(name, cfg, gpus, overrides[name], work / name, rc, time.time() - t0, stamp)
        for rec in recs:
            fh.write(json.dumps(rec) + "\n")
        fh.flush()
        ok = [r for r in recs if r["status"] in ("ok", "alloc_retries")]
        if recs[0]["status"].startswith("no_memory_stats"):
            print(f"[{time.time() - t_all:6.1f}s] {name}: ran (rc {rc}); CPU has no CUDA memory stats; planner "
                  f"{recs[0]['predicted_allocated'] / GiB:.3f} / {recs[0]['predicted_reserved'] / GiB:.3f} GiB", flush=True)
        elif ok:
            errs = ", ".join(f"r{r['rank']} alloc {r['measured_allocated'] / GiB:.2f} meas / {r['predicted_allocated'] / GiB:.2f} pred "
                             f"({r['error_allocated_pct']:+.1f}%), reserved {r['measured_reserved'] / GiB:.2f} / "
                             f"{r['predicted_reserved'] / GiB:.2f} ({r['error_reserved_pct']:+.1f}%){' RETRIES' if r['status'] != 'ok' else ''}"
                             for r in ok)
            print(f"[{time.time() - t_all:6.1f}s] {name}: {errs}", flush=True)
        else:
            print(f"[{time.time() - t_all:6.1f}s] {name}: FAILED (rc {rc}):\n{recs[0].get('log_tail', '')[-2500:]}", flush=True)

    n_gpus = 0
    if not tiny:
        import torch

        n_gpus = torch.cuda.device_count()
    too_big = [n for n in names if every[n] > max(n_gpus, 1) and not tiny]
    if too_big:
        print(f"only {n_gpus} GPU(s): skipping {too_big}", flush=True)
    # Jobs share the GPUs under a memory budget: a one-GPU job takes the least-used GPU, a job of g GPUs
    # takes GPUs 0..g-1 (at most --concurrent per GPU; multi-GPU jobs at most --concurrent-multi at once).
    # The CPU self-check runs one job at a time.
    lanes = list(range(max(n_gpus, 1)))
    cap = 1 if tiny else args.concurrent
    cap_multi = 1 if tiny else args.concurrent_multi
    pending = []
    for n in names:
        if n in too_big:
            continue
        try:
            g, cfg = make_config(n, args.device, tiny)
        except ConfigError as err:
            print(f"{n}: bad config: {err}", flush=True)
            continue
        pending.append((n, g, cfg, 0.0 if tiny else _budget_bytes(cfg)))
    pending.sort(key=lambda p: p[1])  # one-GPU jobs first (as before), then the multi-GPU ones in their order
    running: list[tuple] = []  # (name, gpus, cfg, proc, t0, lanes, bytes)
    used = {lane: 0.0 for lane in lanes}
    late = False

    def room(g: int, need: float) -> list[int] | None:
        use = [min(lanes, key=lambda ln: used[ln])] if g == 1 else lanes[:g]
        busy = [r for r in running if set(r[5]) & set(use)]
        if not busy:
            return use
        if g > 1 and sum(1 for r in running if r[1] > 1) >= cap_multi:
            return None
        if all(sum(1 for r in running if ln in r[5]) < cap and used[ln] + need <= args.gpu_bytes for ln in use):
            return use
        return None

    while pending or running:
        elapsed = time.time() - t_all
        if args.deadline and elapsed > 0.85 * args.deadline and pending:
            print(f"[{elapsed:6.1f}s] deadline: not starting {[p[0] for p in pending]}", flush=True)
            pending, late = [], True
        started = True
        while started and pending:
            started = False
            for i, (n, g, cfg, need) in enumerate(pending):
                use = room(g, need)
                if use is None:
                    continue
                proc = launch(n, cfg, g, work, free_port(), None if tiny else ",".join(map(str, use)))
                running.append((n, g, cfg, proc, time.time(), use, need))
                for ln in use:
                    used[ln] += need
                pending.pop(i)
                started = True
                print(f"[{time.time() - t_all:6.1f}s] started {n} (GPUs {use}, budget {need / GiB:.1f} GiB each)", flush=True)
                break
        time.sleep(1.0)
        for r in list(running):
            n, g, cfg, proc, t0, use, need = r
            rc = proc.poll()
            if rc is None and args.deadline and time.time() - t_all > args.deadline:
                os.killpg(proc.pid, 9)
                rc = proc.wait()
                print(f"[{time.time() - t_all:6.1f}s] {n}: killed at the deadline", flush=True)
            if rc is not None:
                running.remove(r)
                for ln in use:
                    used[ln] -= need
                finish(n, cfg, g, rc, t0)
    fh.close()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} in {time.time() - t_all:.0f}s{' (deadline cut the set)' if late else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
