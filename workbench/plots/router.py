"""The router dashboard of an MoE run: what its top-k routers did while it trained.

Drawn from the run's ``router`` records (:meth:`workbench.run.reader.RunReader.router`, the events the backend
writes every ``model.moe.router_stats_interval`` steps): a heatmap of the share of each expert's tokens per
sampled step for one MoE layer (1/E everywhere is perfect balance), the load-balancing and z-loss curves (the
mean over MoE layers, and the chosen layer's), the coefficient of variation of the experts' token counts per
layer over the steps, and the dropped assignments where experts have a capacity.  A pyplot-free ``Figure``
(safe from the dashboard's thread; rendered to PNG by :func:`workbench.plots.training.figure_png`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from workbench.run.events import Router
from workbench.run.reader import RunReader, as_reader

__all__ = ["router_records", "router_figure", "load_table"]


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
    fig.tight_layout()
    return fig
