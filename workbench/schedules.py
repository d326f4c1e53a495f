"""Pipeline-parallel schedules: megatron-core's exact operation order, simulated.

Three schedules, each reproducing the order in which megatron-core 0.19 runs forward (F)
and backward (B) micro-batch passes on every pipeline rank:

- ``gpipe``: all forwards, then all backwards (micro-batches first-in first-out, like
  mcore's activation queues).  mcore does not ship it; it is here for comparison.
- ``1f1b`` (PipeDream-Flush): ``forward_backward_pipelining_without_interleaving``.
  Rank ``r`` runs ``w = min(p - r - 1, m)`` warm-up forwards, then ``m - w`` steady
  (F, B) pairs, then ``w`` cool-down backwards.
- ``interleaved``: ``forward_backward_pipelining_with_interleaving`` with ``v`` model
  chunks per rank.  The (micro-batch, chunk) order comes from mcore's
  ``get_schedule_table`` (groups of ``g = microbatch_group_size_per_vp_stage``
  micro-batches, default ``g = p``, each run through chunk 0, then chunk 1, ...);
  backwards walk the same table with chunks reversed (``get_model_chunk_id``).  Warm-up
  is ``2 (p - r - 1) + (v - 1) g`` forwards (capped at ``m v``).  mcore refuses
  ``g`` outside ``[p, m]`` and a last group of ``0 < m mod g < p`` micro-batches, so with
  the default ``g = p`` the number of micro-batches must be a multiple of ``p``.

The simulator is event driven: each rank runs its ops strictly in that order, one at a
time; an op starts when the rank is free and its input exists (F of micro-batch i at
virtual stage ``c p + r`` needs F of i at the previous virtual stage, B needs B of the
next virtual stage and its own F), plus an optional send/recv latency across ranks.  It
does not model mcore's blocking send/recv pairing beyond that latency.

Bubble fraction is defined as idle time / compute time (``(step - busy) / busy``), the
definition under which the textbook closed forms are exact for uniform stage times:
``(p - 1) / m`` for GPipe and 1F1B, ``(p - 1) / (v m)`` for interleaved 1F1B.  It is a ratio, not a
share: a rank that idles longer than it computes has one above 1.  The share of the step a rank
idles, ``(step - busy) / step`` (always in [0, 1)), is :meth:`Timeline.idle_share`.

Durations are given per pipeline *stage* (all layers a rank holds): a chunk of an
interleaved schedule takes ``1 / v`` of its stage's time, so schedules of one model are
comparable.  Per-virtual-stage lists (length ``p v``) are taken literally as chunk times.

Pure Python: no torch, no megatron-core, no matplotlib (plots live in
``workbench.plots.schedule``).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from workbench.config import ConfigError, RunConfig, derive
from workbench.run.reader import RunReader, as_reader

__all__ = [
    "SCHEDULES",
    "ScheduleError",
    "Op",
    "Timeline",
    "resolve_schedule",
    "check_schedule",
    "schedule_table",
    "warmup_microbatches",
    "operation_order",
    "simulate",
    "inflight_microbatches",
    "inflight_chunks",
    "closed_form_bubble_fraction",
    "MeasuredStep",
    "load_measured",
    "measured_report",
    "measured_durations",
    "align_clocks",
    "evidence_runs",
    "text_chart",
]

Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


class ScheduleError(ValueError):
    """A (schedule, p, m, v) that megatron-core would refuse, or malformed durations/events."""


# --------------------------------------------------------------------------- order


def resolve_schedule(schedule: str | None, v: int = 1) -> str:
    """``None``/``"auto"`` -> interleaved when ``v > 1`` else 1f1b; names are case-insensitive."""
    if schedule in (None, "", "auto"):
        return "interleaved" if v > 1 else "1f1b"
    s = str(schedule).lower().replace("-", "").replace("_", "")
    aliases = {"gpipe": "gpipe", "1f1b": "1f1b", "pipedream": "1f1b", "pipedreamflush": "1f1b",
               "interleaved": "interleaved", "interleaved1f1b": "interleaved", "vpp": "interleaved"}
    if s not in aliases:
        raise ScheduleError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")
    return aliases[s]


def check_schedule(schedule: str, p: int, m: int, v: int = 1, microbatch_group_size: int | None = None) -> None:
    """Raise :class:`ScheduleError` naming the rule and the fix when mcore would refuse the layout."""
    schedule = resolve_schedule(schedule, v)
    for name, val in (("p (pipeline_parallel)", p), ("m (micro-batches)", m), ("v (virtual_pipeline_parallel)", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {val!r}")
    if schedule != "interleaved":
        if v != 1:
            raise ScheduleError(f"schedule {schedule!r} runs one model chunk per rank (v=1), got v={v}: "
                                "use --schedule interleaved or v=1")
        return
    if p < 2:
        raise ScheduleError("interleaved 1F1B needs p >= 2 (mcore runs p=1 without pipelining): raise p or use 1f1b")
    g = p if microbatch_group_size is None else microbatch_group_size
    if g > m or g < p:
        raise ScheduleError(f"interleaved 1F1B needs microbatch_group_size_per_vp_stage in [p={p}, m={m}], got {g}: "
                            f"use at least {max(p, g)} micro-batches" + ("" if g >= p else f" or a group size >= {p}"))
    rest = m % g
    if 0 < rest < p:
        raise ScheduleError(f"interleaved 1F1B: m={m} leaves a last group of {rest} micro-batches (m mod {g}), "
                            f"fewer than p={p}; mcore refuses this: use m a multiple of {g}"
                            + (" (with the default group size, a multiple of p)" if microbatch_group_size is None else ""))


def schedule_table(m: int, v: int, g: int) -> list[tuple[int, int]]:
    """mcore's ``get_schedule_table``: (micro-batch, chunk) per virtual micro-batch id."""
    table: list[tuple[int, int]] = []
    for lo in range(0, m, g):
        hi = m if lo + g >= m else lo + g
        table.extend((mb, c) for c in range(v) for mb in range(lo, hi))
    return table


