"""Gantt charts of pipeline schedules: simulated, side by side, and measured over ideal.

Blocks are coloured by micro-batch (forward lighter, backward darker), model chunks of an
interleaved schedule get a distinct edge style and lightness, idle time is hatched, and
each title carries the bubble fraction (idle / compute, see :mod:`workbench.schedules`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from workbench.run.reader import RunReader
from workbench.schedules import MeasuredStep, Timeline, load_measured, measured_report

__all__ = ["gantt", "compare", "overlay", "measured_overlay"]

_CHUNK_STYLES = ["-", "--", ":", "-."]


def _figure(figsize):
    """A Figure outside pyplot's global state: no plt.close needed, never auto-shown twice in notebooks."""
    from matplotlib.figure import Figure

    _register_ipython_png(Figure)
    return Figure(figsize=figsize)


def _register_ipython_png(figure_type) -> None:
    """Let IPython render pyplot-free Figures (the inline backend only registers this once pyplot is used)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    fmt = ip.display_formatter.formatters["image/png"]
    try:
        fmt.lookup_by_type(figure_type)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        fmt.for_type(figure_type, lambda fig: print_figure(fig, "png", bbox_inches="tight"))


def _colour(mb: int, m: int, kind: str, chunk: int, v: int):
    import matplotlib
    import matplotlib.colors as mcolors

    cmap = matplotlib.colormaps["tab10" if m <= 10 else "tab20"]
    n = 10 if m <= 10 else 20
    r, g, b, _ = cmap(mb % n)
    # forward: mix towards white; later chunks a little lighter still (chunk shading)
    light = (0.45 if kind == "F" else 0.0) + (0.25 * chunk / max(v - 1, 1) if v > 1 else 0.0)
    light = min(light, 0.8)
    return mcolors.to_hex((r + (1 - r) * light, g + (1 - g) * light, b + (1 - b) * light))


def _draw_rows(ax, tl: Timeline, y0: float, height: float, label_prefix: str, labels: bool, alpha: float = 1.0):
    """Draw every rank of ``tl`` as one row starting at y0 (rank r at y0 + r)."""
    step = tl.step_time or 1.0
    for r in range(tl.p):
        y = y0 + r
        for a, b in tl.idle_gaps(r):
            ax.broken_barh([(a, b - a)], (y - height / 2, height), facecolors="none", edgecolors="0.6",
                           hatch="///", linewidth=0.0, alpha=alpha)
        for o in tl.ops[r]:
            colour = _colour(o.microbatch, tl.m, o.kind, o.chunk, tl.v)
            ax.broken_barh([(o.start, o.duration)], (y - height / 2, height), facecolors=colour,
                           edgecolors="black", linewidth=0.6, linestyle=_CHUNK_STYLES[o.chunk % len(_CHUNK_STYLES)],
                           alpha=alpha)
            if labels and o.duration / step > 0.012 * max(len(str(o.microbatch)), 1):
                text = f"{o.kind}{o.microbatch}" + (f"\u2009c{o.chunk}" if tl.v > 1 and o.duration / step > 0.03 else "")
                ax.text(o.start + o.duration / 2, y, text, ha="center", va="center", fontsize=7,
                        color="white" if o.kind == "B" else "black", clip_on=True)
    return [f"{label_prefix}rank {r}" for r in range(tl.p)]


def _title(tl: Timeline, name: str | None = None) -> str:
    name = name or (f"{tl.schedule}" + (f" (v={tl.v})" if tl.v > 1 else ""))
    return f"{name}: p={tl.p}, m={tl.m}, step {tl.step_time:.3g} {tl.unit}, bubble {tl.bubble_fraction():.3f}"


def gantt(tl: Timeline, ax=None, title: str | None = None, labels: bool = True):
    """One Gantt chart: a row per pipeline rank (rank 0 on top). Returns the Figure."""
    from matplotlib.patches import Patch

    if ax is None:
        fig = _figure(figsize=(12, 0.6 * tl.p + 1.6))
        ax = fig.subplots()
    else:
        fig = ax.figure
    names = _draw_rows(ax, tl, 0, 0.8, "", labels)
    ax.set_yticks(range(tl.p), names)
    ax.set_ylim(tl.p - 0.5, -0.5)
    ax.set_xlim(0, (tl.step_time or 1.0) * 1.01)
    ax.set_xlabel(f"time ({tl.unit})")
    ax.set_title(title or _title(tl), fontsize=10, loc="left")
    handles = [Patch(facecolor=_colour(0, tl.m, "F", 0, tl.v), edgecolor="black", label="forward"),
               Patch(facecolor=_colour(0, tl.m, "B", 0, tl.v), edgecolor="black", label="backward"),
               Patch(facecolor="none", edgecolor="0.6", hatch="///", label="idle (bubble)")]
    ax.legend(handles=handles, loc="lower right", fontsize=7, ncol=3, framealpha=0.8,
              bbox_to_anchor=(1.0, 1.0), bbox_transform=ax.transAxes, borderaxespad=0.2)
    return fig


def compare(timelines: Sequence[Timeline], titles: Sequence[str] | None = None, share_x: bool = True):
    """Side-by-side (stacked) Gantt charts on a shared time axis, e.g. 1F1B vs interleaved."""
    heights = [0.6 * t.p + 1.0 for t in timelines]
    fig = _figure(figsize=(12, sum(heights) + 0.5))
    axes = fig.subplots(len(timelines), 1, sharex=share_x, gridspec_kw={"height_ratios": heights}, squeeze=False)
    for i, (tl, ax) in enumerate(zip(timelines, axes[:, 0])):
        gantt(tl, ax=ax, title=titles[i] if titles else None)
        if i < len(timelines) - 1:
            ax.set_xlabel("")
    if share_x:
        axes[0, 0].set_xlim(0, max(t.step_time for t in timelines) * 1.01)
    fig.tight_layout()
    return fig


def overlay(measured: Timeline, ideal: Timeline, report: dict[str, Any] | None = None, title: str | None = None):
    """For each rank, the ideal row (faded) directly above the measured row, same time axis."""
    p = measured.p
    fig = _figure(figsize=(13, 1.1 * p + 1.8))
    ax = fig.subplots()
    step = max(measured.step_time, ideal.step_time) or 1.0
    yt, yl = [], []
    for r in range(p):
        for tl, dy, name, alpha in ((ideal, 0.0, "ideal", 0.55), (measured, 0.45, "measured", 1.0)):
            one = Timeline(tl.schedule, 1, tl.m, tl.v, [tl.ops[r]], tl.forward, tl.backward, tl.latency, unit=tl.unit)
            # keep the full step length so trailing idle time is hatched
            gaps_end = tl.step_time
            _draw_rows(ax, one, 1.1 * r + dy, 0.38, "", labels=name == "measured", alpha=alpha)
            last = tl.ops[r][-1].end if tl.ops[r] else 0.0
            if gaps_end > last:
                ax.broken_barh([(last, gaps_end - last)], (1.1 * r + dy - 0.19, 0.38), facecolors="none",
                               edgecolors="0.6", hatch="///", linewidth=0.0, alpha=alpha)
            yt.append(1.1 * r + dy)
            yl.append(f"rank {r} {name}")
    ax.set_yticks(yt, yl, fontsize=8)
    ax.set_ylim(1.1 * (p - 1) + 0.75, -0.35)
    ax.set_xlim(0, step * 1.01)
    ax.set_xlabel(f"time since step start ({measured.unit})")
    if title is None:
        title = (f"{measured.schedule} p={p} v={measured.v} m={measured.m}: measured bubble "
                 f"{measured.bubble_fraction():.3f} (step {measured.step_time:.2f} {measured.unit}) vs ideal "
                 f"{ideal.bubble_fraction():.3f} (step {ideal.step_time:.2f} {ideal.unit})")
        if report and report.get("iteration") is not None:
            title += f", iteration {report['iteration']}"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def measured_overlay(run_dir: str | Path | RunReader | MeasuredStep, iteration: int | None = None):
    """(Figure, report) for a run directory's micro-batch events: measured vs ideal per rank.

    ``run_dir`` may be a run's :class:`workbench.run.RunReader` (``run.reader``): its records are reused.

    The ideal timeline is simulated with the measured mean F/B time of each (rank, chunk);
    the report (see :func:`workbench.schedules.measured_report`) gives measured vs ideal
    bubble and splits idle time into pipeline dependency, send/recv, host and tail.
    """
    measured = run_dir if isinstance(run_dir, MeasuredStep) else load_measured(run_dir, iteration)
    ideal, report = measured_report(measured)
    fig = overlay(measured.timeline, ideal, report)
    return fig, report
