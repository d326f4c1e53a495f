"""Small run directories written with the real event writer (no training): what the run-comparison tests read.

:func:`write_run` writes ``config.json`` (the parts the comparison reads) and one ``rank-<r>.jsonl`` per rank with
``run_start``, ``step`` and ``eval`` records at the times given, then a ``run_end``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from workbench.run.events import EventWriter, RunEnd, RunStart

#: when every synthetic run starts (seconds since 1970), so wall times are known exactly
T0 = 1_800_000_000.0


def config(seq_length: int = 32, global_batch_size: int = 4, train_iters: int = 10, arch: str = "gpt",
           tp: int = 1, pp: int = 1, nproc: int = 1, **model: Any) -> dict:
    return {"name": "synthetic", "model": {"arch": arch, "seq_length": seq_length, **model},
            "train": {"global_batch_size": global_batch_size, "train_iters": train_iters},
            "parallel": {"tensor_parallel": tp, "pipeline_parallel": pp, "nproc_per_node": nproc, "nnodes": 1}}


def write_run(run_dir: Path, steps: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]] = (), *,
              cfg: dict | None = None, ranks: Sequence[int] = (0,), status: str | None = "finished",
              start: float = T0) -> Path:
    """A run directory: ``steps`` / ``evals`` are the fields of each record (``iteration`` and ``time`` included,
    ``rank`` optional: default every rank of ``ranks`` writes the same record); fields a record does not declare
    (``accuracy``) go to its ``extra`` as the backend writes them."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = cfg or config()
    (run_dir / "config.json").write_text(json.dumps(cfg))
    writers = {r: EventWriter(run_dir, r) for r in ranks}
    try:
        for r, w in writers.items():
            w.write(RunStart(config=cfg, world_size=len(ranks), time=start, coords={"tp": 0, "pp": 0, "dp": r}))
        for kind, records in (("step", steps), ("eval", evals)):
            for rec in records:
                rec = dict(rec)
                who = [rec.pop("rank")] if "rank" in rec else list(ranks)
                for r in who:
                    writers[r].emit(kind, rank=r, **rec)
        if status is not None:
            last = max([float(s["time"]) for s in steps] + [start]) + 1.0
            for r, w in writers.items():
                w.write(RunEnd(status=status, iteration=max((s["iteration"] for s in steps), default=0), time=last))
    finally:
        for w in writers.values():
            w.close()
    return run_dir

