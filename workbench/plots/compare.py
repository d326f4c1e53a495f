"""Runs side by side: one metric of any number of runs overlaid on one figure (matplotlib, no widgets).

What a run can be compared on is whatever its event stream carries (:mod:`workbench.run.events`), discovered from
the records rather than listed per family (:func:`run_metrics`):

- every numeric field of its ``step`` records under the field's own name: ``loss``, ``lr``, ``grad_norm``,
  ``step_time``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``, ``mem_allocated`` / ``mem_reserved`` / ``mem_peak``,
  and the family's other reported train metrics (BERT: ``sop loss``; fine-tuning: ``accuracy``);
- every numeric field of its ``eval`` records prefixed ``eval``: ``eval loss``, ``eval ppl`` and the family's eval
  metrics (``eval accuracy`` of a fine-tuning run, ``eval mlm accuracy``, ``eval sop loss``).

A field a record leaves empty (``mfu`` on CPU, memory without CUDA) is not a metric of that run.  One value per step:
the last record of each (step, rank) (a resumed run's repeated steps: the newest), then over the ranks the slowest
rank's step time and throughput (tokens/s, TFLOP/s, MFU: each rank divides by its own step time), the max of LR and
grad norm, the worst rank's memory, the mean for the rest (the loss of the ranks that hold it).  Plotted as stored except MFU (percent) and memory (GiB).

:func:`compare_runs` draws the overlay: x is the step, the tokens consumed (samples consumed x ``model.seq_length``;
``step x global batch x seq_length`` where a step record lacks it) or the wall time since the run started;
TensorBoard's smoothing (a debiased exponential moving average, :func:`ema`, weight in [0, 1)) with the raw curve
faint behind it; optionally a log y axis; the legend names each run; each run's last value is marked and written
next to its end.  A run that does not record the metric is said on the figure and in :attr:`Comparison.lacking`.
:meth:`Comparison.values_at` gives each run's value at a step as a table;
:func:`workbench.plots.compare_plotly.plotly_figure` draws the same overlay as a plotly figure with hover values (the
PNG stays for saved copies).

Runs are read with :class:`workbench.run.RunReader` (a run directory, a reader, or a
:class:`workbench.launch.Run`, whose reader is reused); :func:`find_runs` / :func:`runs_frame` list the runs under
a folder for the run browser (:mod:`workbench.widgets.runs`), each with its last loss and its tokens/s as
``Run.final_metrics`` reports it (:func:`workbench.launch.frames.throughput`).  Torch-free.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from workbench.families import FAMILIES
from workbench.launch import Run, frames
from workbench.run.events import Event, events_dir
from workbench.run.nodes import LAUNCH_FILE
from workbench.run.reader import CONFIG_FILE, RunReader, as_reader

__all__ = ["X_AXES", "EVAL_PREFIX", "DEFAULT_SMOOTHING", "Curve", "Comparison", "ema", "reader_of", "run_name",
           "run_metrics", "available_metrics", "metric_label", "metric_curve", "compare_runs", "find_runs",
           "run_summary", "runs_frame"]

#: what the x axis can be
X_AXES = ("step", "tokens", "wall time")
#: the prefix of an eval record's metric (``eval loss``, ``eval accuracy``)
EVAL_PREFIX = "eval "
#: TensorBoard's default smoothing weight
DEFAULT_SMOOTHING = 0.6

GIB = float(1 << 30)
#: fields of a step / eval record that are not metrics (the record's identity, the x axes' sources, flags)
_NOT_METRICS = {"event", "time", "rank", "iteration", "skipped", "consumed_samples", "extra"}
#: metric -> (axis label, factor applied to the stored value)
_SHOWN = {
    "loss": ("train loss", 1.0), "lr": ("learning rate", 1.0), "grad_norm": ("grad norm", 1.0),
    "step_time": ("step time (s)", 1.0), "tokens_per_s": ("tokens/s", 1.0), "tflops_per_gpu": ("TFLOP/s per GPU", 1.0),
    "mfu": ("MFU (%)", 100.0), "mem_allocated": ("memory allocated (GiB)", 1.0 / GIB),
    "mem_reserved": ("memory reserved (GiB)", 1.0 / GIB), "mem_peak": ("peak memory (GiB)", 1.0 / GIB),
    "eval ppl": ("eval perplexity", 1.0),
}
#: per step, over the ranks: the slowest rank's step time, the job-wide LR and grad norm and the worst rank's memory
#: take the max; throughput (each rank divides the step's tokens by its own step time) the min: the slowest rank's,
#: so tokens/s, TFLOP/s and MFU describe the same step time as ``step_time``
_MAX_OVER_RANKS = {"step_time", "lr", "grad_norm", "mem_allocated", "mem_reserved", "mem_peak"}
_MIN_OVER_RANKS = {"tokens_per_s", "tflops_per_gpu", "mfu"}
#: the order metrics are offered in (others follow: train metrics, then eval metrics, by name)
_ORDER = ("loss", "eval loss", "accuracy", "eval accuracy", "eval ppl", "tokens_per_s", "mfu", "tflops_per_gpu",
          "step_time", "lr", "grad_norm", "mem_allocated", "mem_reserved", "mem_peak")
#: a series with at most this many points is drawn with a marker on each (eval metrics, short runs)
_MARKERS_UP_TO = 30
#: reader -> (records read, its metrics): :func:`run_metrics` walks a run's records again only when new ones came
_METRICS: "weakref.WeakKeyDictionary[RunReader, tuple[int, dict[str, int]]]" = weakref.WeakKeyDictionary()


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average (``weight`` in [0, 1): 0 leaves the values as
    they are).  ``s_k = sum_i w^(k-i) y_i / sum_i w^(k-i)`` over the finite values so far; a value that is not finite
    is kept as it is and left out of the average."""
    w = float(weight)
    if not 0.0 <= w < 1.0:
        raise ValueError(f"smoothing weight {weight!r} is not in [0, 1)")
    out, last, n = [], 0.0, 0
    for y in values:
        y = float(y)
        if not math.isfinite(y):
            out.append(y)
            continue
        last = last * w + (1.0 - w) * y
        n += 1
        out.append(last / (1.0 - w ** n) if w > 0 else last)
    return out


