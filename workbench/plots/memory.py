"""Memory-plan charts: per-rank stacked bars by component, the GPU's capacity, fits / OOM.

``plan_bars(plan)`` draws one bar per rank (or per pipeline stage when there are many ranks:
TP/DP ranks of a stage hold the same bytes), stacked by component in the order of
:data:`workbench.planner.COMPONENTS`, then the not-allocated overheads hatched on top.  A
dashed line marks the GPU's capacity; bars over it are labelled OOM.  Measured peaks (from
a run's events) can be overlaid as black markers next to the predicted allocated peak.
"""

from __future__ import annotations

from typing import Any

from workbench.layout import Layout
from workbench.planner import COMPONENTS, GiB

__all__ = ["plan_bars", "plan_rank_layout", "COLORS"]

COLORS = {
    "weights": "#4c72b0",
    "gradients": "#55a868",
    "master_weights": "#8172b2",
    "optimizer_moments": "#b07aa1",
    "activations": "#dd8452",
    "logits_loss": "#c44e52",
    "pipeline_buffers": "#937860",
    "workspace": "#8c8c8c",
    "overheads": "#dddddd",
}


def _figure(figsize):
    from matplotlib.figure import Figure

    try:  # let IPython render a pyplot-free Figure
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            fmt = ip.display_formatter.formatters["image/png"]
            try:
                fmt.lookup_by_type(Figure)
            except KeyError:
                fmt.for_type(Figure, lambda fig: _png(fig))
    except ImportError:
        pass
    return Figure(figsize=figsize)


def _png(fig) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=90)
    return buf.getvalue()


def plan_rank_layout(plan: Any):
    """The :class:`workbench.layout.Layout` of a plan's ranks (its sizes, CP included): the coordinates its per-rank
    labels name (``d0 c1 t0 p0``: one source, :meth:`workbench.layout.Layout.rank_label`)."""
    lay = plan.layout
    return Layout(world=len(plan.ranks), tp=int(lay.get("tp", 1)), pp=int(lay.get("pp", 1)), cp=int(lay.get("cp", 1) or 1))


def plan_bars(plan: Any, measured: dict[int, int] | None = None, max_bars: int = 32, ax: Any = None):
    """Stacked bars of a :class:`workbench.planner.Plan`; returns the matplotlib Figure."""
    per_rank = len(plan.ranks) <= max_bars
    if per_rank:
        where = plan_rank_layout(plan)
        bars = [(f"r{r.rank}\n({where.rank_label(r.rank, short=True)})", plan.stages[r.pp_rank], r.rank) for r in plan.ranks]
    else:
        bars = [(f"stage {st.pp_rank}", st, None) for st in plan.stages]
    if ax is None:
        fig = _figure((max(6.0, 0.55 * len(bars) + 3), 4.2))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    x = list(range(len(bars)))
    bottom = [0.0] * len(bars)
    for comp in COMPONENTS:
        vals = [st.components[comp] / GiB for _, st, _ in bars]
        if any(vals):
            ax.bar(x, vals, bottom=bottom, color=COLORS[comp], label=comp.replace("_", " "), width=0.7)
            bottom = [b + v for b, v in zip(bottom, vals)]
    over = [sum(st.overheads.values()) / GiB for _, st, _ in bars]
    ax.bar(x, over, bottom=bottom, color=COLORS["overheads"], hatch="//", edgecolor="#999999",
           label="reserved over allocated + context + NCCL", width=0.7)
    tops = [b + o for b, o in zip(bottom, over)]
    if plan.gpu is not None:
        cap = plan.gpu.capacity_bytes / GiB
        ax.axhline(cap, color="black", linestyle="--", linewidth=1.2, label=f"{plan.gpu.name} ({cap:.0f} GiB)")
        for xi, (_, st, _), top in zip(x, bars, tops):
            ok = st.total <= plan.gpu.capacity_bytes
            ax.text(xi, top, "fits" if ok else "OOM", ha="center", va="bottom", fontsize=8,
                    color="#2a7a2a" if ok else "#b00000", fontweight="bold")
    if measured:
        xs, ys = [], []
        for xi, (_, st, rank) in zip(x, bars):
            if rank is not None and rank in measured:
                xs.append(xi)
                ys.append(measured[rank] / GiB)
            elif rank is None:
                vals = [measured[r.rank] for r in plan.ranks if r.pp_rank == st.pp_rank and r.rank in measured]
                if vals:
                    xs.append(xi)
                    ys.append(max(vals) / GiB)
        if xs:
            ax.scatter(xs, ys, marker="D", color="black", zorder=5, label="measured peak allocated")
    ax.set_xticks(x)
    ax.set_xticklabels([lbl for lbl, _, _ in bars], fontsize=7 if per_rank else 9)
    ax.set_ylabel("GiB")
    lay = plan.layout
    ax.set_title(f"{plan.config_name}: tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}, micro-batch "
                 f"{lay['micro_batch_size']} - predicted peak memory per {'rank' if per_rank else 'stage'}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(tops + [plan.gpu.capacity_bytes / GiB if plan.gpu else 0]) * 1.12)
    fig.tight_layout()
    _spread_ticks(fig, ax)
    return fig


def _tick_overlap(fig, ax, gap_px: float) -> float:
    """Pixels the widest-colliding neighbouring x tick labels lack to keep ``gap_px`` apart (<= 0: none)."""
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    return max((a.x1 + gap_px - b.x0 for a, b in zip(boxes, boxes[1:])), default=0.0)


def _spread_ticks(fig, ax, gap_px: float = 8.0) -> None:
    """Widen the figure until no two rank labels touch (8 ranks with a legend beside the axes did)."""
    if not hasattr(fig.canvas, "get_renderer"):
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    n = len(ax.get_xticks())
    for _ in range(4):
        lack = _tick_overlap(fig, ax, gap_px)
        if lack <= 0:
            return
        fig.set_figwidth(fig.get_figwidth() + 1.3 * lack * n / fig.dpi)
        fig.tight_layout()
