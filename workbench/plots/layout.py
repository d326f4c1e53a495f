"""The layout picture: where every rank of a config's world sits, and which tokens of a sequence each holds.

Top: the world as megatron-core numbers it (:class:`workbench.layout.Layout`, order ``tp-cp-ep-dp-pp``): one row per
pipeline stage, each rank a box with its global number and coordinates (``d0 c1 t0 p0``), coloured by its
context-parallel rank (by its data-parallel replica where CP = 1), the ranks of one data-parallel replica framed
together.  Bottom, under context parallelism: one sequence of ``model.seq_length`` tokens cut into ``2 x CP`` equal
chunks, each coloured by the CP rank that holds it (rank ``r`` holds chunks ``r`` and ``2CP-1-r``: the causal load
balancing of :func:`workbench.backend.context_parallel.load_balanced_chunks`, the one source of that split).  Without
CP every rank of a replica sees the whole sequence, and the panel says so.

A pyplot-free ``Figure`` (safe from any thread), drawn from the config alone: nothing runs.
"""

from __future__ import annotations

from typing import Any

from workbench.backend.context_parallel import load_balanced_chunks
from workbench.layout import Layout

__all__ = ["layout_figure", "sequence_owners"]

#: colours by CP rank (or DP replica where CP = 1); cycled past eight
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
#: ranks drawn one box each up to this world size; a larger world is drawn per pipeline stage of one replica
MAX_BOXES = 64


def sequence_owners(seq_length: int, cp: int) -> list[tuple[int, int, int]]:
    """``(start, stop, cp_rank)`` of each of the ``2 * cp`` chunks of one sequence, in token order (one chunk of the
    whole sequence at cp = 1).  Raises ValueError where ``2 * cp`` does not divide ``seq_length``."""
    if cp <= 1:
        return [(0, seq_length, 0)]
    owners = [(a, b, r) for r, pair in enumerate(load_balanced_chunks(seq_length, cp)) for a, b in pair]
    return sorted(owners)


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def layout_figure(cfg: Any, figsize: tuple[float, float] | None = None):
    """The layout picture of ``cfg`` (a :class:`workbench.config.RunConfig`; see the module docstring)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    lay = Layout.of(cfg)
    if not lay.divisible:
        raise ValueError(f"world size {lay.world} does not split into tp*cp*pp = {lay.model_parallel} blocks: "
                         f"{'; '.join(p.rule for p in lay.problems())}")
    per_stage = lay.world // lay.pp
    shown = per_stage if lay.world <= MAX_BOXES else lay.tp * lay.cp  # one replica's stage when the world is large
    width = max(8.0, 0.95 * shown + 1.5)
    fig = Figure(figsize=figsize or (min(width, 16.0), 2.6 + 0.9 * lay.pp))
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [max(lay.pp, 1) + 0.6, 1.1]})

    # the rank grid: a row per stage, the ranks of the stage in megatron's order (tp fastest, then cp, then dp); pp is
    # the outermost dimension of that order, so stage pp holds the contiguous ranks pp*per_stage .. (pp+1)*per_stage-1
    for pp in range(lay.pp):
        ranks = range(pp * per_stage, pp * per_stage + shown)
        y = lay.pp - 1 - pp
        for i, r in enumerate(ranks):
            c = lay.coords(r)
            top.add_patch(Rectangle((i + 0.06, y + 0.1), 0.88, 0.8, facecolor=_colour(c.cp if lay.cp > 1 else c.dp),
                                    edgecolor="white", alpha=0.9))
            top.text(i + 0.5, y + 0.62, f"r{r}", ha="center", va="center", fontsize=9, color="white", fontweight="bold")
            top.text(i + 0.5, y + 0.32, lay.rank_label(r, short=True), ha="center", va="center", fontsize=7, color="white")
        replica = lay.tp * lay.cp  # the ranks of one data-parallel replica of this stage sit side by side
        for start in range(0, len(ranks), replica):
            top.add_patch(Rectangle((start + 0.02, y + 0.04), min(replica, len(ranks) - start) - 0.04, 0.92, fill=False,
                                    edgecolor="0.25", linewidth=1.2))
        top.text(-0.15, y + 0.5, f"stage {pp}", ha="right", va="center", fontsize=9)
    top.set_xlim(-1.3, shown + 0.1)
    top.set_ylim(-0.05, lay.pp + 0.05)
    top.set_axis_off()
    sizes = f"TP {lay.tp} x CP {lay.cp} x DP {lay.dp} x PP {lay.pp}" + (f" (VPP {lay.vpp})" if lay.model_chunks > 1 else "")
    more = "" if shown == per_stage else f"; one replica of each stage shown ({per_stage} ranks a stage)"
    top.set_title(f"{lay.world} ranks: {sizes}{more}\ncolour: {'CP rank' if lay.cp > 1 else 'DP replica'}; "
                  "frame: one data-parallel replica of a stage", fontsize=9)

    # one sequence and the CP rank holding each chunk
    seq = cfg.model.seq_length
    for a, b, r in sequence_owners(seq, lay.cp):
        bottom.add_patch(Rectangle((a, 0.15), b - a, 0.7, facecolor=_colour(r), edgecolor="white", alpha=0.9))
        bottom.text((a + b) / 2, 0.5, f"cp{r}" if lay.cp > 1 else "every rank of a replica", ha="center", va="center",
                    fontsize=8, color="white", fontweight="bold")
    bottom.set_xlim(0, seq)
    bottom.set_ylim(0, 1)
    bottom.set_yticks([])
    bottom.set_xlabel("token position in one sequence")
    if lay.cp > 1:
        c = seq // (2 * lay.cp)
        bottom.set_title(f"context parallel {lay.cp}: {2 * lay.cp} chunks of {c} tokens; CP rank r holds chunks r and "
                         f"{2 * lay.cp - 1}-r\n(an early chunk with a late one: the same causal attention work on every rank)",
                         fontsize=9)
    else:
        bottom.set_title("no context parallelism: each rank runs every token of its sequences", fontsize=10)
    fig.tight_layout()
    return fig