def warmup_microbatches(schedule: str, p: int, m: int, v: int = 1, rank: int = 0,
                        microbatch_group_size: int | None = None) -> int:
    """Forward passes (chunk passes for interleaved) a rank runs before its first backward."""
    schedule = resolve_schedule(schedule, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank - 1, m)
    g = p if microbatch_group_size is None else microbatch_group_size
    return min(2 * (p - rank - 1) + (v - 1) * g, m * v)


def operation_order(schedule: str, p: int, m: int, v: int = 1, rank: int = 0,
                    microbatch_group_size: int | None = None) -> list[tuple[str, int, int]]:
    """The (kind, micro-batch, chunk) sequence rank ``rank`` executes, in mcore's order."""
    schedule = resolve_schedule(schedule, v)
    check_schedule(schedule, p, m, v, microbatch_group_size)
    if not 0 <= rank < p:
        raise ScheduleError(f"rank must be in [0, {p}), got {rank}")
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        w = warmup_microbatches("1f1b", p, m, 1, rank)
        ops = [("F", i, 0) for i in range(w)]
        for i in range(m - w):
            ops += [("F", w + i, 0), ("B", i, 0)]
        ops += [("B", i, 0) for i in range(m - w, m)]
        return ops
    g = p if microbatch_group_size is None else microbatch_group_size
    table = schedule_table(m, v, g)
    total = m * v
    w = warmup_microbatches("interleaved", p, m, v, rank, g)

    def fwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("F", mb, c)

    def bwd(k: int) -> tuple[str, int, int]:
        mb, c = table[k]
        return ("B", mb, v - 1 - c)

    ops = [fwd(k) for k in range(w)]
    for k in range(total - w):
        ops += [fwd(k + w), bwd(k)]
    ops += [bwd(k) for k in range(total - w, total)]
    return ops


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Op:
    """One forward or backward pass of one micro-batch through one model chunk on one rank."""

    rank: int
    kind: str  # "F" | "B"
    microbatch: int
    chunk: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "microbatch": self.microbatch, "chunk": self.chunk,
                "start": self.start, "end": self.end}


