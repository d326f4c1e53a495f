"""Python's garbage collector on a training rank: the automatic collector against the rank's :class:`StepCollector`.

One process on CPU trains ``moe-research``'s depth (16 layers, 64 experts, top-8) at toy widths with the backend's
``Trainer`` (the rank's Python objects are those of the real model: the modules, parameters, autograd graphs), and
counts, over ``--steps`` steps after ``--warmup``, the collections by generation and their time (``gc.callbacks``),
first with Python's automatic collector, then inside ``with trainer.collector`` (``workbench/rank/collector.py``).
A row per side (JSON lines with device, date, git commit)::

    python bench/gc_probe.py --out bench/results/gc_probe.jsonl

What this measures is the collector's own time a step (``gc_ms_per_step``) and when its full passes land; the step
times of a shared 2-core host are noise at this size, and the device plays no part (the GPU rows are
``moe_bench.py``'s).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.provenance import git_commit  # noqa: E402


class _Clock:
    """The collections by generation and their milliseconds, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.events.append((info["generation"], (time.perf_counter() - self._t0) * 1e3))


def _trainer(steps: int):
    from workbench.config import preset
    from workbench.rank.train import Trainer

    over = {"parallel.device": "cpu", "train.precision": "bf16", "model.hidden_size": 64, "model.num_attention_heads": 4,
            "model.num_query_groups": 2, "model.moe.ffn_hidden_size": 32, "model.seq_length": 32,
            "model.vocab_size": 4096, "train.micro_batch_size": 1, "train.global_batch_size": 2,
            "train.compile_kernels": False, "train.train_iters": steps, "train.lr_decay_iters": steps,
            "train.lr_warmup_iters": 2, "train.eval_interval": 0, "checkpoint.save_on_exit": False,
            "train.microbatch_timing_interval": 0}
    tr = Trainer(preset("moe-research", **over).check(), tempfile.mkdtemp(prefix="gc-probe-"))
    tr.setup()
    return tr


def measure(tr, side: str, warmup: int, steps: int) -> dict:
    clock = _Clock()
    for _ in range(warmup):
        tr.train_step()
    gc.callbacks.append(clock)
    t0 = time.perf_counter()
    try:
        for _ in range(steps):
            tr.train_step()
    finally:
        gc.callbacks.remove(clock)
    wall = time.perf_counter() - t0
    by_gen = {g: [ms for gen, ms in clock.events if gen == g] for g in (0, 1, 2)}
    return {"side": side, "steps": steps, "step_ms": wall / steps * 1e3,
            "gc_ms_per_step": sum(ms for _g, ms in clock.events) / steps,
            "collections": {str(g): len(v) for g, v in by_gen.items()},
            "gen2_ms": [round(ms, 1) for ms in by_gen[2]], "objects_tracked": len(gc.get_objects())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gc_probe.jsonl"))
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_PORT" not in os.environ:
        from workbench.run.files import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    tr = _trainer(2 * (a.warmup + a.steps) + 2)
    stamp = {"device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "git_commit": os.environ.get("GIT_COMMIT") or git_commit(), "preset": "moe-research (toy widths)"}
    # automatic first: once a collector has frozen and unfrozen the objects, the automatic full passes are no longer
    # what a fresh rank's are
    rows = [measure(tr, "automatic", a.warmup, a.steps)]
    with tr.collector:
        rows.append({**measure(tr, "step collector", a.warmup, a.steps), "collector_last_ms": tr.collector.last_ms})
    with open(a.out, "a") as fh:
        for r in rows:
            fh.write(json.dumps({**stamp, **r}) + "\n")
            print(f"{r['side']:>15}: step {r['step_ms']:.0f} ms, gc {r['gc_ms_per_step']:.1f} ms a step, "
                  f"collections {r['collections']}, full passes {r['gen2_ms']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
