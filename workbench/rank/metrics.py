"""Throughput and memory numbers for ``step`` events: tokens/s, TFLOP/s per GPU, MFU, memory.

FLOPs per step come from :func:`workbench.config.derive` (Megatron's formula; recompute not
counted, so this is MFU, not hardware utilisation).  Peak dense TFLOP/s per GPU from the
table below (bf16/fp16 tensor-core dense; TF32 for fp32 runs), or ``train.peak_tflops``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["PEAK_TFLOPS", "peak_tflops", "memory_stats"]

#: device-name substring -> (bf16/fp16 dense, tf32 dense) TFLOP/s
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.0, 494.5),
    "H100": (989.0, 494.5),  # SXM; PCIe parts are lower: set train.peak_tflops
    "GH200": (989.0, 494.5),
    "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0),
    "A10G": (125.0, 62.5),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "V100": (125.0, 15.7),
}


def peak_tflops(device_name: str, precision: str, override: Optional[float] = None) -> Optional[float]:
    if override:
        return float(override)
    for key, (half, tf32) in PEAK_TFLOPS.items():
        if key in device_name:
            return half if precision in ("bf16", "fp16") else tf32
    return None


def memory_stats(cuda: bool) -> dict[str, Optional[int]]:
    if not cuda:
        return {"mem_allocated": None, "mem_reserved": None, "mem_peak": None}
    return {
        "mem_allocated": int(torch.cuda.memory_allocated()),
        "mem_reserved": int(torch.cuda.memory_reserved()),
        "mem_peak": int(torch.cuda.max_memory_allocated()),
    }
