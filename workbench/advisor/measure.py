"""``workbench calibrate``'s ranks: measure one GPU's rates at a model's shapes and the links between the GPUs.

Run by ``workbench calibrate`` under the workbench's one-node torchrun (one process per visible GPU, NCCL;
``--cpu``: gloo on CPU with tiny sizes, which checks the machinery; its stores on the loopback only)::

    python -m workbench.launch.torchrun <workbench.launch.local_torchrun's options> --nproc-per-node N \\
        -m workbench.advisor.measure --config CFG.json --out RAW.json [--cpu]

Rank 0 times (CUDA events; host timers on CPU) bf16 GEMMs of the model's four layer GEMMs at TP = 1, 2,
4, 8, the fused attention forward + backward at the model's sequence and heads, a large copy, a fused
AdamW step, and FP8 GEMMs (``torch._scaled_mm``, where the GPU has them); every rank takes part in
all-reduce, all-gather, reduce-scatter and p2p send/recv from 1 to 256 MiB.  Rank 0 writes the raw
numbers as JSON; the caller turns them into a profile (:func:`workbench.advisor.cli.profile_from_raw`).
This module imports torch: it runs only in the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from workbench.advisor.perf_model import flop_split
from workbench.config import load_config
from workbench.provenance import stamp

SIZES_MIB = (1, 4, 16, 64, 256)
CPU_SIZES_MIB = (0.0625, 0.25, 1)


def median_seconds(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, 3 untimed ones first (CUDA events around each call on GPUs, the
    host clock on CPU): the timer of every kernel-sized probe (the bench's probes call it through
    ``bench.harness.median_ms``)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_shapes(cfg: Any, tp: int, tokens: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of a layer's four forward GEMMs on one TP rank: QKV, attention output, fc1, fc2."""
    m = cfg.model
    d, a, g = m.head_dim, m.num_attention_heads, m.query_groups
    fc1 = m.ffn_size * (2 if m.gated_mlp else 1)
    return [(tokens, m.hidden_size, d * (a + 2 * g) // tp), (tokens, a * d // tp, m.hidden_size),
            (tokens, m.hidden_size, fc1 // tp), (tokens, m.ffn_size // tp, m.hidden_size)]


def measure_compute(cfg: Any, dev: str, iters: int) -> dict[str, Any]:
    cuda = dev == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    m = cfg.model
    b, s = cfg.train.micro_batch_size, m.seq_length
    out: dict[str, Any] = {"gemm": [], "attention": [], "fp8": None}
    tps = [t for t in (1, 2, 4, 8) if m.num_attention_heads % t == 0 and m.query_groups % t == 0 and m.ffn_size % t == 0]
    for tp in tps:
        shapes = gemm_shapes(cfg, tp, b * s)
        mats = [(torch.randn(M, K, device=dev, dtype=dtype), torch.randn(K, N, device=dev, dtype=dtype)) for M, K, N in shapes]
        sec = median_seconds(lambda: [x @ w for x, w in mats], iters, cuda)
        flops = sum(2.0 * M * K * N for M, K, N in shapes)
        out["gemm"].append({"tp": tp, "gflop_per_call": flops / 4 / 1e9, "tflops": flops / sec / 1e12})
        del mats
    heads, d = m.num_attention_heads, m.head_dim
    q, k, v = (torch.randn(b, heads, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))

    def attn() -> None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.ones_like(o))

    sec = median_seconds(attn, iters, cuda)
    out["attention"].append({"seq": s, "tflops": flop_split(cfg, 1)["layer_attn"] * b * s / sec / 1e12})
    n = (256 if cuda else 4) * 2**20
    src, dst = torch.empty(n, device=dev, dtype=torch.float32), torch.empty(n, device=dev, dtype=torch.float32)
    out["memory_gbs"] = 2 * 4 * n / median_seconds(lambda: dst.copy_(src), iters, cuda) / 1e9
    p = torch.nn.Parameter(torch.zeros(n // 4, device=dev, dtype=torch.float32))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=cuda)
    out["optimizer_ns_per_param"] = median_seconds(opt.step, iters, cuda) / p.numel() * 1e9
    if cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9):
        M, K, N = gemm_shapes(cfg, 1, b * s)[2]
        x = torch.randn(M, K, device=dev).to(torch.float8_e4m3fn)
        w = torch.randn(N, K, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
        t8 = median_seconds(lambda: torch._scaled_mm(x, w, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), iters, cuda)
        t16 = median_seconds(lambda: xb @ wb, iters, cuda)
        out["fp8"] = {"speedup": t16 / t8, "shape": [M, K, N]}
    return out


def measure_links(dev: str, iters: int) -> dict[str, list[dict[str, float]]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = dev == "cuda"
    res: dict[str, list] = {"all_reduce": [], "all_gather": [], "reduce_scatter": [], "p2p": []}
    for mib in (SIZES_MIB if cuda else CPU_SIZES_MIB):
        n = int(mib * 2**20) // 2 // world * world  # bf16 / fp32 elements, divisible by the world
        dtype = torch.bfloat16 if cuda else torch.float32
        nbytes = n * (2 if cuda else 4)
        full = torch.ones(n, device=dev, dtype=dtype)
        part = torch.ones(n // world, device=dev, dtype=dtype)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def timed(fn: Callable[[], Any]) -> float:
            dist.barrier()
            sec = median_seconds(lambda: (fn(), sync()), iters, False)  # host timer around a synchronised call: every rank's view
            t = torch.tensor([sec], device=dev, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t.item())

        f = (world - 1) / world
        sec = timed(lambda: dist.all_reduce(full))
        res["all_reduce"].append({"bytes": nbytes, "busbw_gbs": 2 * f * nbytes / sec / 1e9, "seconds": sec})
        sec = timed(lambda: dist.all_gather_into_tensor(full, part))
        res["all_gather"].append({"bytes": nbytes, "busbw_gbs": f * nbytes / sec / 1e9, "seconds": sec})
        sec = timed(lambda: dist.reduce_scatter_tensor(part, full))
        res["reduce_scatter"].append({"bytes": nbytes, "busbw_gbs": f * nbytes / sec / 1e9, "seconds": sec})

        def p2p() -> None:
            if rank == 0:
                dist.send(full, 1)
            elif rank == 1:
                dist.recv(full, 0)

        sec = timed(p2p)
        res["p2p"].append({"bytes": nbytes, "busbw_gbs": nbytes / sec / 1e9, "seconds": sec})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="workbench calibrate's ranks")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    dev = "cpu" if a.cpu else "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    raw: dict[str, Any] = {**stamp("cpu" if a.cpu else None), "world_size": world}
    if rank == 0:
        raw.update(measure_compute(cfg, dev, a.iters))
    if world > 1:
        dist.init_process_group("gloo" if a.cpu else "nccl")
        try:
            raw["links"] = measure_links(dev, a.iters)
        finally:
            dist.destroy_process_group()
    if rank == 0:
        Path(a.out).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
