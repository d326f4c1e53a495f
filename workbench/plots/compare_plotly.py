"""The run overlay of :mod:`workbench.plots.compare` as a plotly figure: hover values, zoom and pan (issue #55).

:func:`plotly_figure` draws what :func:`~workbench.plots.compare.compare_runs` drew with matplotlib, from the same
:class:`~workbench.plots.compare.Comparison` (its curves, so the numbers are the same): one line per run over the
chosen x axis (the smoothed values; the raw values faint behind, when smoothed), a log y axis when chosen, the marked
step as a dashed vertical line, each run's last value written at its end, and a unified hover by x naming each run
with its value (smoothed and raw) and step.

:func:`figure_bundle` is the display output the run browser shows live: the plotly JSON (drawn, with hover, by
JupyterLab's plotly renderer, which ships in plotly's wheel), the matplotlib PNG (for what lacks that renderer, e.g.
nbconvert's HTML export; left out live, see there) and a text line, the PNG named like
:func:`workbench.widgets.dashboard.figure_image` names it.  plotly is imported here only, lazily.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

__all__ = ["PLOTLY_MIME", "COLOURS", "plotly_figure", "figure_bundle"]

#: the mimetype of a plotly figure in a Jupyter output
PLOTLY_MIME = "application/vnd.plotly.v1+json"
#: matplotlib's default cycle (tab10), so a run has the colour it has in the PNG
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
#: a series with at most this many points is drawn with a marker on each (as the PNG does)
_MARKERS_UP_TO = 30


def _finite(v: float) -> float | None:
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def plotly_figure(comp: Any, *, at_step: int | None = None, height: int = 430) -> Any:
    """``comp`` (a :class:`~workbench.plots.compare.Comparison`) as a ``plotly.graph_objects.Figure``.

    One legend entry and line per run that records the metric (named as in ``comp.curves``; its raw values a faint
    trace in the same legend group, left out of the hover); ``at_step`` (default: the step ``comp`` marks): a dashed
    vertical line there."""
    import plotly.graph_objects as go

    from workbench.plots.compare import _x_label, metric_label

    fig = go.Figure()
    smoothed = comp.smoothing > 0
    step = comp.at_step if at_step is None else at_step
    for i, c in enumerate(comp.curves):
        colour = COLOURS[i % len(COLOURS)]
        mode = "lines+markers" if len(c.x) <= _MARKERS_UP_TO else "lines"
        xs = [_finite(v) for v in c.x]
        if smoothed:
            fig.add_trace(go.Scatter(x=xs, y=list(c.y), name=f"{c.run} (raw)", legendgroup=c.run, showlegend=False,
                                     mode=mode, line={"color": colour, "width": 1}, marker={"size": 4},
                                     opacity=0.3, hoverinfo="skip", meta={"run": c.run, "values": "raw"}))
        ys = list(c.smoothed if smoothed else c.y)
        raw = "<br>raw %{customdata[0]:.4g}" if smoothed else ""
        fig.add_trace(go.Scatter(
            x=xs, y=ys, name=c.run, legendgroup=c.run, mode=mode, line={"color": colour, "width": 2},
            marker={"size": 5}, customdata=[[y, s] for y, s in zip(c.y, c.steps)],
            hovertemplate=f"%{{fullData.name}}: %{{y:.4g}}{raw} (step %{{customdata[1]}})<extra></extra>",
            meta={"run": c.run, "values": "smoothed" if smoothed else "raw"}))
        if c.x and _finite(c.x[-1]) is not None:
            fig.add_annotation(x=c.x[-1], y=(math.log10(c.y[-1]) if comp.log_y and c.y[-1] > 0 else c.y[-1]),
                               text=f"{c.y[-1]:.4g}", showarrow=False, xanchor="right", yanchor="bottom",
                               font={"size": 10, "color": colour}, bgcolor="rgba(255,255,255,0.8)")
    notes = []
    if comp.lacking:
        notes.append(f"not recorded by: {', '.join(comp.lacking)}")
    layout: dict[str, Any] = {}
    if not comp.curves:
        fig.add_annotation(text=f"no run records {comp.metric}" if comp.lacking else "no run selected",
                           xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font={"color": "gray"})
        layout.update(xaxis={"visible": False}, yaxis={"visible": False})
    else:
        log = comp.log_y and any(v > 0 for c in comp.curves for v in c.y)
        if comp.log_y and not log:
            notes.append("log scale: no positive values")
        layout.update(showlegend=True, xaxis={"title": {"text": _x_label(comp.x_axis)}},
                      yaxis={"title": {"text": metric_label(comp.metric)}, "type": "log" if log else "linear"})
        if step is not None:
            if comp.x_axis == "step":
                fig.add_vline(x=float(step), line={"color": "gray", "dash": "dash", "width": 1})
            else:
                for i, c in enumerate(comp.curves):
                    k = c.index_at(int(step))
                    if k is not None and math.isfinite(c.x[k]):
                        fig.add_vline(x=c.x[k], opacity=0.7,
                                      line={"color": COLOURS[i % len(COLOURS)], "dash": "dash", "width": 1})
    if notes:
        fig.add_annotation(text="; ".join(notes), xref="paper", yref="paper", x=0.0, y=0.0, xanchor="left",
                           yanchor="bottom", showarrow=False, font={"size": 10, "color": "#595959"})
    smooth = f", smoothing {comp.smoothing:g}" if smoothed else ""
    fig.update_layout(title={"text": f"{metric_label(comp.metric)} by {comp.x_axis}{smooth}", "font": {"size": 14}},
                      hovermode="x unified", hoverdistance=-1, template="plotly_white", height=height,
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, legend={"font": {"size": 11}}, **layout)
    return fig


def figure_bundle(comp: Any, name: str, *, with_png: bool = True, at_step: int | None = None) -> dict:
    """``comp`` as a Jupyter ``display_data`` output: the plotly figure (:data:`PLOTLY_MIME`), its matplotlib PNG
    (``comp.png()``, base64 as IPython writes it; none when ``with_png`` is False) and a text line; the metadata names
    it ``name`` (``metadata["image/png"]["workbench_figure"]``, as :func:`workbench.widgets.dashboard.figure_image`
    does, and the same under the plotly mimetype).  ``display(out["data"], raw=True, metadata=out["metadata"])``
    shows it.

    Why no PNG live: JupyterLab's plotly renderer shows a bundle's PNG as an image and only draws the chart
    when the mouse enters it (its design for saved notebooks); without one it draws the chart at once and then puts
    its own PNG snapshot into the output (what a saved copy and a viewer without plotly's renderer show)."""
    fig = plotly_figure(comp, at_step=at_step)
    text = f"<{name} figure: {comp.metric} of {', '.join(c.run for c in comp.curves) or 'no run'}>"
    data: dict[str, Any] = {PLOTLY_MIME: json.loads(fig.to_json())}
    if with_png:
        data["image/png"] = base64.b64encode(comp.png()).decode("ascii")
    data["text/plain"] = text
    return {"output_type": "display_data", "data": data,
            "metadata": {"image/png": {"workbench_figure": name}, PLOTLY_MIME: {"workbench_figure": name}}}