def _inflight_peak(ops: Iterable[tuple[str, int, int]]) -> int:
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@dataclass
class Timeline:
    """A simulated (or measured) step: per-rank ordered ops with start/end times, and its metrics."""

    schedule: str
    p: int
    m: int
    v: int
    ops: list[list[Op]]  # ops[rank] in execution order
    forward: list[float] = field(default_factory=list)  # per virtual stage (c * p + r), one chunk
    backward: list[float] = field(default_factory=list)
    latency: float = 0.0
    microbatch_group_size: int | None = None
    unit: str = "units"  # "units" for simulated abstract time, "ms" for measured

    # -- metrics
    @property
    def step_time(self) -> float:
        """From 0 (step start) to the last op's end on any rank."""
        return max((ops[-1].end for ops in self.ops if ops), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(o.duration for o in self.ops[rank])

    def bubble(self, rank: int) -> float:
        """Idle time of ``rank`` within the step (including waiting for the slowest rank to finish)."""
        return self.step_time - self.busy(rank)

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle / compute, per rank, or over all ranks (sum idle / sum compute) when ``rank`` is None."""
        if rank is not None:
            b = self.busy(rank)
            return self.bubble(rank) / b if b > 0 else 0.0
        busy = sum(self.busy(r) for r in range(self.p))
        return (self.p * self.step_time - busy) / busy if busy > 0 else 0.0

    def idle_share(self, rank: int | None = None) -> float:
        """Idle / step time, per rank, or over all ranks (sum idle / (p x step)) when ``rank`` is None: the share
        of the step the rank(s) did not compute, in [0, 1) (:meth:`bubble_fraction` is idle / compute instead)."""
        step = self.step_time
        if step <= 0:
            return 0.0
        if rank is not None:
            return self.bubble(rank) / step
        return sum(self.bubble(r) for r in range(self.p)) / (self.p * step)

    def peak_inflight(self, rank: int) -> int:
        """Most (micro-batch, chunk) activations held at once (forwards not yet backwarded)."""
        return _inflight_peak((o.kind, o.microbatch, o.chunk) for o in self.ops[rank])

    def idle_gaps(self, rank: int) -> list[tuple[float, float]]:
        """(start, end) of each idle interval of ``rank`` within [0, step_time]."""
        gaps, t = [], 0.0
        for o in self.ops[rank]:
            if o.start > t + 1e-12:
                gaps.append((t, o.start))
            t = max(t, o.end)
        if self.step_time > t + 1e-12:
            gaps.append((t, self.step_time))
        return gaps

    def metrics(self) -> dict[str, Any]:
        per_rank = [{
            "rank": r,
            "busy": self.busy(r),
            "bubble": self.bubble(r),
            "bubble_fraction": self.bubble_fraction(r),
            "peak_inflight_chunks": self.peak_inflight(r),
            "peak_inflight_microbatches": self.peak_inflight(r) / self.v,
            "warmup": warmup_microbatches(self.schedule, self.p, self.m, self.v, r, self.microbatch_group_size),
            "forwards_before_first_backward": _warmup_of(self.ops[r]),
        } for r in range(self.p)]
        out = {
            "step_time": self.step_time,
            "bubble_fraction": self.bubble_fraction(),
            "bubble_time": self.p * self.step_time - sum(x["busy"] for x in per_rank),
            "per_rank": per_rank,
        }
        if self.schedule in SCHEDULES:
            out["closed_form_bubble_fraction"] = closed_form_bubble_fraction(self.schedule, self.p, self.m, self.v)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule, "p": self.p, "m": self.m, "v": self.v,
            "microbatch_group_size": self.microbatch_group_size,
            "latency": self.latency, "unit": self.unit,
            "forward": list(self.forward), "backward": list(self.backward),
            "metrics": self.metrics(),
            "ranks": [{"rank": r, "ops": [o.to_dict() for o in self.ops[r]]} for r in range(self.p)],
        }

    def __repr__(self) -> str:
        return (f"Timeline({self.schedule}, p={self.p}, m={self.m}, v={self.v}, step={self.step_time:.4g} {self.unit}, "
                f"bubble={self.bubble_fraction():.3f})")


def _warmup_of(ops: Sequence[Op]) -> int:
    n = 0
    for o in ops:
        if o.kind == "B":
            break
        n += 1
    return n


def _per_virtual_stage(value: float | Sequence[float], p: int, v: int, name: str) -> list[float]:
    """Normalise a duration spec to one chunk time per virtual stage (index c * p + r)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        vals = [float(value) / v] * (p * v)
    else:
        seq = [float(x) for x in value]
        if len(seq) == p:
            vals = [seq[vs % p] / v for vs in range(p * v)]
        elif len(seq) == p * v:
            vals = list(seq)
        else:
            raise ScheduleError(f"{name}: expected one number, {p} per-stage values or {p * v} per-virtual-stage "
                                f"values, got {len(seq)}")
    if any(x < 0 for x in vals) or any(x != x for x in vals):
        raise ScheduleError(f"{name}: durations must be non-negative numbers")
    return vals


def simulate(schedule: str | None, p: int, m: int, v: int = 1, *,
             forward: float | Sequence[float] = 1.0, backward: float | Sequence[float] = 2.0,
             latency: float = 0.0, microbatch_group_size: int | None = None, unit: str = "units") -> Timeline:
    """Event-driven timeline of one training step.

    ``forward``/``backward``: one number (every stage), ``p`` per-stage numbers (time of the
    rank's whole stage; an interleaved chunk takes 1/v of it) or ``p*v`` per-virtual-stage
    chunk times.  The default backward = 2 x forward is the usual transformer ratio.
    ``latency``: added between an op and a dependent op on another rank (send/recv).
    """
    schedule = resolve_schedule(schedule, v)
    check_schedule(schedule, p, m, v, microbatch_group_size)
    if latency < 0:
        raise ScheduleError("latency must be >= 0")
    fw = _per_virtual_stage(forward, p, v, "forward")
    bw = _per_virtual_stage(backward, p, v, "backward")
    nvs = p * v
    orders = [operation_order(schedule, p, m, v, r, microbatch_group_size) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, virtual stage) -> end time
    pos = [0] * p
    free = [0.0] * p
    result: list[list[Op]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, mb, c = orders[r][pos[r]]
                vs = c * p + r
                deps: list[tuple[tuple[str, int, int], bool]] = []  # (key, crosses ranks)
                if kind == "F":
                    if vs > 0:
                        deps.append((("F", mb, vs - 1), True))
                else:
                    deps.append((("F", mb, vs), False))
                    if vs < nvs - 1:
                        deps.append((("B", mb, vs + 1), True))
                if any(k not in done for k, _ in deps):
                    break
                ready = max([free[r]] + [done[k] + (latency if cross and p > 1 else 0.0) for k, cross in deps])
                dur = fw[vs] if kind == "F" else bw[vs]
                op = Op(r, kind, mb, c, ready, ready + dur)
                result[r].append(op)
                done[(kind, mb, vs)] = op.end
                free[r] = op.end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for mcore's orders; guards custom ones
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise ScheduleError(f"schedule deadlocks: next ops {stuck} wait on each other")
    return Timeline(schedule, p, m, v, result, fw, bw, latency, microbatch_group_size, unit)


# --------------------------------------------------------------------------- closed forms (planner API)


def closed_form_bubble_fraction(schedule: str | None, p: int, m: int, v: int = 1) -> float:
    """Textbook bubble / compute for uniform stage times: (p-1)/m, or (p-1)/(v m) interleaved."""
    schedule = resolve_schedule(schedule, v)
    return (p - 1) / (m * (v if schedule == "interleaved" else 1))


def inflight_chunks(schedule: str | None, p: int, m: int, v: int = 1, rank: int = 0,
                    microbatch_group_size: int | None = None) -> int:
    """Peak number of (micro-batch, chunk) forward activations rank ``rank`` holds at once.

    O(1): warm-up forwards plus the one steady-state forward that precedes each backward.
    """
    schedule = resolve_schedule(schedule, v)
    check_schedule(schedule, p, m, v, microbatch_group_size)
    total = m * (v if schedule == "interleaved" else 1)
    w = warmup_microbatches(schedule, p, m, v, rank, microbatch_group_size)
    return total if w >= total else w + 1


def inflight_microbatches(schedule: str | None, p: int, m: int, v: int = 1, rank: int = 0,
                          microbatch_group_size: int | None = None) -> float:
    """Activation-memory factor: peak micro-batches of this rank's *whole stage* held at once.

    Multiply by one micro-batch's activation memory for all the rank's layers to get the
    pipeline's activation footprint.  1F1B: ``min(p - rank, m)``; GPipe: ``m``;
    interleaved: peak chunk activations / v (a chunk holds 1/v of the rank's layers), e.g.
    ``p + (p - 1) / v`` on rank 0 when m is large.  Cheap (no simulation); raises
    :class:`ScheduleError` for layouts mcore refuses.
    """
    schedule = resolve_schedule(schedule, v)
    n = inflight_chunks(schedule, p, m, v, rank, microbatch_group_size)
    return n / v if schedule == "interleaved" else float(n)


# --------------------------------------------------------------------------- measured runs


@dataclass
class MeasuredStep:
    """One step's measured per-micro-batch timings: a Timeline in ms, plus where it came from."""

    run_dir: str
    iteration: int
    timeline: Timeline  # unit "ms"; ops[pp_rank]
    global_ranks: list[int]  # global rank whose events represent each pipeline rank
    device: str | None = None
    repaired_ops: int = 0  # ops whose unknown (-1) micro-batch/chunk was taken from mcore's order
    dropped_ops: int = 0  # ops with ids that fit neither the layout nor mcore's order
    clock_shift_ms: list[float] = field(default_factory=list)  # added to each rank's times by align_clocks


def _repair_ids(raw: list[list[Op]], schedule: str, p: int, m: int, v: int) -> tuple[list[list[Op]], int, int]:
    """Fill unknown ids (the backend writes -1 when it cannot match a backward) from mcore's order.

    mcore's per-rank order is deterministic, so when a rank's measured kinds follow
    :func:`operation_order` position by position, position i *is* expected op i.  Ops whose
    ids still fall outside the layout are dropped (and counted) rather than mis-drawn.
    """
    out, repaired, dropped = [], 0, 0
    for r, ops in enumerate(raw):
        try:
            expected = operation_order(schedule, p, m, v, r)
        except ScheduleError:
            expected = []
        aligned = len(expected) == len(ops) and all(o.kind == e[0] for o, e in zip(ops, expected))
        fixed = []
        for i, o in enumerate(ops):
            ok = o.kind in ("F", "B") and 0 <= o.microbatch < m and 0 <= o.chunk < v
            if not ok and aligned:
                _, mb, c = expected[i]
                o = Op(r, o.kind, mb, c, o.start, o.end)
                repaired += 1
                ok = True
            if ok:
                fixed.append(o)
            else:
                dropped += 1
        out.append(fixed)
    return out, repaired, dropped


def _run_layout(reader: RunReader) -> tuple[int, int, int | None]:
    """(p, v, m) of a run: from config.json (m through :func:`workbench.config.derive`), else run_start, else events."""
    sources = []
    cfg_path = reader.run_dir / "config.json"
    if cfg_path.is_file():
        try:
            sources.append(json.loads(cfg_path.read_text()))
        except json.JSONDecodeError as e:
            raise ScheduleError(f"{cfg_path}: not valid JSON ({e}); it should be the run's RunConfig") from e
    sources += [ev.config for ev in reader.run_starts(refresh=False) if isinstance(ev.config, dict)]
    for raw in sources:
        try:
            cfg = RunConfig.from_dict(raw)
            return max(cfg.parallel.pipeline_parallel, 1), cfg.parallel.vpp, derive(cfg).num_microbatches
        except ConfigError:
            par = raw.get("parallel") or {}
            if isinstance(par, dict) and par.get("pipeline_parallel"):
                return int(par["pipeline_parallel"]), int(par.get("virtual_pipeline_parallel") or 1), None
    mbs = reader.records("microbatch", refresh=False)
    p = len({ev.rank for ev in mbs})
    v = 1 + max((int(op.get("chunk", 0) or 0) for ev in mbs for op in ev.get("ops") or []), default=0)
    return p, v, None


def _pp_rank_map(reader: RunReader, p: int) -> dict[int, int]:
    """global rank -> pipeline rank, one representative (tp=0, dp=0 preferred) per stage."""
    coords = reader.coords()
    ranks = sorted({int(ev.rank) for ev in reader.records("microbatch", refresh=False)})
    chosen: dict[int, tuple[tuple[int, int], int]] = {}
    for g in ranks:
        c = coords.get(g)
        if c is not None and "pp" in c:
            pp = int(c["pp"])
            key = (int(c.get("tp", 0) or 0), int(c.get("dp", 0) or 0))
        elif len(ranks) == p:
            pp, key = ranks.index(g), (0, 0)
        else:
            continue
        if pp not in chosen or key < chosen[pp][0]:
            chosen[pp] = (key, g)
    return {g: pp for pp, (_, g) in chosen.items()}


def align_clocks(ops: list[list[Op]], p: int) -> tuple[list[list[Op]], list[float]]:
    """Shift each rank's times (measured from its *own* step start) just enough to respect causality.

    For neighbours r-1 -> r, forwards need ``shift_r - shift_(r-1) >= end_(r-1)(F_i) - start_r(F_i)`` and
    backwards ``<= start_(r-1)(B_i) - end_r(B_i)``.  The raw difference (0) is clamped into that
    interval: nothing moves when the clocks already agree (the usual case on GPUs, where every
    rank leaves the previous step's collectives together).  If the interval is empty (timing
    noise), its midpoint is used.  Shifts are then re-based so the earliest is 0.
    """
    shifts = [0.0] * p
    for r in range(1, p):
        prev = {(o.kind, o.microbatch, o.chunk): o for o in ops[r - 1]}
        lo, hi = float("-inf"), float("inf")
        for o in ops[r]:
            q = prev.get((o.kind, o.microbatch, o.chunk))
            if q is None:
                continue
            if o.kind == "F":
                lo = max(lo, q.end - o.start)
            else:
                hi = min(hi, q.start - o.end)
        if lo <= hi:
            d = min(max(0.0, lo), hi)
        else:
            d = (lo + hi) / 2
        shifts[r] = shifts[r - 1] + (d if d == d and abs(d) != float("inf") else 0.0)
    base = min(shifts) if shifts else 0.0
    shifts = [x - base for x in shifts]
    out = [[Op(o.rank, o.kind, o.microbatch, o.chunk, o.start + shifts[r], o.end + shifts[r]) for o in ops[r]]
           for r in range(p)]
    return out, shifts


def load_measured(run_dir: str | Path | RunReader, iteration: int | None = None, align: bool = True) -> MeasuredStep:
    """Read one step's ``microbatch`` events (default: the latest step every pipeline rank recorded).

    ``run_dir``: a run directory, or the :class:`workbench.run.RunReader` of one (a ``Run``'s
    ``reader``), whose records already read are used as they are.
    ``align``: correct per-rank clock offsets with :func:`align_clocks` (times are relative to
    each rank's own step start, so cross-rank order can be off by the step-start skew).
    """
    reader = as_reader(run_dir)
    run_dir = reader.run_dir
    if not (run_dir / "events").is_dir():
        raise ScheduleError(f"{run_dir}: no events/ directory; pass a run directory written by the backend")
    reader.poll()
    p, v, m = _run_layout(reader)
    mb_events = reader.records("microbatch", refresh=False)
    if not mb_events:
        raise ScheduleError(f"{run_dir}: no 'microbatch' events; run with train.microbatch_timing_interval > 0")
    rank_map = _pp_rank_map(reader, p)
    by_iter: dict[int, dict[int, dict]] = {}
    for e in mb_events:
        g = int(e.rank)
        if g in rank_map:
            by_iter.setdefault(int(e.iteration), {})[rank_map[g]] = e
    complete = sorted(it for it, per in by_iter.items() if len(per) == p)
    if iteration is None:
        if not complete:
            raise ScheduleError(f"{run_dir}: no iteration has micro-batch timings from all {p} pipeline ranks "
                                f"(iterations seen: {sorted(by_iter)})")
        iteration = complete[-1]
    elif iteration not in by_iter or len(by_iter[iteration]) != p:
        raise ScheduleError(f"{run_dir}: iteration {iteration} lacks micro-batch timings from every pipeline rank; "
                            f"complete iterations: {complete}")
    raw_ops: list[list[Op]] = []
    for pp in range(p):
        raw = by_iter[iteration][pp].ops or []
        try:
            rank_ops = [Op(pp, str(o["kind"]), int(o["microbatch"]), int(o.get("chunk", 0) or 0),
                           float(o["start_ms"]), float(o["end_ms"])) for o in raw]
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"{run_dir}: malformed microbatch op on pipeline rank {pp} ({e}); "
                                "each op needs kind, microbatch, chunk, start_ms, end_ms") from e
        rank_ops.sort(key=lambda o: (o.start, o.end))
        raw_ops.append(rank_ops)
    if m is None:
        m = max((o.microbatch + 1 for ops_ in raw_ops for o in ops_), default=0)
    sched = "interleaved" if v > 1 else "1f1b"
    ops, repaired, dropped = _repair_ids(raw_ops, sched, p, m, v)
    ops, shifts = align_clocks(ops, p) if align else (ops, [0.0] * p)
    device = next((e.device for e in reader.run_starts(refresh=False) if e.device), None)
    tl = Timeline(sched, p, m, v, ops, unit="ms")
    inv = {pp: g for g, pp in rank_map.items()}
    return MeasuredStep(str(run_dir), iteration, tl, [inv[pp] for pp in range(p)], device, repaired, dropped, shifts)


def evidence_runs(root: str | Path) -> list[Path]:
    """Run directories with micro-batch timings anywhere under ``root`` (e.g. a repository's ``evidence/runs``).

    ``root`` is the folder of committed (GPU) runs, given by the caller: the library does not
    look for it.  Sorted by name; empty when there are none or ``root`` does not exist.
    """
    base = Path(root)
    found = []
    for events in sorted(base.glob("**/events")):
        if any('"microbatch"' in f.read_text(errors="replace") for f in events.glob("rank-*.jsonl")):
            found.append(events.parent)
    return found


def _mean_durations(tl: Timeline) -> tuple[list[float], list[float]]:
    """Mean measured F and B chunk time per virtual stage (c * p + r)."""
    fw, bw = [], []
    for kind, out in (("F", fw), ("B", bw)):
        for vs in range(tl.p * tl.v):
            c, r = divmod(vs, tl.p)
            d = [o.duration for o in tl.ops[r] if o.kind == kind and o.chunk == c]
            if not d:
                raise ScheduleError(f"no measured {kind} ops for pipeline rank {r} chunk {c}")
            out.append(statistics.fmean(d))
    return fw, bw


def measured_durations(run_dir: str | Path | MeasuredStep, iteration: int | None = None) -> dict[str, Any]:
    """Mean measured chunk times of a run, ready for ``simulate(..., **measured_durations(run))``.

    Returns ``{"forward": [...], "backward": [...], "unit": "ms"}`` with one value per virtual
    stage (index ``c * p + r``), so "what if m were 16?" can be asked with real stage times.
    Only valid for the run's own p and v.
    """
    ms = run_dir if isinstance(run_dir, MeasuredStep) else load_measured(run_dir, iteration)
    fw, bw = _mean_durations(ms.timeline)
    return {"forward": fw, "backward": bw, "unit": "ms"}


def measured_report(measured: MeasuredStep) -> tuple[Timeline, dict[str, Any]]:
    """Ideal timeline from the measured mean durations, and a report of where the time went.

    Per rank the measured step splits exactly into: compute (sum of op times);
    ``wait_upstream`` (idle until the op's producer on the neighbouring rank had finished:
    pipeline dependency, i.e. bubble); ``comm`` (idle after the producer finished: send/recv
    and host overhead); ``host`` (idle before ops with no cross-rank input, e.g. the first
    stage's forwards: data loading, launch); ``tail`` (idle after the rank's last op, waiting
    for the others).  Per-rank clocks are first made causal by :func:`align_clocks` (``clock_shift_ms``).
    Stragglers: ranks whose mean F+B chunk time exceeds the median rank's by > 10 %.
    """
    tl = measured.timeline
    p, v = tl.p, tl.v
    fw, bw = _mean_durations(tl)
    ideal = simulate(tl.schedule, p, tl.m, v, forward=fw, backward=bw, unit="ms")
    ranks = _rank_time_split(measured, ideal, fw, bw)
    per_rank_work = [x["mean_forward_ms"] + x["mean_backward_ms"] for x in ranks]
    med = statistics.median(per_rank_work)
    stragglers = [x["pipeline_rank"] for x, w in zip(ranks, per_rank_work) if med > 0 and w > 1.1 * med]
    tot = {k: sum(x["time_ms"][k] for x in ranks) for k in ranks[0]["time_ms"]}
    imbalance = max(per_rank_work) / min(per_rank_work) if min(per_rank_work) > 0 else None  # None: a stage measured no work
    closed = closed_form_bubble_fraction(tl.schedule, p, tl.m, v)
    summary = _report_summary(measured, ideal, closed, imbalance, tot, stragglers)
    report = {
        "run_dir": measured.run_dir,
        "iteration": measured.iteration,
        "device": measured.device,
        "schedule": tl.schedule, "p": p, "v": v, "m": tl.m,
        "measured_step_ms": tl.step_time,
        "ideal_step_ms": ideal.step_time,
        "measured_bubble_fraction": tl.bubble_fraction(),
        "ideal_bubble_fraction": ideal.bubble_fraction(),
        "closed_form_bubble_fraction": closed,
        "measured_idle_share": tl.idle_share(),
        "ideal_idle_share": ideal.idle_share(),
        "stage_imbalance": imbalance,
        "time_ms": tot,
        "ranks": ranks,
        "stragglers": stragglers,
        "repaired_ops": measured.repaired_ops,
        "clock_shift_ms": list(measured.clock_shift_ms),
        "dropped_ops": measured.dropped_ops,
        "summary": " ".join(summary),
    }
    return ideal, report


def _rank_time_split(measured: MeasuredStep, ideal: Timeline, fw: list[float], bw: list[float]) -> list[dict[str, Any]]:
    """Per pipeline rank: its measured step split into compute, wait_upstream, comm, host and tail (see
    :func:`measured_report`), beside its measured and ideal bubble and idle shares and mean chunk times."""
    tl = measured.timeline
    p, v = tl.p, tl.v
    end_of: dict[tuple[str, int, int], float] = {}
    for r in range(p):
        for o in tl.ops[r]:
            end_of[(o.kind, o.microbatch, o.chunk * p + r)] = o.end
    ranks = []
    for r in range(p):
        parts = {"compute": 0.0, "wait_upstream": 0.0, "comm": 0.0, "host": 0.0, "tail": 0.0}
        t = 0.0
        for o in tl.ops[r]:
            vs = o.chunk * p + r
            gap = max(o.start - t, 0.0)
            if o.kind == "F":
                producer = ("F", o.microbatch, vs - 1) if vs > 0 else None
            else:
                producer = ("B", o.microbatch, vs + 1) if vs < p * v - 1 else None
            if producer is None or producer not in end_of:
                parts["host"] += gap
            else:
                wait = min(max(end_of[producer] - t, 0.0), gap)
                parts["wait_upstream"] += wait
                parts["comm"] += gap - wait
            parts["compute"] += o.duration
            t = max(t, o.end)
        parts["tail"] = max(tl.step_time - t, 0.0)
        ranks.append({
            "pipeline_rank": r,
            "global_rank": measured.global_ranks[r],
            "measured_bubble_fraction": tl.bubble_fraction(r),
            "ideal_bubble_fraction": ideal.bubble_fraction(r),
            "measured_idle_share": tl.idle_share(r),
            "ideal_idle_share": ideal.idle_share(r),
            "mean_forward_ms": statistics.fmean([fw[c * p + r] for c in range(v)]),
            "mean_backward_ms": statistics.fmean([bw[c * p + r] for c in range(v)]),
            "time_ms": parts,
        })
    return ranks


def _report_summary(measured: MeasuredStep, ideal: Timeline, closed: float, imbalance: float | None,
                    tot: dict[str, float], stragglers: list[int]) -> list[str]:
    """The report's sentences: measured vs ideal step and idle share, the bubble three ways and why they differ,
    where the idle time went, repaired / dropped ops, stragglers."""
    tl = measured.timeline
    p, v = tl.p, tl.v
    idle = sum(v_ for k, v_ in tot.items() if k != "compute")
    summary = [
        f"{tl.schedule} p={p} v={v} m={tl.m}, iteration {measured.iteration}: measured step {tl.step_time:.2f} ms vs ideal "
        f"{ideal.step_time:.2f} ms; share of the step idle {tl.idle_share():.3f} measured vs {ideal.idle_share():.3f} "
        f"ideal.",
        f"Bubble as idle / compute (the closed form's measure): {tl.bubble_fraction():.3f} measured, "
        f"{ideal.bubble_fraction():.3f} ideal, {closed:.3f} closed form.",
        f"The closed form (p-1)/{'(v m)' if v > 1 else 'm'} assumes equal stages and free send/recv; the ideal runs "
        f"megatron-core's order with this run's mean forward / backward time per stage and no send/recv cost"
        + (", and a stage measured no work, so their balance is unknown." if imbalance is None
           else f", and its slowest stage takes {imbalance:.2f}x its fastest's time, so the faster stages wait."
           if imbalance > 1.05 else ", and its stages take about equal time."),
    ]
    if idle > 0:
        summary.append("Idle time: " + ", ".join(f"{k} {100 * tot[k] / idle:.0f}%" for k in ("wait_upstream", "comm", "host", "tail"))
                       + " (wait_upstream = pipeline dependency, comm = send/recv + overhead after the input was ready).")
    if measured.repaired_ops or measured.dropped_ops:
        summary.append(f"{measured.repaired_ops} ops had unknown ids filled from mcore's order; "
                       f"{measured.dropped_ops} ops dropped (ids outside p={p}, v={v}, m={tl.m}: check config.json).")
    if stragglers:
        summary.append("Stragglers (mean F+B > 1.1 x median rank): pipeline ranks " + ", ".join(map(str, stragglers)) + ".")
    return summary


def text_chart(tl: Timeline, width: int = 100) -> str:
    """The timeline as text: one row per rank, F as ``-``, B as ``=`` (what ``workbench schedule`` prints)."""
    step = tl.step_time or 1.0
    label = lambda o: f"{o.kind}{o.microbatch}" + (f"c{o.chunk}" if tl.v > 1 else "")  # noqa: E731
    # every op wide enough for its whole label and one fill character, so neighbours never run
    # together ("F0F1FF3..."): a wider chart rather than a garbled one
    need = max((len(label(o)) + 1 for ops in tl.ops for o in ops), default=2)
    shortest = min([o.end - o.start for ops in tl.ops for o in ops if o.end > o.start] or [1.0])
    scale = max(min(width / step, 8.0 / shortest), need / shortest)
    lines = []
    for r in range(tl.p):
        row = [" "] * (int(round(step * scale)) + 1)
        for o in tl.ops[r]:
            a, b = int(round(o.start * scale)), max(int(round(o.end * scale)), int(round(o.start * scale)) + 1)
            fill = "-" if o.kind == "F" else "="
            cell = (label(o) + fill * (b - a))[: b - a]
            row[a:b] = list(cell)
        lines.append(f"rank {r}: |" + "".join(row).rstrip() + "|")
    return "\n".join(lines)