def reader_of(source: Any) -> RunReader:
    """The reader of ``source``: a :class:`workbench.launch.Run`'s own, a reader itself, else one for a run directory."""
    reader = getattr(source, "reader", None)
    return reader if isinstance(reader, RunReader) else as_reader(source)


def run_name(source: Any) -> str:
    """A run's name in legends and tables: its directory's name."""
    return reader_of(source).run_dir.name


def _metric_fields(rec: Event) -> Iterable[tuple[str, float]]:
    for k, v in rec.to_dict().items():
        if k not in _NOT_METRICS and _number(v):
            yield k, float(v)


def _order(name: str) -> tuple:
    if name in _ORDER:
        return (0, _ORDER.index(name), name)
    return (1, name.startswith(EVAL_PREFIX), name)


def run_metrics(source: Any) -> dict[str, int]:
    """The metrics ``source``'s events carry (see the module docstring), each with how many steps record it, in the
    order the browser offers them."""
    reader = reader_of(source)
    reader.poll()
    cached = _METRICS.get(reader)
    if cached is not None and cached[0] == reader.count:  # nothing new since: the records are not walked again
        return dict(cached[1])
    steps: dict[str, set] = {}
    for kind, prefix in (("step", ""), ("eval", EVAL_PREFIX)):
        for rec in reader.records(kind, refresh=False):
            for k, _v in _metric_fields(rec):
                if not prefix and k.startswith(EVAL_PREFIX):
                    continue  # would read as an eval record's field
                steps.setdefault(prefix + k, set()).add(rec.get("iteration"))
    out = {k: len(steps[k]) for k in sorted(steps, key=_order)}
    _METRICS[reader] = (reader.count, out)
    return dict(out)


def available_metrics(sources: Iterable[Any]) -> list[str]:
    """Every metric any of ``sources`` records (the union), in the order the browser offers them."""
    names: set[str] = set()
    for s in sources:
        names |= set(run_metrics(s))
    return sorted(names, key=_order)


