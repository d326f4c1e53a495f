"""Gantt charts of pipeline schedules: simulated, side by side, and measured over ideal.

Blocks are coloured by micro-batch (forward lighter, backward darker), model chunks of an
interleaved schedule get a distinct edge style and lightness, idle time is hatched, and
each title carries the bubble fraction (idle / compute, see :mod:`workbench.schedules`).
Each block is labelled with its pass, micro-batch and (interleaved) chunk at 8.5-10 pt where
that fits the block (:func:`block_label`).  In a measured overlay, a block too narrow for its label
(an interleaved chunk's fast backward is a sliver of the step) is labelled in a lane under its row,
the label turned upright and joined to its block by a leader line where neighbours push it aside.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from workbench.run.reader import RunReader
from workbench.schedules import MeasuredStep, Timeline, load_measured, measured_report

__all__ = ["gantt", "compare", "overlay", "measured_overlay", "measured_table", "block_label", "LABEL_SIZES"]

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


#: block labels: the largest size that fits the block, never smaller than the smallest (points)
LABEL_SIZES = (10.0, 9.0, 8.5)
_CHAR_EM = 0.62  # average glyph width of the default sans-serif font, in ems
_LINE_EM = 1.25  # line height, in ems


def _axes_points(ax, xspan: float, yspan: float) -> tuple[float, float]:
    """Points per data unit along x and y of ``ax`` (its current position in its figure)."""
    pos = ax.get_position()
    w_in, h_in = ax.figure.get_size_inches()
    return pos.width * w_in * 72.0 / xspan, pos.height * h_in * 72.0 / yspan


def block_label(kind: str, microbatch: int, chunk: int, v: int, width_pt: float, height_pt: float) -> tuple[str, float] | None:
    """The label of one schedule block and its font size, or None when no label fits.

    A block says its pass and micro-batch (``F3``, ``B3``); with several model chunks per rank
    (interleaved) also its chunk (``F3 c1`` on one line, or ``F3`` over ``c1`` in a narrow block).
    Each size of :data:`LABEL_SIZES` is tried, largest first; a chunk is never left out of an
    interleaved block's label: if it fits nowhere, the block has no label."""
    head = f"{kind}{microbatch}"
    layouts = [head] if v <= 1 else [f"{head} c{chunk}", f"{head}\nc{chunk}"]
    for size in LABEL_SIZES:
        for text in layouts:
            lines = text.split("\n")
            wide = max(map(len, lines)) * _CHAR_EM * size
            tall = len(lines) * _LINE_EM * size
            if wide <= width_pt * 0.92 and tall <= height_pt * 0.95:
                return text, size
    return None


def _draw_rows(ax, tl: Timeline, y0: float, height: float, label_prefix: str, labels: bool, alpha: float = 1.0,
               blocks: list | None = None):
    """Draw every rank of ``tl`` as one row starting at y0 (rank r at y0 + r).

    With ``labels``, each block is appended to ``blocks`` for :func:`_label_blocks`, which labels
    them once the figure's layout is final (a label's size depends on the block's size in points)."""
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
            if labels and blocks is not None:
                blocks.append((o.start, o.duration, y, height, o.kind, o.microbatch, o.chunk, tl.v))
    return [f"{label_prefix}rank {r}" for r in range(tl.p)]


def _label_blocks(ax, blocks: list, lane: float = 0.0) -> None:
    """Label the blocks of ``ax`` (from :func:`_draw_rows`) at the size :func:`block_label` picks for each.

    ``lane``: the height (data units) of a free lane under each row (y grows downwards): a block whose label
    does not fit inside it is labelled there instead (:func:`_lane_labels`)."""
    x0, x1 = ax.get_xlim()
    y0, y1 = ax.get_ylim()
    px, py = _axes_points(ax, abs(x1 - x0), abs(y1 - y0))
    outside: dict[tuple[float, float], list] = {}
    for start, duration, y, height, kind, mb, chunk, v in blocks:
        label = block_label(kind, mb, chunk, v, duration * px, height * py)
        if label is not None:
            ax.text(start + duration / 2, y, label[0], ha="center", va="center", fontsize=label[1],
                    linespacing=1.0, color="white" if kind == "B" else "black", clip_on=True)
        elif lane > 0:
            outside.setdefault((y, height), []).append((start + duration / 2, f"{kind}{mb}" + (f" c{chunk}" if v > 1 else "")))
    for (y, height), items in outside.items():
        _lane_labels(ax, items, y + height / 2, lane, px, (min(x0, x1), max(x0, x1)))


