"""The planner against committed GPU measurements: one table, re-planned with today's planner.

``tests/gpu_proofs/planner_measure.py`` writes one JSON line per rank of each measured layout (device, date,
commit, the run's config and kernel path, peak allocated and reserved).  :func:`evidence_table`
re-plans each record and lays predicted next to measured; the memory-planner notebook shows it and
``tests/planner/test_planner_1gpu_evidence.py`` holds the same errors to 5%.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable

from workbench import kernel_rule, planner
from workbench.config import RunConfig
from workbench.run.reader import as_reader

__all__ = ["BAR", "EVIDENCE_DIR", "ONE_GPU_FILES", "evidence_table", "replan", "run_within_bar"]

#: the planner's bar against a measured run: |predicted - measured| / measured, allocated and reserved, every rank
BAR = 0.05

EVIDENCE_DIR = Path(__file__).resolve().parents[2] / "evidence"
#: the one-GPU measurements: GPT layouts, then the BERT / T5 layouts, then the compiled layer's, then the step graph's
#: and the q/k norms', then BERT, T5 and selective recompute on the step graph (each file one device call)
ONE_GPU_FILES = (EVIDENCE_DIR / "planner_1gpu.jsonl", EVIDENCE_DIR / "planner_1gpu_families.jsonl",
                 EVIDENCE_DIR / "planner_1gpu_compiled_layer.jsonl",
                 EVIDENCE_DIR / "planner_1gpu_step_graph_qk_norms.jsonl",
                 EVIDENCE_DIR / "planner_1gpu_step_graph_families.jsonl")


#: the day BERT's masked-LM head began running on the masked positions only (09f287d): records before it ran the
#: head on every position
MASKED_HEAD_SINCE = "2026-11-25"


def replan(rec: dict) -> planner.Plan:
    """Today's plan for a measured record, on the kernel path the run reported: TE or not, the
    compiled layer or megatron's (a record taken before the rule moved a config to the compiled
    layer is re-planned on the layer it measured), the step captured as one graph or the layers
    graphed one by one, or none (a record the rule has graphed since), the LM head on every position or only the
    rows the family's head needs (:data:`MASKED_HEAD_SINCE`)."""
    kp = rec.get("kernel_path") or {}
    te = "Transformer Engine" in json.dumps(kp)
    compiled = "compiled dense layer" in str(kp.get("fast_layer", ""))
    impl = (rec.get("kernels") or {}).get("cuda_graphs_impl")  # recorded since 84dd336's rows; before, the note
    step = (impl == "step" if impl is not None else kp.get("fast_cuda_graphs") == kernel_rule.STEP_GRAPH_NOTE) \
        and not rec.get("step_graph_failed")  # a failed capture trains eagerly
    return planner.predict(RunConfig.from_dict(json.loads(json.dumps(rec["run_config"]))), suggest=False,
                           assumptions=planner.PlannerAssumptions(transformer_engine=te, compiled_layer=compiled,
                                                                  step_graph=step,
                                                                  cuda_graphs=False if _graphs_were_off(impl, kp) else None,
                                                                  lm_head_every_position=rec["date"] < MASKED_HEAD_SINCE))


def _graphs_were_off(impl: str | None, kp: dict) -> bool:
    """A record that ran without CUDA graphs: its kernels say so (``cuda_graphs_impl`` "", since 84dd336's rows), or
    before that its kernel path said why they were off and named none on."""
    if impl is not None:
        return impl == ""
    return "fast_cuda_graphs_off" in kp and "fast_cuda_graphs" not in kp


def _short_device(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100" (the GPU's model; the name as recorded when it names none)."""
    m = re.search(r"\b([A-Z]\d{2,3}[A-Z]?)\b", name)
    return m.group(1) if m else name


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
                         "device": _short_device(rec["device"]), "date": rec["date"][:10],
                         "commit": rec["commit"][:7], "file": path.name})
    return pd.DataFrame(rows).round(2)


def run_within_bar(run_dir, plan: planner.Plan | None = None, bar: float = BAR) -> dict:
    """A finished run's measured peaks against its plan, every rank, allocated and reserved.

    Measured: the largest ``mem_peak`` (``max_memory_allocated``) and ``mem_reserved`` of each rank's ``step``
    events (:func:`workbench.planner.measured_peaks`, :func:`~workbench.planner.measured_reserved`); predicted:
    ``plan`` or the plan of the run's own config.  Returns ``{"ok", "bar", "ranks": [...], "why"}``: ``ok`` only
    when every rank of the plan was measured and both errors are within ``bar``."""
    reader = as_reader(run_dir)
    if plan is None:
        cfg = reader.config_dict()
        if cfg is None:
            return {"ok": False, "bar": bar, "ranks": [], "why": [f"{reader.run_dir}: no config.json or run_start to plan"]}
        plan = planner.predict(RunConfig.from_dict(cfg), suggest=False)
    table = planner.compare(plan, planner.measured_peaks(reader), planner.measured_reserved(reader))
    rows = table[["rank", "predicted", "measured", "error_pct", "predicted_reserved", "measured_reserved",
                  "reserved_error_pct"]].to_dict("records")
    why = []
    for r in rows:
        for what, key in (("allocated", "error_pct"), ("reserved", "reserved_error_pct")):
            err = r[key]
            if err is None or err != err:
                why.append(f"rank {r['rank']}: no measured {what} peak")
            elif abs(err) > 100 * bar:
                why.append(f"rank {r['rank']}: {what} predicted {err:+.1f}% off the measured peak (bar {100 * bar:.0f}%)")
    return {"ok": not why and bool(rows), "bar": bar, "ranks": rows, "why": why}