def metric_label(metric: str) -> str:
    """The axis label of ``metric`` (with its unit where one is known)."""
    return _SHOWN.get(metric, (metric.replace("_", " "), 1.0))[0]


def _scale(metric: str) -> float:
    return _SHOWN.get(metric, (metric, 1.0))[1]


def _source(metric: str) -> tuple[str, str]:
    """(record kind, field) that ``metric`` is read from."""
    if metric.startswith(EVAL_PREFIX):
        return "eval", metric[len(EVAL_PREFIX):]
    return "step", metric


def _per_step(records: Iterable[Event], key: str, how: str) -> list[tuple[int, float, float]]:
    """(step, value, time) per step: the last record of each (step, rank), then max, min or mean over the ranks."""
    latest: dict[tuple[int, Any], tuple[float, float]] = {}
    for rec in records:  # time-ordered: a later record of the same step and rank (a resumed run) replaces the earlier
        it, v = rec.get("iteration"), rec.get(key)
        if it is None or not _number(v):
            continue
        latest[(int(it), rec.rank)] = (float(v), float(rec.time or 0.0))
    by_step: dict[int, list[tuple[float, float]]] = {}
    for (it, _rank), vt in latest.items():
        by_step.setdefault(it, []).append(vt)
    out = []
    for it in sorted(by_step):
        vals = [v for v, _t in by_step[it]]
        value = max(vals) if how == "max" else min(vals) if how == "min" else sum(vals) / len(vals)
        out.append((it, value, max(t for _v, t in by_step[it])))
    return out


@dataclass
class Curve:
    """One run's series of one metric: ``steps`` (the iteration of each point), ``x`` (on the chosen axis), ``y``
    (as plotted: MFU in percent, memory in GiB) and ``smoothed`` (:func:`ema` of ``y``)."""

    run: str
    run_dir: Path
    metric: str
    x_axis: str
    steps: list[int]
    x: list[float]
    y: list[float]
    smoothed: list[float]

    @property
    def last(self) -> tuple[int, float] | None:
        """(step, value) of the last point."""
        return (self.steps[-1], self.y[-1]) if self.steps else None

    def index_at(self, step: int) -> int | None:
        """The index of the last point at or before ``step`` (the value as of that step); None before the first."""
        best = None
        for i, s in enumerate(self.steps):
            if s <= step:
                best = i
            else:
                break
        return best


def _tokens(reader: RunReader, steps: Sequence[int]) -> list[float]:
    """Tokens consumed after each of ``steps``: a step record's consumed samples x ``model.seq_length``, else
    ``step x global batch x seq_length`` from the run's config; NaN where neither is known."""
    cfg = reader.config_dict() or {}
    seq = (cfg.get("model") or {}).get("seq_length")
    gbs = (cfg.get("train") or {}).get("global_batch_size")
    samples: dict[int, float] = {}
    for rec in reader.records("step", refresh=False):
        it, n = rec.get("iteration"), rec.get("consumed_samples")
        if it is not None and _number(n):
            samples[int(it)] = max(samples.get(int(it), 0.0), float(n))
    out = []
    for s in steps:
        if seq and s in samples:
            out.append(samples[s] * float(seq))
        elif seq and gbs:
            out.append(float(s) * float(gbs) * float(seq))
        else:
            out.append(float("nan"))
    return out


def _start_time(reader: RunReader) -> float:
    starts = [r.time for r in reader.records("run_start", refresh=False) if r.time is not None]
    if starts:
        return min(starts)
    times = [r.time for r in reader.records(refresh=False) if r.time is not None]
    return min(times) if times else 0.0


