"""The router dashboard of an MoE run: what its top-k routers did while it trained.

Drawn from the run's ``router`` records (:meth:`workbench.run.reader.RunReader.router`, the events the backend
writes every ``model.moe.router_stats_interval`` steps): a heatmap of the share of each expert's tokens per
sampled step for one MoE layer (1/E everywhere is perfect balance), the load-balancing and z-loss curves (the
mean over MoE layers, and the chosen layer's), the coefficient of variation of the experts' token counts per
layer over the steps, and the dropped assignments where experts have a capacity.  A pyplot-free ``Figure``
(safe from the dashboard's thread; rendered to PNG by :func:`workbench.plots.training.figure_png`).

:func:`collapse_flags` names the experts that a router has starved or flooded for :data:`WINDOW` sampled steps in a
row (the figure's title and the dashboard show them):

- **starved**: under :data:`STARVED` (10%) of the balanced share 1/E.  Such an expert learns from almost no tokens,
  so its router logit keeps falling and it stays unused: the dead-expert collapse that the load-balancing loss exists
  to prevent (Shazeer et al. 2017; Fedus et al. 2021, section 2.2).
- **flooded**: at least :data:`FLOODED` (2x) the balanced share.  In a dropless layer the busiest expert sets the
  layer's time: under expert parallelism its rank does twice the average work, so the layer runs at half its
  balanced speed or less; with a capacity, tokens beyond ~1.25x (Switch's capacity factor) are dropped.

One sampled step over a bound is noise (a batch of one topic); :data:`WINDOW` in a row is a trend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from workbench.run.events import Router
from workbench.run.reader import RunReader, as_reader

__all__ = ["router_records", "router_figure", "load_table", "collapse_flags", "flags_text", "STARVED", "FLOODED", "WINDOW"]

#: an expert under this fraction of the balanced share 1/E is starved (see the module docstring)
STARVED = 0.1
#: an expert at or over this multiple of the balanced share is flooded
FLOODED = 2.0
#: sampled steps in a row over a bound before an expert is flagged
WINDOW = 3


def router_records(source: "str | Path | RunReader | Sequence[Router]") -> list[Router]:
    """The ``router`` records of a run directory, reader or list, in step order."""
    if isinstance(source, (list, tuple)):
        return sorted(source, key=lambda r: r.iteration or 0)
    return as_reader(source).router()


def load_table(source: Any) -> list[dict[str, Any]]:
    """Per sampled step and MoE layer: iteration, layer, the coefficient of variation of the experts' tokens, the
    busiest expert's share over the balanced share (max / mean), dropped assignments, and the router losses."""
    rows = []
    for r in router_records(source):
        for j, layer in enumerate(r.layers):
            counts = r.tokens_per_expert[j]
            mean = sum(counts) / len(counts) if counts else 0.0
            rows.append({"iteration": r.iteration, "layer": layer, "cv": r.coefficient_of_variation()[j],
                         "max_over_mean": (max(counts) / mean) if mean else 0.0, "dropped": r.dropped[j] if r.dropped else 0,
                         "load_balancing_loss": r.load_balancing_loss[j] if r.load_balancing_loss else None,
                         "z_loss": r.z_loss[j] if r.z_loss else None})
    return rows


def collapse_flags(source: Any, starved: float = STARVED, flooded: float = FLOODED, window: int = WINDOW) -> list[dict[str, Any]]:
    """The experts starved or flooded in each of the last ``window`` sampled steps (see the module docstring): per
    expert the MoE layer, the expert, ``kind`` ("starved" / "flooded"), its share over the balanced share in the
    newest record, and the first iteration of the run of records it has been over the bound since.  [] when
    fewer than ``window`` records exist."""
    recs = router_records(source)
    if len(recs) < window or window < 1:
        return []
    flags = []
    newest = recs[-1]
    for layer in newest.layers:
        n_exp = len(newest.layer(layer))
        open_runs = {(e, kind) for e in range(n_exp) for kind in ("starved", "flooded")}
        began: dict[tuple[int, str], int] = {}  # (expert, kind) -> index of the oldest record of its unbroken run
        shown = None
        for i in range(len(recs) - 1, -1, -1):  # newest first; stops once every run has broken (a poll stays cheap)
            r, ratios = recs[i], None
            if layer in r.layers and len(r.layer(layer)) == n_exp and sum(r.layer(layer)):
                row = r.layer(layer)
                ratios = [x * n_exp / sum(row) for x in row]
            shown = ratios if shown is None and i == len(recs) - 1 else shown
            for e, kind in list(open_runs):
                if ratios is not None and (ratios[e] < starved if kind == "starved" else ratios[e] >= flooded):
                    began[(e, kind)] = i
                else:
                    open_runs.discard((e, kind))
            if not open_runs:
                break
        for (e, kind), i in sorted(began.items()):
            if len(recs) - i >= window:
                flags.append({"layer": layer, "expert": e, "kind": kind, "share_over_balanced": shown[e],
                              "since": recs[i].iteration})
    return flags


