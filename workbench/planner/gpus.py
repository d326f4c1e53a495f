"""The GPUs a plan checks against: the catalogue (capacity as the driver reports it) and custom capacities."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MiB", "GiB", "GPUSpec", "GPUS", "gpu_spec"]

MiB = 1024**2
GiB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """A GPU model and its memory as the driver reports it (``nvidia-smi`` total)."""

    name: str
    capacity_bytes: int


GPUS: dict[str, GPUSpec] = {
    "H100-80GB": GPUSpec("H100-80GB", 81559 * MiB),
    "H200-141GB": GPUSpec("H200-141GB", 143771 * MiB),
    "A100-40GB": GPUSpec("A100-40GB", 40960 * MiB),
    "A100-80GB": GPUSpec("A100-80GB", 81920 * MiB),
}
_GPU_ALIASES = {
    "h100": "H100-80GB", "h100-80gb": "H100-80GB", "h100-80g": "H100-80GB", "h100-sxm": "H100-80GB",
    "h200": "H200-141GB", "h200-141gb": "H200-141GB", "h200-141g": "H200-141GB",
    "a100": "A100-80GB", "a100-80gb": "A100-80GB", "a100-80g": "A100-80GB",
    "a100-40gb": "A100-40GB", "a100-40g": "A100-40GB",
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(b|kb|kib|mb|mib|gb|gib|tb|tib)?\s*$", re.I)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "kib": 1024, "mb": 10**6, "mib": MiB, "gb": 10**9, "gib": GiB, "tb": 10**12, "tib": 1024**4}


def gpu_spec(gpu: str | int | GPUSpec | None) -> GPUSpec | None:
    """A catalogue GPU by (case-insensitive) name, or a custom capacity: bytes, '24GiB', '80GB'."""
    if gpu is None or isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, bool):
        raise ValueError(f"not a GPU: {gpu!r}")
    if isinstance(gpu, (int, float)):
        if gpu <= 0:
            raise ValueError(f"GPU capacity must be positive bytes, got {gpu}")
        return GPUSpec(f"custom ({int(gpu) / GiB:.1f} GiB)", int(gpu))
    key = str(gpu).strip()
    if key in GPUS:
        return GPUS[key]
    alias = _GPU_ALIASES.get(key.lower().replace(" ", "-").replace("_", "-"))
    if alias:
        return GPUS[alias]
    m = _SIZE_RE.match(key)
    if m:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None])
        if n > 0:
            return GPUSpec(f"custom ({n / GiB:.1f} GiB)", n)
    raise ValueError(f"unknown GPU {gpu!r}: use one of {', '.join(GPUS)} or a capacity such as '24GiB' / 25769803776")