def metric_curve(source: Any, metric: str, *, x: str = "step", smoothing: float = 0.0,
                 name: str | None = None) -> Curve | None:
    """``source``'s series of ``metric`` on x axis ``x`` (one of :data:`X_AXES`); None when its events do not
    record the metric."""
    if x not in X_AXES:
        raise ValueError(f"unknown x axis {x!r}; one of {X_AXES}")
    reader = reader_of(source)
    reader.poll()
    kind, key = _source(metric)
    how = "mean" if kind != "step" else "max" if key in _MAX_OVER_RANKS else "min" if key in _MIN_OVER_RANKS else "mean"
    points = _per_step(reader.records(kind, refresh=False), key, how)
    if not points:
        return None
    steps = [p[0] for p in points]
    scale = _scale(metric)
    y = [p[1] * scale for p in points]
    if x == "step":
        xs = [float(s) for s in steps]
    elif x == "tokens":
        xs = _tokens(reader, steps)
    else:
        t0 = _start_time(reader)
        xs = [p[2] - t0 for p in points]
    return Curve(name or reader.run_dir.name, reader.run_dir, metric, x, steps, xs, y, ema(y, smoothing))


def _x_label(x: str) -> str:
    return {"step": "step", "tokens": "tokens", "wall time": "wall time since the run started (s)"}[x]


@dataclass
class Comparison:
    """What :func:`compare_runs` drew: the figure, each run's :class:`Curve` (runs that record the metric, in the
    order given) and the runs that do not (:attr:`lacking`, by name)."""

    figure: Any
    metric: str
    x_axis: str
    smoothing: float
    log_y: bool
    curves: list[Curve] = field(default_factory=list)
    lacking: list[str] = field(default_factory=list)
    at_step: int | None = None  # the step :meth:`mark_step` marked last

    def steps(self) -> list[int]:
        """Every step any run records the metric at, in order."""
        return sorted({s for c in self.curves for s in c.steps})

    def values_at(self, step: int | None = None):
        """Each run's value as of ``step`` (its last point at or before it; default: each run's last point), as a
        pandas DataFrame: run, step (the point's), the x value when x is not the step, value, smoothed, note.  A run
        without the metric, or without a point by then, has a row saying so."""
        import pandas as pd

        rows = []
        for c in self.curves:
            i = len(c.steps) - 1 if step is None else c.index_at(int(step))
            row: dict[str, Any] = {"run": c.run}
            if i is None:
                row.update(step=None, value=float("nan"), smoothed=float("nan"), note=f"first recorded at step {c.steps[0]}")
            else:
                row.update(step=c.steps[i], value=c.y[i], smoothed=c.smoothed[i], note="")
                if self.x_axis != "step":
                    row[self.x_axis] = c.x[i]
            rows.append(row)
        for name in self.lacking:
            rows.append({"run": name, "step": None, "value": float("nan"), "smoothed": float("nan"),
                         "note": f"does not record {self.metric}"})
        cols = ["run", "step"] + ([self.x_axis] if self.x_axis != "step" else []) + ["value", "smoothed", "note"]
        df = pd.DataFrame(rows, columns=cols)
        df["step"] = df["step"].astype("Int64")
        return df

    def mark_step(self, step: int) -> None:
        """A dashed vertical line at ``step`` (on a ``step`` x axis; on the others, at each run's x of that step)."""
        self.at_step = int(step)
        if not self.curves:
            return
        ax = self.figure.axes[0]
        for line in [ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith("at step")]:
            line.remove()
        if self.x_axis == "step":
            ax.axvline(float(step), color="0.4", ls="--", lw=0.8, gid="at step")
            return
        for i, c in enumerate(self.curves):
            k = c.index_at(int(step))
            if k is not None and math.isfinite(c.x[k]):
                ax.axvline(c.x[k], color=f"C{i % 10}", ls="--", lw=0.8, alpha=0.7, gid=f"at step:{c.run}")

    def png(self, dpi: int = 90) -> bytes:
        from workbench.plots.training import figure_png

        return figure_png(self.figure, dpi=dpi)


