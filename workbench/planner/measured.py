"""Measured against predicted: a run's peak allocated / reserved bytes per rank from its step events, and the
table that lays them beside a plan (and megatron's formula)."""

from __future__ import annotations

from pathlib import Path

from workbench.planner.plan import Plan
from workbench.run.reader import RunReader, as_reader

__all__ = ["measured_peaks", "measured_reserved", "compare"]


def measured_peaks(run_dir: str | Path | RunReader) -> dict[int, int]:
    """Peak allocated bytes per rank of a run: the max ``mem_peak`` of its ``step`` events.

    ``run_dir``: a run directory or its :class:`workbench.run.RunReader` (a ``Run``'s ``reader``).
    """
    return _max_per_rank(run_dir, "mem_peak")


def measured_reserved(run_dir: str | Path | RunReader) -> dict[int, int]:
    """Reserved bytes per rank of a run: the max ``mem_reserved`` of its ``step`` events (the
    caching allocator never returns segments during training, so the last is the peak)."""
    return _max_per_rank(run_dir, "mem_reserved")


def _max_per_rank(run_dir: str | Path | RunReader, field: str) -> dict[int, int]:
    """The largest ``field`` of each rank's ``step`` events."""
    out: dict[int, int] = {}
    for ev in as_reader(run_dir).records("step"):
        value = getattr(ev, field)
        if value is not None and ev.rank is not None:
            out[int(ev.rank)] = max(out.get(int(ev.rank), 0), int(value))
    return out


def compare(plan: Plan, measured: dict[int, int], reserved: dict[int, int] | None = None):
    """A DataFrame of predicted vs measured peak allocated bytes per rank (and megatron's formula);
    with ``reserved`` (:func:`measured_reserved`) the reserved peaks too."""
    import pandas as pd

    rows = []
    for r in plan.ranks:
        meas = measured.get(r.rank, measured.get(str(r.rank)))  # type: ignore[call-overload]
        res = (reserved or {}).get(r.rank)
        rows.append({
            "predicted_reserved": r.peak_reserved, "measured_reserved": res,
            "reserved_error_pct": None if not res else 100.0 * (r.peak_reserved - res) / res,
            "rank": r.rank, "tp": r.tp_rank, "pp": r.pp_rank, "dp": r.dp_rank,
            "predicted": r.peak_allocated, "measured": meas,
            "error_pct": None if not meas else 100.0 * (r.peak_allocated - meas) / meas,
            "megatron_formula": plan.megatron.total,
            "megatron_error_pct": None if not meas else 100.0 * (plan.megatron.total - meas) / meas,
            "predicted_total": r.total,
        })
    return pd.DataFrame(rows)
