"""Where a benchmark step's time goes: a torch-profiler summary (device time by kernel category, top kernels,
wall vs device time, host waits and kernel launches per step).  Benchmark-only code; torch imported lazily."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["profile_steps", "summary", "host_profile", "cuda_ms", "probe_args", "probe_emit"]


def probe_args(name: str, doc: str) -> Optional[argparse.Namespace]:
    """A GPU kernel probe's command line (``--out``: a JSONL file its row is appended to); None, said on stderr, where
    no GPU is seen (the probe then exits 2)."""
    import torch

    ap = argparse.ArgumentParser(prog=name, description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"{name}: needs a GPU", file=sys.stderr)
        return None
    return args


def probe_emit(row: dict, out: Optional[str]) -> None:
    """A probe's row: one JSON line on stdout, appended to ``out`` when given."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def cuda_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 5) -> float:
    """Milliseconds a call of ``fn`` takes on the GPU: CUDA events around ``iters`` calls after ``warmup``."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def profile_steps(step_fn: Callable[[], Any], cuda: bool, want: bool, steps: int = 3, top: int = 15) -> Optional[dict]:
    """Torch-profiler summary (:func:`summary`) of ``steps`` calls of ``step_fn`` on the GPU; None when not ``want``."""
    if not (want and cuda):
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    return summary(prof, steps, wall, top=top)


def summary(prof: Any, steps: int, wall_s: Optional[float] = None, top: int = 15) -> dict[str, Any]:
    """Top kernels by device time and device time by category, per step."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    rows = []
    for e in events:
        # CPU ops also carry their kernels' time: count kernels only; a range a user annotated (the optimizer's
        # ``Optimizer.step#AdamW.step``) is mirrored on the device's timeline over kernels already counted
        if e.device_type == DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0)
        if dev and dev > 0:
            rows.append((e.key, float(dev) / 1000.0 / steps, int(e.count) // steps))
    total = sum(r[1] for r in rows) or 1.0
    step_wall_ms = wall_s / steps * 1000.0 if wall_s else None
    rows.sort(key=lambda r: -r[1])

    def category(name: str) -> str:
        n = name.lower()
        if "nccl" in n:
            return "communication"
        if any(k in n for k in ("flash", "fmha", "attention", "sdpa")):
            return "attention"
        if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul", "cublas")) or n.startswith("sm90_"):
            return "gemm"
        if "adam" in n or "foreach" in n or "multi_tensor" in n:
            return "optimizer / multi-tensor"
        if n.startswith("triton") or "triton" in n:
            return "compiled (triton) fused"
        if "memcpy" in n or "memset" in n:
            return "memcpy/memset"
        if any(k in n for k in ("layer_norm", "layernorm", "softmax", "cross_entropy", "nll", "log_softmax")):
            return "norm / softmax / loss (eager)"
        return "other (eager element-wise, reductions)"

    # host side: how long the CPU waited on the GPU (syncs: GPU-bound when large) and how many
    # kernel launches it issued (host-bound when waits are ~0 and the device is often idle)
    host_wait_ms, launches = 0.0, 0
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if "Synchronize" in e.key or e.key in ("aten::_local_scalar_dense",):
            host_wait_ms += float(getattr(e, "self_cpu_time_total", 0.0)) / 1000.0 / steps
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += int(e.count) // steps
    by_cat: dict[str, float] = {}
    for name, ms, _ in rows:
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + ms
    return {
        "device_ms_per_step": round(total, 3),  # kernels, summed (streams may overlap)
        "wall_ms_per_step": round(step_wall_ms, 3) if step_wall_ms else None,  # under the profiler
        "device_busy_fraction": round(total / step_wall_ms, 4) if step_wall_ms else None,
        "by_category_ms": {k: round(v, 3) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:120], "ms_per_step": round(ms, 3), "calls_per_step": c,
                         "share": round(ms / total, 4)} for n, ms, c in rows[:top]],
        "kernels_per_step": sum(c for _, _, c in rows),
        "host_sync_wait_ms_per_step": round(host_wait_ms, 3),
        "kernel_launches_per_step": launches,
    }


def host_profile(step_fn: Callable[[], Any], cuda: bool, want: bool, steps: int = 2, top: int = 30) -> Optional[dict]:
    """cProfile of a few steps: where the host's Python time goes (inflated by the profiler)."""
    if not want:
        return None
    import cProfile
    import pstats

    _sync(cuda)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step_fn()
    _sync(cuda)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in st.stats.items():
        rows.append({"fn": f"{Path(file).name}:{line}({func})", "tottime_ms": round(tt * 1000 / steps, 3),
                     "cumtime_ms": round(ct * 1000 / steps, 3), "calls": nc // steps})
    by_tot = sorted(rows, key=lambda r: -r["tottime_ms"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cumtime_ms"])[:top]
    return {"wall_ms_per_step_under_cprofile": round(wall * 1000 / steps, 2), "by_tottime": by_tot, "by_cumtime": by_cum}


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()
