"""The checks of what would certainly fail after the start: memory the device does not have, a directory the run
cannot write or has no room in.  :func:`~workbench.launch.checks.launch_checks` makes them, so ``workbench launch``
(``--dry-run`` too) and ``Run.launch`` refuse with exit 2 / ``ConfigError`` before any process starts.

- :func:`memory_problems`: the planner's verdict (:func:`workbench.planner.predict`) gates a CUDA launch: a rank over
  this machine's GPU memory (``nvidia-smi``), or, where the GPUs are not this machine's (a dry run, SLURM), over
  the most memory any accelerator has, is refused with the plan and its suggestions; ``ignore_memory_plan`` (the
  flag ``--ignore-memory-plan``) launches anyway.  CPU configs are not planned.
- :func:`path_problems`: the run directory, ``checkpoint.save_dir`` and ``data.cache_dir`` must be directories this
  process can write (a file there, a read-only file system, no permission are refused) with room: a checkpoint's
  estimated bytes where checkpoints go, a little for events and logs in the run directory.

Torch-free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from workbench.config import Problem, RunConfig
from workbench.config_fields import LARGEST_ACCELERATOR_BYTES
from workbench.writable import dir_write_problem, existing_ancestor

__all__ = ["detect_gpu_memory", "memory_problems", "path_problems", "checkpoint_bytes", "RUN_DIR_ROOM"]

#: what a run directory needs besides checkpoints (events, logs, the data cache of the demo corpus)
RUN_DIR_ROOM = 64 << 20
_GiB = 1024**3


def detect_gpu_memory() -> int | None:
    """The memory of the smallest visible NVIDIA GPU in bytes, asked of ``nvidia-smi`` (None: none, or unknown)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return None
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = {}
    for line in out.splitlines():
        idx, _, mib = line.partition(",")
        if idx.strip().isdigit() and mib.strip().isdigit():
            sizes[idx.strip()] = int(mib.strip()) << 20
    if visible is not None:
        sizes = {k: v for k, v in sizes.items() if k in {x.strip() for x in visible.split(",")}} or sizes
    return min(sizes.values()) if sizes else None


def memory_problems(cfg: RunConfig, *, local: bool, ignore_memory_plan: bool = False) -> list[Problem]:
    """The planner's verdict on ``cfg`` (CUDA only) against this machine's GPU memory (``local``) or, where the GPUs
    are another machine's, the most any accelerator has; [] when it fits or ``ignore_memory_plan``."""
    if cfg.parallel.device != "cuda" or ignore_memory_plan:
        return []
    from workbench.planner import GPUSpec, predict

    capacity = detect_gpu_memory() if local else None
    where = f"this machine's GPU ({capacity / _GiB:.1f} GiB)" if capacity else ""
    if capacity is None:
        capacity = LARGEST_ACCELERATOR_BYTES
        where = f"the most memory any accelerator has ({capacity / 1e9:.0f} GB; the GPUs here are not known)"
    try:
        plan = predict(cfg, suggest=False)
    except Exception:  # noqa: BLE001  (a config the planner cannot model: its verdict gates nothing)
        return []
    worst = plan.worst
    if worst.total <= capacity:
        return []
    try:
        plan = predict(cfg, gpu=GPUSpec("this launch's GPU", capacity))
    except Exception:  # noqa: BLE001
        pass
    parts = ", ".join(f"{k} {v / _GiB:.1f}" for k, v in sorted(worst.components.items(), key=lambda kv: -kv[1]) if v >= _GiB // 100)
    fixes = "; ".join(s.text for s in plan.suggestions[:3] if s.fits) or "a smaller micro-batch or sequence, recompute, more tensor/pipeline parallelism"
    return [Problem("memory", f"the memory plan puts pipeline stage {worst.pp_rank}'s ranks at {worst.total / _GiB:.1f} GiB "
                    f"({parts} GiB at the peak; `workbench plan` shows every rank), over {where}: the launch would run "
                    "out of memory", f"{fixes}; or pass --ignore-memory-plan (Run.launch(ignore_memory_plan=True)) to launch anyway")]


def checkpoint_bytes(cfg: RunConfig) -> int:
    """About what one saved checkpoint of ``cfg`` takes: the weights in the training precision plus the optimizer's
    fp32 state (moments, and the master copy of 16-bit weights)."""
    params = cfg.derived().params.total
    per = (4 + 8) if cfg.train.precision == "fp32" else (2 + 12)
    return int(params * per)


def _dir_problem(field: str, path: Path, room: int, why_room: str) -> Problem | None:
    """A directory a run writes (made if missing): a file in its place, no write access, less than ``room`` free."""
    path = path.expanduser().absolute()
    why = dir_write_problem(path)
    if why:
        return Problem(field, why, f"point {field} at a directory this user can write, on a writable file system")
    free = shutil.disk_usage(existing_ancestor(path)).free
    if free < room:
        return Problem(field, f"{path}: {free / 2**20:.0f} MiB free on its file system, {why_room} needs about "
                              f"{room / 2**20:.0f} MiB", f"free space there, or point {field} at a larger disk")
    return None


def path_problems(cfg: RunConfig, run_dir: Path | None, run_root: Path | None = None) -> list[Problem]:
    """Every directory the run writes, checked before it starts (see the module docstring).  ``run_dir``: the run
    directory given, or None for a fresh one under ``run_root`` (default ``$WORKBENCH_RUNS`` or ``runs``)."""
    from workbench.launch.plan import DEFAULT_RUN_ROOT

    c = cfg.checkpoint
    saves = c.save_interval > 0 or c.save_on_exit
    ckpt = checkpoint_bytes(cfg) if saves else 0
    if run_dir is None:
        run_dir, rd_field = Path(run_root or os.environ.get("WORKBENCH_RUNS", DEFAULT_RUN_ROOT)), "run_root"
    else:
        rd_field = "run_dir"
    out = []
    in_run_dir = RUN_DIR_ROOM + (0 if c.save_dir else ckpt)
    p = _dir_problem(rd_field, Path(run_dir), in_run_dir,
                     "the run's events and logs" + ("" if c.save_dir or not saves else " and one checkpoint (<run_dir>/checkpoints)"))
    if p:
        out.append(p)
    if c.save_dir and (p := _dir_problem("checkpoint.save_dir", Path(c.save_dir), ckpt + (16 << 20), "one checkpoint")):
        out.append(p)
    if cfg.data.cache_dir and (p := _dir_problem("data.cache_dir", Path(cfg.data.cache_dir), 1 << 20, "the dataset index cache")):
        out.append(p)
    return out