def _lane_labels(ax, items: list[tuple[float, str]], top: float, lane: float, px: float, xlim: tuple[float, float]) -> None:
    """Upright labels ``(x centre, text)`` in the lane from ``top`` down ``lane`` data units: each at its block's
    centre where it can, else pushed aside just enough not to touch its neighbour (a leader line joins it to its block)."""
    size = LABEL_SIZES[-1]
    step = (_LINE_EM * size + 1.0) / px  # an upright label's width, plus a point of air, in data units
    items = sorted(items)
    xs: list[float] = []
    for centre, _ in items:  # left to right, each at least one label width after the previous
        xs.append(max(centre, xs[-1] + step) if xs else max(centre, xlim[0] + step / 2))
    for i in range(len(xs) - 1, -1, -1):  # then back from the right edge, where the first pass ran over it
        limit = xlim[1] - step / 2 if i == len(xs) - 1 else xs[i + 1] - step
        xs[i] = min(xs[i], limit)
    drop = lane * 0.12  # the leader's fall before its label starts
    for (centre, text), x in zip(items, xs):
        if abs(x - centre) > 1e-9:
            ax.plot([centre, x], [top, top + drop], color="0.45", linewidth=0.5, clip_on=True)
        ax.text(x, top + drop, text, rotation=90, ha="center", va="top", fontsize=size, color="black", clip_on=True)


def _title(tl: Timeline, name: str | None = None) -> str:
    name = name or (f"{tl.schedule}" + (f" (v={tl.v})" if tl.v > 1 else ""))
    return f"{name}: p={tl.p}, m={tl.m}, step {tl.step_time:.3g} {tl.unit}, bubble {tl.bubble_fraction():.3f} (idle / compute)"


def gantt(tl: Timeline, ax=None, title: str | None = None, labels: bool = True):
    """One Gantt chart: a row per pipeline rank (rank 0 on top). Returns the Figure."""
    own = ax is None
    if own:
        fig = _figure(figsize=(12, 0.6 * tl.p + 1.6))
        ax = fig.subplots()
    blocks = _gantt_axes(ax, tl, title, labels, (tl.step_time or 1.0) * 1.01)
    if own:
        ax.figure.tight_layout()
    _label_blocks(ax, blocks)
    return ax.figure


def _gantt_axes(ax, tl: Timeline, title: str | None, labels: bool, xspan: float) -> list:
    """Draw ``tl`` into ``ax`` over a time axis of length ``xspan``; returns the blocks to label."""
    from matplotlib.patches import Patch

    blocks: list = []
    names = _draw_rows(ax, tl, 0, 0.8, "", labels, blocks=blocks)
    ax.set_yticks(range(tl.p), names)
    ax.set_ylim(tl.p - 0.5, -0.5)
    ax.set_xlim(0, xspan)
    ax.set_xlabel(f"time ({tl.unit})")
    ax.set_title(title or _title(tl), fontsize=10, loc="left")
    handles = [Patch(facecolor=_colour(0, tl.m, "F", 0, tl.v), edgecolor="black", label="forward"),
               Patch(facecolor=_colour(0, tl.m, "B", 0, tl.v), edgecolor="black", label="backward"),
               Patch(facecolor="none", edgecolor="0.6", hatch="///", label="idle (bubble)")]
    ax.legend(handles=handles, loc="lower right", fontsize=8, ncol=3, framealpha=0.8,
              bbox_to_anchor=(1.0, 1.0), bbox_transform=ax.transAxes, borderaxespad=0.2)
    return blocks