def flags_text(flags: list[dict[str, Any]], limit: int = 6) -> str:
    """One line naming the flagged experts ("" for none)."""
    if not flags:
        return ""
    words = [f"layer {f['layer']} expert {f['expert']} {f['kind']} ({f['share_over_balanced']:.2f}x its share since step {f['since']})"
             for f in flags[:limit]]
    more = f" and {len(flags) - limit} more" if len(flags) > limit else ""
    return "router collapse: " + "; ".join(words) + more


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def router_figure(source: Any, layer: int | None = None, figsize: tuple[float, float] = (11.0, 6.5)):
    """A 2x2 figure of ``source``'s router records (see the module docstring); ``layer``: the MoE layer (0-based model
    index) of the heatmap and its loss curves, default the first MoE layer."""
    from matplotlib.figure import Figure

    recs = router_records(source)
    fig = Figure(figsize=figsize)
    (ax_heat, ax_loss), (ax_cv, ax_drop) = fig.subplots(2, 2)
    if not recs:
        for ax in (ax_heat, ax_loss, ax_cv, ax_drop):
            _empty(ax, "no router records yet")
        return fig
    layers = recs[-1].layers
    layer = layers[0] if layer is None else layer
    if layer not in layers:
        raise ValueError(f"layer {layer} is not an MoE layer of this run (MoE layers: {layers})")
    its = [r.iteration for r in recs]

    # heatmap: share of the layer's tokens per expert, per sampled step
    shares = []
    for r in recs:
        row = r.layer(layer)
        total = sum(row) or 1
        shares.append([x / total for x in row])
    n_exp = len(shares[0])
    im = ax_heat.imshow(list(map(list, zip(*shares))), aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                        extent=(its[0] - 0.5, its[-1] + 0.5, -0.5, n_exp - 0.5))
    fig.colorbar(im, ax=ax_heat, label="share of tokens")
    ax_heat.set_title(f"layer {layer}: tokens per expert (balanced = {1 / n_exp:.3g})", fontsize=10)
    ax_heat.set_xlabel("step")
    ax_heat.set_ylabel("expert")

    # router losses
    drew = False
    for key, colour in (("load_balancing_loss", "C0"), ("z_loss", "C3")):
        vals = [getattr(r, key) for r in recs]
        if all(v for v in vals):
            mean = [sum(v) / len(v) for v in vals]
            mine = [v[r.layers.index(layer)] for v, r in zip(vals, recs)]
            ax_loss.plot(its, mean, color=colour, label=f"{key.replace('_', ' ')} (mean of layers)")
            ax_loss.plot(its, mine, color=colour, ls="--", alpha=0.7, label=f"layer {layer}")
            drew = True
    if drew:
        ax_loss.set_title("router losses (before their coefficients)", fontsize=10)
        ax_loss.set_xlabel("step")
        ax_loss.legend(fontsize=7, frameon=False)
        ax_loss.grid(alpha=0.3)
    else:
        _empty(ax_loss, "no router losses (load balancing none, z-loss off)")

    # coefficient of variation per layer
    cvs = [r.coefficient_of_variation() for r in recs]
    for j, lay in enumerate(layers):
        ax_cv.plot(its, [c[j] for c in cvs], label=f"layer {lay}", lw=1.2)
    ax_cv.set_title("load imbalance: coefficient of variation of tokens per expert", fontsize=10)
    ax_cv.set_xlabel("step")
    ax_cv.grid(alpha=0.3)
    if len(layers) <= 12:
        ax_cv.legend(fontsize=7, frameon=False, ncols=2)

    # dropped assignments
    if any(any(r.dropped) for r in recs):
        for j, lay in enumerate(layers):
            ax_drop.plot(its, [100.0 * r.dropped[j] / max(r.assignments[j], 1) for r in recs], label=f"layer {lay}")
        ax_drop.set_title("dropped assignments (capacity), %", fontsize=10)
        ax_drop.set_xlabel("step")
        ax_drop.grid(alpha=0.3)
    else:
        _empty(ax_drop, "no dropped tokens (dropless, or every expert under its capacity)")
    warn = flags_text(collapse_flags(recs), limit=3)
    if warn:
        fig.suptitle(warn, color="#d62728", fontsize=9)
    fig.tight_layout()
    return fig
