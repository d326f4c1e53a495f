"""A run's event records as pandas DataFrames: what ``Run.steps``, ``Run.train_loss`` and the rest return.

Pure functions of the typed records (:mod:`workbench.run.events`) a :class:`workbench.run.RunReader`
read; pandas is imported when a frame is made.  The charts (:mod:`workbench.plots.training`) draw them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from workbench.run.events import Event

__all__ = ["STEP_COLUMNS", "EVAL_COLUMNS", "ERROR_COLUMNS", "CHECKPOINT_COLUMNS", "MICROBATCH_COLUMNS", "frame", "steps",
           "train_loss", "memory", "microbatches", "evals", "progress", "throughput"]

STEP_COLUMNS = ["rank", "iteration", "time", "loss", "lr", "grad_norm", "skipped", "step_time", "tokens_per_s",
                "tflops_per_gpu", "mfu", "mem_allocated", "mem_reserved", "mem_peak"]
EVAL_COLUMNS = ["rank", "iteration", "loss", "ppl"]
ERROR_COLUMNS = ["rank", "time", "message", "type", "traceback"]
CHECKPOINT_COLUMNS = ["rank", "iteration", "path", "seconds"]
MICROBATCH_COLUMNS = ["rank", "iteration", "kind", "microbatch", "chunk", "start_ms", "end_ms"]
MEMORY_COLUMNS = ["rank", "iteration", "mem_allocated", "mem_reserved", "mem_peak"]


def frame(events: Iterable[Event], columns: Sequence[str]):
    """One row per record, with at least ``columns`` (empty float columns where no record has the field)."""
    import pandas as pd

    rows = [r.to_dict() for r in events]
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df.columns:
            df[c] = pd.Series(dtype="float64")
    return df


def steps(events: Iterable[Event]):
    """One row per (rank, step event): loss, lr, grad_norm, step_time, tokens_per_s, mfu, memory."""
    df = frame(events, STEP_COLUMNS)
    return df.sort_values(["iteration", "rank"]).reset_index(drop=True) if len(df) else df


def train_loss(steps_df):
    """Loss per iteration (mean over the ranks that hold it: the last pipeline stage)."""
    df = steps_df
    df = df[df["loss"].notna()] if len(df) else df
    return df.groupby("iteration", as_index=False)[["loss"]].mean() if len(df) else df[["iteration", "loss"]]


def memory(steps_df):
    """Latest memory numbers of each rank (bytes)."""
    df = steps_df
    if not len(df):
        return df[MEMORY_COLUMNS]
    return df.sort_values("iteration").groupby("rank", as_index=False).last()[MEMORY_COLUMNS]


def microbatches(events: Iterable[Event]):
    """One row per measured forward/backward op: rank, iteration, kind, microbatch, chunk, start_ms, end_ms."""
    import pandas as pd

    rows = []
    for e in events:
        for op in e.get("ops") or []:
            rows.append({"rank": e.get("rank"), "iteration": e.get("iteration"), **op})
    return pd.DataFrame(rows, columns=MICROBATCH_COLUMNS) if rows else pd.DataFrame(columns=MICROBATCH_COLUMNS)


def evals(events: Iterable[Event]):
    """Eval loss and perplexity per iteration (mean over the ranks that report them)."""
    df = frame(events, EVAL_COLUMNS)
    if not len(df):
        return df
    return df.groupby("iteration", as_index=False)[["loss", "ppl"]].mean()


def progress(steps_df, total: int) -> tuple[int, int, float | None]:
    """(last iteration, ``total`` train iterations, ETA seconds or None) from the recent step times."""
    df = steps_df
    if not len(df):
        return 0, total, None
    last = int(df["iteration"].max())
    per_it = df.groupby("iteration")["step_time"].max().dropna().tail(10)
    eta = float(per_it.mean() * max(total - last, 0)) if len(per_it) else None
    return last, total, eta


def throughput(st) -> dict:
    """tokens/s as total tokens over total time (not a mean of per-step rates, which an uneven run
    inflates): the tokens of iterations 2..N over the wall time between the first and the last step
    event; mean step time; MFU weighted by step time. The first iteration (warm-up) is left out."""
    st = st.assign(tokens=st["tokens_per_s"] * st["step_time"])
    per_it = st.groupby("iteration").agg(step_time=("step_time", "max"), tokens=("tokens", "max"),
                                         mfu=("mfu", "max"), time=("time", "max")).sort_index()
    tail = per_it.iloc[1:] if len(per_it) > 1 else per_it
    out: dict[str, float] = {}
    if tail["step_time"].notna().any():
        out["step_time"] = float(tail["step_time"].mean())
    if tail["tokens"].notna().any():
        wall = float(per_it["time"].iloc[-1] - per_it["time"].iloc[0]) if len(per_it) > 1 else 0.0
        busy = float(tail["step_time"].sum())
        if max(wall, busy) > 0 and tail["tokens"].sum() > 0:  # (steps of no duration: no throughput to give)
            out["tokens_per_s"] = float(tail["tokens"].sum()) / max(wall, busy)  # never faster than the steps themselves
    ok = tail[tail["mfu"].notna() & (tail["step_time"] > 0)]
    if len(ok):  # weighted by step time: records with an MFU but no step time cannot weigh in
        out["mfu"] = float((ok["mfu"] * ok["step_time"]).sum() / ok["step_time"].sum())
    return out