def compare(timelines: Sequence[Timeline], titles: Sequence[str] | None = None, share_x: bool = True):
    """Side-by-side (stacked) Gantt charts on a shared time axis, e.g. 1F1B vs interleaved."""
    heights = [0.6 * t.p + 1.0 for t in timelines]
    fig = _figure(figsize=(12, sum(heights) + 0.5))
    axes = fig.subplots(len(timelines), 1, sharex=share_x, gridspec_kw={"height_ratios": heights}, squeeze=False)
    longest = max(t.step_time for t in timelines) * 1.01
    blocks = []
    for i, (tl, ax) in enumerate(zip(timelines, axes[:, 0])):
        blocks.append(_gantt_axes(ax, tl, titles[i] if titles else None, True,
                                  longest if share_x else (tl.step_time or 1.0) * 1.01))
        if i < len(timelines) - 1:
            ax.set_xlabel("")
    fig.tight_layout()
    for ax, bl in zip(axes[:, 0], blocks):
        _label_blocks(ax, bl)
    return fig


def overlay(measured: Timeline, ideal: Timeline, report: dict[str, Any] | None = None, title: str | None = None):
    """For each rank, the ideal row (faded) directly above the measured row, same time axis."""
    p = measured.p
    gap = 1.65  # per rank: the ideal row, the measured row, and a lane under it for labels of narrow blocks
    fig = _figure(figsize=(12, gap * p + 1.9))  # 12 in at 100 dpi: shown near full size in a notebook
    ax = fig.subplots()
    step = max(measured.step_time, ideal.step_time) or 1.0
    yt, yl, blocks = [], [], []
    for r in range(p):
        for tl, dy, name, alpha in ((ideal, 0.0, "ideal", 0.55), (measured, 0.45, "measured", 1.0)):
            one = Timeline(tl.schedule, 1, tl.m, tl.v, [tl.ops[r]], tl.forward, tl.backward, tl.latency, unit=tl.unit)
            # keep the full step length so trailing idle time is hatched
            gaps_end = tl.step_time
            _draw_rows(ax, one, gap * r + dy, 0.38, "", labels=name == "measured", alpha=alpha, blocks=blocks)
            last = tl.ops[r][-1].end if tl.ops[r] else 0.0
            if gaps_end > last:
                ax.broken_barh([(last, gaps_end - last)], (gap * r + dy - 0.19, 0.38), facecolors="none",
                               edgecolors="0.6", hatch="///", linewidth=0.0, alpha=alpha)
            yt.append(gap * r + dy)
            yl.append(f"rank {r} {name}")
    ax.set_yticks(yt, yl, fontsize=8)
    ax.set_ylim(gap * (p - 1) + gap - 0.2, -0.35)
    ax.set_xlim(0, step * 1.01)
    ax.set_xlabel(f"time since step start ({measured.unit})")
    if title is None:
        title = (f"{measured.schedule} p={p} v={measured.v} m={measured.m}: idle share of the step "
                 f"{measured.idle_share():.3f} measured (step {measured.step_time:.2f} {measured.unit}) vs "
                 f"{ideal.idle_share():.3f} ideal (step {ideal.step_time:.2f} {ideal.unit})"
                 + (f", iteration {report['iteration']}" if report and report.get("iteration") is not None else "")
                 + f"\nbubble as idle / compute: {measured.bubble_fraction():.3f} measured vs "
                 f"{ideal.bubble_fraction():.3f} ideal")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    _label_blocks(ax, blocks, lane=gap - 0.45 - 0.38 - 0.05)
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


def measured_table(report: dict[str, Any]):
    """The per-rank rows of a :func:`measured_overlay` report as a DataFrame: pipeline and global rank, the share of
    the step each rank idled, measured and ideal (in [0, 1)), and where the measured step's time went (ms)."""
    import pandas as pd

    return pd.DataFrame([{"pipeline rank": r["pipeline_rank"], "global rank": r["global_rank"],
                          "idle share of step, measured": round(r["measured_idle_share"], 3),
                          "idle share of step, ideal": round(r["ideal_idle_share"], 3),
                          **{f"{k} (ms)": round(x, 2) for k, x in r["time_ms"].items()}} for r in report["ranks"]])
