"""The planner against committed GPU measurements: one table, re-planned with today's planner.

``tests/gpu/planner_measure.py`` writes one JSON line per rank of each measured layout (device, date,
commit, the run's config and kernel path, peak allocated and reserved).  :func:`evidence_table`
re-plans each record and lays predicted next to measured; the memory-planner notebook shows it and
``tests/unit/test_planner_1gpu_evidence.py`` holds the same errors to 5%.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from workbench import planner
from workbench.config import RunConfig

__all__ = ["EVIDENCE_DIR", "ONE_GPU_FILES", "evidence_table", "replan"]

EVIDENCE_DIR = Path(__file__).resolve().parents[1] / "evidence"
#: the one-GPU measurements of issue #26: GPT layouts, then the BERT / T5 layouts
ONE_GPU_FILES = (EVIDENCE_DIR / "planner_1gpu.jsonl", EVIDENCE_DIR / "planner_1gpu_families.jsonl",
                 EVIDENCE_DIR / "planner_1gpu_compiled_layer.jsonl")


def replan(rec: dict) -> planner.Plan:
    """Today's plan for a measured record, on the kernel path the run reported: TE or not, and the
    compiled layer or megatron's (a record taken before the rule moved a config to the compiled
    layer is re-planned on the layer it measured)."""
    kp = rec.get("kernel_path") or {}
    te = "Transformer Engine" in json.dumps(kp)
    compiled = "compiled dense layer" in str(kp.get("fast_layer", ""))
    return planner.predict(RunConfig.from_dict(json.loads(json.dumps(rec["run_config"]))), suggest=False,
                           assumptions=planner.PlannerAssumptions(transformer_engine=te, compiled_layer=compiled))


def evidence_table(paths: Iterable[Path] = ONE_GPU_FILES):
    """A pandas DataFrame: one row per measured rank (status ``ok``), measured vs predicted, GiB and %."""
    import pandas as pd

    rows = []
    for path in map(Path, paths):
        if not path.exists():
            continue
        for rec in (json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()):
            if rec.get("status") != "ok" or not rec.get("measured_reserved"):
                continue
            plan = replan(rec)
            r, kp = plan.ranks[rec["rank"]], plan.kernel_path
            ma, mr = rec["measured_allocated"], rec["measured_reserved"]
            rows.append({"config": rec["config"], "arch": rec["run_config"]["model"].get("arch", "gpt"), "rank": rec["rank"],
                         "path": f"{kp.layer}{' + graphs' if kp.cuda_graphs else ''}",
                         "recompute": rec["run_config"]["parallel"]["recompute"],
                         "alloc GiB": ma / 2**30, "alloc pred": r.peak_allocated / 2**30,
                         "alloc err %": 100 * (r.peak_allocated - ma) / ma,
                         "reserved GiB": mr / 2**30, "reserved pred": r.peak_reserved / 2**30,
                         "reserved err %": 100 * (r.peak_reserved - mr) / mr,
                         "device": rec["device"], "date": rec["date"][:10], "commit": rec["commit"], "file": path.name})
    return pd.DataFrame(rows).round(2)