def compare_runs(runs: Iterable[Any], metric: str = "loss", *, x: str = "step", smoothing: float = DEFAULT_SMOOTHING,
                 log_y: bool = False, labels: Mapping[str, str] | Sequence[str] | None = None, at_step: int | None = None,
                 figsize: tuple[float, float] = (9.0, 4.8), title: str | None = None) -> Comparison:
    """Overlay ``metric`` of ``runs`` (run directories, readers or :class:`workbench.launch.Run` s) on one figure.

    ``x``: ``step``, ``tokens`` or ``wall time`` (:data:`X_AXES`); ``smoothing``: the EMA weight in [0, 1) (the raw
    curve stays faint behind the smoothed one; 0: the raw curve alone); ``log_y``: a log y axis; ``labels``: legend
    names instead of the directory names (by directory name, or one per run in order); ``at_step``: a dashed
    vertical line at that step (:meth:`Comparison.mark_step`), the step :meth:`Comparison.values_at` reads.
    """
    from matplotlib.figure import Figure

    runs = list(runs)
    if not 0.0 <= float(smoothing) < 1.0:
        raise ValueError(f"smoothing {smoothing!r} is not in [0, 1)")
    if labels is not None and not isinstance(labels, Mapping) and len(list(labels)) != len(runs):
        raise ValueError(f"labels: {len(list(labels))} given for {len(runs)} runs (give one a run, or a mapping "
                         f"from run name to label)")
    fig = Figure(figsize=figsize)
    ax = fig.subplots()
    comp = Comparison(fig, metric, x, float(smoothing), bool(log_y))
    for k, src in enumerate(runs):
        reader = reader_of(src)
        name = reader.run_dir.name
        if isinstance(labels, Mapping):
            name = labels.get(name, name)
        elif labels is not None:
            name = list(labels)[k]
        curve = metric_curve(reader, metric, x=x, smoothing=smoothing, name=name)
        if curve is None:
            comp.lacking.append(name)
        else:
            comp.curves.append(curve)
    for i, c in enumerate(comp.curves):
        colour = f"C{i % 10}"
        marker = "o" if len(c.x) <= _MARKERS_UP_TO else None
        if smoothing > 0:
            ax.plot(c.x, c.y, color=colour, alpha=0.25, lw=1.0, marker=marker, ms=2.5, label=f"_raw {c.run}", gid=f"raw:{c.run}")
            ax.plot(c.x, c.smoothed, color=colour, lw=1.6, label=c.run, gid=f"smoothed:{c.run}")
        else:
            ax.plot(c.x, c.y, color=colour, lw=1.4, marker=marker, ms=3, label=c.run, gid=f"raw:{c.run}")
        ax.plot([c.x[-1]], [c.y[-1]], "o", color=colour, ms=6, mec="white", mew=0.8, label=f"_last {c.run}",
                gid=f"last:{c.run}")
        ax.annotate(f"{c.y[-1]:.4g}", (c.x[-1], c.y[-1]), xytext=(-2, 5), textcoords="offset points", ha="right",
                    va="bottom", fontsize=8, color=colour, gid=f"last value:{c.run}",
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    notes = []
    if comp.lacking:
        notes.append(f"not recorded by: {', '.join(comp.lacking)}")
    if not comp.curves:
        ax.text(0.5, 0.5, f"no run records {metric}" if runs else "no run selected", ha="center", va="center",
                transform=ax.transAxes, color="0.5", fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        if log_y:
            if any(v > 0 for c in comp.curves for v in c.y):
                ax.set_yscale("log")
            else:
                notes.append("log scale: no positive values")
        ax.set_xlabel(_x_label(x))
        ax.set_ylabel(metric_label(metric))
        ax.grid(alpha=0.3, which="both" if log_y else "major")
        ax.legend(fontsize=8, loc="best")
    if notes:
        ax.text(0.01, 0.01, "; ".join(notes), ha="left", va="bottom", transform=ax.transAxes, color="0.35", fontsize=8,
                gid="notes")
    smooth = f", smoothing {smoothing:g}" if smoothing > 0 else ""
    ax.set_title(title or f"{metric_label(metric)} by {x}{smooth}", fontsize=10)
    fig.tight_layout()
    if at_step is not None:
        comp.mark_step(at_step)
    return comp


# ---- the runs under a folder (the run browser's list)

def _is_run_dir(d: Path) -> bool:
    return events_dir(d).is_dir() or ((d / CONFIG_FILE).is_file() and (d / LAUNCH_FILE).is_file())


def find_runs(root: str | Path, max_depth: int = 4) -> list[Path]:
    """The run directories under ``root`` (``root`` itself included): folders with an ``events/`` folder, or with
    ``config.json`` and ``launch.json`` (launched, no event yet), down to ``max_depth`` levels; a run's own folders
    are not searched.  Newest first (by when each run started)."""
    root = Path(root)
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        if _is_run_dir(d):
            found.append(d)
            return
        if depth >= max_depth:
            return
        try:
            subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for p in subs:
            walk(p, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return sorted(found, key=_started, reverse=True)


def _started(run_dir: Path) -> float:
    """About when a run started, from its files (no event read): the earliest modification time of its
    ``config.json``, ``launch.json`` and rank 0's event file, else of its folder."""
    times = []
    for f in (run_dir / CONFIG_FILE, run_dir / LAUNCH_FILE, events_dir(run_dir) / "rank-0.jsonl", run_dir):
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            pass
    return min(times, default=0.0)


def _status(source: Any) -> str:
    """The run's status as :attr:`workbench.launch.Run.status` judges it (events, exit status, processes)."""
    status = getattr(source, "status", None)
    if isinstance(status, str):
        return status
    try:
        return Run.attach(reader_of(source).run_dir).status
    except Exception:
        return "unknown"


def _tokens_per_s(reader: RunReader) -> float:
    """The run's tokens/s as :meth:`workbench.launch.Run.final_metrics` (and so a sweep's ``metrics.json``) reports
    it, by the same function (:func:`workbench.launch.frames.throughput`): the tokens of iterations 2..N (a step's
    tokens: its tokens/s x its step time) over the wall time between the first and the last step's end (the slowest
    rank's record), never above what the slowest rank's step times allow; the first iteration (warm-up, compilation)
    is left out.  NaN where no step records both tokens/s and a step time."""
    records = reader.records("step", refresh=False)
    if not records:
        return float("nan")
    value = frames.throughput(frames.steps(records)).get("tokens_per_s")
    return float(value) if value is not None and math.isfinite(value) else float("nan")


def run_summary(source: Any) -> dict[str, Any]:
    """One row of the run browser's table: run, family, layout, steps (done / planned), last loss, tokens/s, status,
    started.  ``last loss``: the loss of the last step recorded (:func:`metric_curve`); ``tokens/s``: the run's
    throughput over all its steps but the first, as ``Run.final_metrics`` reports it (:func:`_tokens_per_s`); NaN
    (an empty cell) where the run records none."""
    reader = reader_of(source)
    reader.poll()
    cfg = reader.config_dict() or {}
    model, train = cfg.get("model") or {}, cfg.get("train") or {}
    arch = str(model.get("arch") or "-")
    family = FAMILIES[arch].label(model) if arch in FAMILIES else arch  # a family this version lacks: its name
    lay = reader.layout()
    layout = "-" if lay is None else (f"tp{lay.tp} pp{lay.pp} dp{lay.dp}" + (f" vpp{lay.vpp}" if lay.vpp > 1 else "")
                                      + (f" cp{lay.cp}" if lay.cp > 1 else ""))
    loss = metric_curve(reader, "loss")
    done = loss.steps[-1] if loss else max((int(r.get("iteration")) for r in reader.records("step", refresh=False)
                                            if r.get("iteration") is not None), default=0)
    total = train.get("train_iters")
    start = reader.run_start()
    t0 = start.time if start is not None and start.time else _started(reader.run_dir)
    return {"run": reader.run_dir.name, "family": family, "layout": layout,
            "steps": f"{done}/{total}" if total else str(done), "last loss": loss.y[-1] if loss else float("nan"),
            "tokens/s": _tokens_per_s(reader), "status": _status(source),
            "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(t0)), "run_dir": str(reader.run_dir)}


def runs_frame(runs: Iterable[Any]):
    """:func:`run_summary` of each run as a pandas DataFrame (one row per run, in the order given)."""
    import pandas as pd

    cols = ["run", "family", "layout", "steps", "last loss", "tokens/s", "status", "started", "run_dir"]
    return pd.DataFrame([run_summary(r) for r in runs], columns=cols)
