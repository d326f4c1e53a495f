"""The run browser: the runs under a folder as a table, several of them overlaid on one metric.

A thin widget over :mod:`workbench.plots.compare`: the table of runs (:func:`~workbench.plots.compare.runs_frame`:
name, family, layout, steps, last loss, tokens/s, status, start), a multi-select of runs, a metric dropdown filled
from the selected runs' events (:func:`~workbench.plots.compare.available_metrics`: whatever they record, a
fine-tuning run's ``eval accuracy`` included), a smoothing slider (TensorBoard's EMA weight), a log-scale toggle, the
x axis (step, tokens, wall time) and a step slider: the figure marks that step and a table gives each selected
run's value there.  A selected run that does not record the metric is named on the figure and in the table.

Live, the figure is plotly's (:mod:`workbench.plots.compare_plotly`): hovering over it gives each run's value (smoothed
and raw) and step at that x, and it zooms and pans (saved, the chart is part of the widget state: docs/notebooks.md
says what is checked of a reopened one).  The step table stays: values at a chosen step, in text.

Headless-friendly like the other workbench widgets: constructing :class:`RunBrowser` needs no browser,
:meth:`RunBrowser.set` drives it from code (tests, papermill), and :attr:`~RunBrowser.comparison` /
:attr:`~RunBrowser.figure` / :attr:`~RunBrowser.values` hold the latest result.  Displayed headless (papermill,
where widget state is not saved) it shows the table, the figure (a PNG output named ``compare``,
:func:`workbench.widgets.dashboard.figure_image`) and the values instead of the controls.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Sequence

from workbench.launch import Run
from workbench.plots.compare import (DEFAULT_SMOOTHING, X_AXES, Comparison, available_metrics, compare_runs, find_runs,
                                     metric_label, runs_frame)
from workbench.plots.tables import Table, html_table, text_block
from workbench.run.reader import RunReader

__all__ = ["RunBrowser", "FIGURE_NAME"]

#: the name the figure's PNG output carries in a saved notebook (``workbench_figure``)
FIGURE_NAME = "compare"
#: how many of the newest runs are selected at first
_FIRST_SELECTED = 3


class RunBrowser:
    """The runs under ``runs_dir`` (a notebook passes its own folder: ``RunBrowser(notebook_dir(out_dir))``,
    :func:`workbench.notebook.notebook_dir`).

    ``selected``: run directories (or names) to select at first (default: the newest three); ``metric``, ``x``,
    ``smoothing``, ``log_y``: the first view.  ``show=False`` draws nothing into the output (tests).
    """

    def __init__(self, runs_dir: str | Path, *, selected: Sequence[str | Path] | None = None,
                 metric: str = "loss", x: str = "step", smoothing: float = DEFAULT_SMOOTHING, log_y: bool = False,
                 show: bool = True):
        import ipywidgets as W

        from workbench.widgets.layout import column, columns, labelled

        self.runs_dir = Path(runs_dir)
        self._show = show
        self._batch = False
        self._runs: dict[str, Any] = {}  # run directory -> its Run (reader and status), kept between refreshes
        self.table = None  # the runs' DataFrame
        self.comparison: Comparison | None = None
        self.figure = None
        self.values = None  # the selected runs' values at the chosen step (DataFrame)
        self.runs_text = self.values_text = None  # the tables as workbench.plots.tables.Table (text and HTML)
        self.status_text = ""

        st, box = labelled(W, ["runs", "metric", "x axis", "smoothing", "step"], 260)
        self.selection = W.SelectMultiple(options=[], description="runs", rows=6, style=st,
                                          layout=W.Layout(width="560px", flex="0 0 auto"))
        self.metric = W.Dropdown(options=[], description="metric", style=st, layout=box)
        self.x_axis = W.Dropdown(options=list(X_AXES), value=x, description="x axis", style=st, layout=box)
        self.smoothing = W.FloatSlider(value=smoothing, min=0.0, max=0.99, step=0.01, description="smoothing",
                                       readout_format=".2f", style=st, layout=box, continuous_update=False)
        self.log_y = W.Checkbox(value=log_y, description="log scale", indent=False, layout=W.Layout(width="120px"))
        self.step = W.IntSlider(value=0, min=0, max=0, description="step", style=st, layout=box, continuous_update=False)
        self.refresh_button = W.Button(description="refresh", tooltip="look for new runs and read new events",
                                       layout=W.Layout(width="90px"))
        self.runs_html = W.HTML()
        self.status = W.HTML()
        self.values_html = W.HTML()
        self.out = W.Output()
        controls = columns(W, [column(W, [self.selection]),
                               column(W, [self.metric, self.x_axis, self.smoothing, self.step,
                                          W.HBox([self.log_y, self.refresh_button])])])
        self.ui = W.VBox([self.runs_html, controls, self.status, self.out, self.values_html])

        self._scan(selected=selected, metric=metric)
        self.selection.observe(self._on_selection, names="value")
        for w in (self.metric, self.x_axis, self.smoothing, self.log_y):
            w.observe(self._on_change, names="value")
        self.step.observe(self._on_step, names="value")
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.update()

    # ---- the runs
    def _run(self, run_dir: Path) -> Any:
        key = str(run_dir)
        if key not in self._runs:
            try:
                self._runs[key] = Run.attach(run_dir)
            except Exception:  # not a run this version can attach: its events still read (status "unknown")
                self._runs[key] = RunReader(run_dir)
        return self._runs[key]

    def _scan(self, selected: Sequence[str | Path] | None = None, metric: str | None = None) -> None:
        """Find the runs, fill the table and the multi-select (keeping what was selected), then the metrics."""
        dirs = find_runs(self.runs_dir)
        runs = [self._run(d) for d in dirs]
        self.table = runs_frame(runs)
        shown = self.table.drop(columns=["run_dir"])
        # whole tokens/s (the table's 4 decimals are for the loss); a run without throughput: an empty cell ("-")
        shown["tokens/s"] = ["-" if v != v else f"{v:.0f}" for v in shown["tokens/s"].astype("float64")]
        where = str(self.runs_dir)
        if len(shown):
            table = html_table(shown, precision=4)
            head = f"{len(shown)} run{'s' if len(shown) != 1 else ''} under {where}"
            self.runs_text = Table(f"{head}\n{table.text}", f"<b>{html.escape(head)}</b>{table.html}")
        else:
            self.runs_text = text_block(f"no runs under {where} yet")
        self.runs_html.value = self.runs_text.html
        names = [d.name for d in dirs]
        # a run's option shows its name (the folder above it too, where two runs share a name)
        options = [(f"{d.parent.name}/{d.name}" if names.count(d.name) > 1 else d.name, str(d)) for d in dirs]
        before = tuple(self.selection.value)
        if selected is not None:
            want = [self._key(s, dirs) for s in selected]
        elif before:
            want = list(before)
        else:
            want = [str(d) for d in dirs[:_FIRST_SELECTED]]
        keys = {v for _, v in options}
        self._batch = True
        try:
            self.selection.options = options
            self.selection.value = tuple(k for k in want if k in keys)
            self._fill_metrics(metric)
        finally:
            self._batch = False

    @staticmethod
    def _key(s: str | Path, dirs: Sequence[Path]) -> str:
        """The option value of a run given by directory or by name."""
        p = Path(s)
        for d in dirs:
            if p == d or (not p.is_absolute() and len(p.parts) == 1 and d.name == p.name) or \
                    (p.exists() and d.exists() and p.resolve() == d.resolve()):
                return str(d)
        return str(p)

    @property
    def selected_runs(self) -> list[Any]:
        """The selected runs (:class:`workbench.launch.Run`), in the table's order."""
        chosen = set(self.selection.value)
        return [self._runs[v] for _, v in self.selection.options if v in chosen]

    def _fill_metrics(self, prefer: str | None = None) -> None:
        """The metric dropdown: what the selected runs record; the current (or ``prefer``red) metric kept when one
        of them records it, else the loss, else the first."""
        names = available_metrics(self.selected_runs)
        current = prefer or self.metric.value
        self.metric.options = [(metric_label(m), m) for m in names]
        if names:
            self.metric.value = current if current in names else ("loss" if "loss" in names else names[0])

    # ---- driving it
    def set(self, **controls: Any) -> "RunBrowser":
        """Set controls by name (``selection``: run directories or names; ``metric``, ``x_axis``, ``smoothing``,
        ``log_y``, ``step``) and redraw once."""
        allowed = {"selection", "metric", "x_axis", "smoothing", "log_y", "step"}
        unknown = set(controls) - allowed
        if unknown:
            raise ValueError(f"unknown control(s) {sorted(unknown)}; one of {sorted(allowed)}")
        self._batch = True
        try:
            if "selection" in controls:
                dirs = [Path(v) for _, v in self.selection.options]
                keys = tuple(self._key(s, dirs) for s in controls["selection"])
                missing = [s for s, key in zip(controls["selection"], keys) if key not in {str(d) for d in dirs}]
                if missing:
                    raise ValueError(f"selection: no run {', '.join(map(str, missing))} under {self.runs_dir} "
                                     f"(runs: {', '.join(d.name for d in dirs) or 'none'})")
                self.selection.value = keys
                self._fill_metrics(controls.get("metric"))
            for k in ("metric", "x_axis", "smoothing", "log_y"):
                if k in controls:
                    options = getattr(getattr(self, k), "options", None)
                    if options is not None and controls[k] not in [o[1] if isinstance(o, tuple) else o for o in options]:
                        raise ValueError(f"{k}: {controls[k]!r} is not offered for the selected runs "
                                         f"(one of: {', '.join(map(str, (o[1] if isinstance(o, tuple) else o for o in options)))})")
                    getattr(self, k).value = controls[k]
        finally:
            self._batch = False
        self.update(step=controls.get("step"))
        return self

    def refresh(self) -> "RunBrowser":
        """Look for new runs, read what the runs wrote since, and redraw."""
        self._scan()
        self.update()
        return self

    def _on_selection(self, _change: dict) -> None:
        if self._batch:
            return
        self._batch = True
        try:
            self._fill_metrics()
        finally:
            self._batch = False
        self.update()

    def _on_change(self, _change: dict) -> None:
        if not self._batch:
            self.update()

    def _on_step(self, _change: dict) -> None:
        if not self._batch:
            self.update(step=self.step.value)

    # ---- drawing
    def update(self, step: int | None = None) -> Comparison:
        """Redraw the figure for the current controls, and the values table at ``step`` (default: the step slider's;
        the last step when the steps recorded changed, e.g. another run or metric)."""
        chosen = set(self.selection.value)
        names = [label for label, v in self.selection.options if v in chosen]  # as listed: unique where names repeat
        self.comparison = comp = compare_runs(self.selected_runs, self.metric.value or "loss", x=self.x_axis.value,
                                              smoothing=self.smoothing.value, log_y=self.log_y.value, labels=names)
        steps = comp.steps()
        self._batch = True
        try:
            if steps:
                lo, hi = steps[0], steps[-1]
                if (lo, hi) != (self.step.min, self.step.max):
                    self._step_range(lo, hi)
                    step = hi if step is None else step
                self.step.value = min(max(int(self.step.value if step is None else step), lo), hi)
            self.step.disabled = not steps
        finally:
            self._batch = False
        at = self.step.value if steps else None
        if at is not None:
            comp.mark_step(at)
        self.figure = comp.figure
        self.values = comp.values_at(at)
        self._render_values(at)
        if self._show:  # one state update replaces the old chart (widgets/charts.py says why)
            self._show_figure(comp)
        return comp

    def _show_figure(self, comp: Comparison) -> None:
        """Live: the plotly figure (:func:`~workbench.plots.compare_plotly.figure_bundle`, without the PNG);
        headless (or without plotly): the PNG alone, as before."""
        from workbench.widgets.charts import show_figure
        from workbench.widgets.dashboard import is_headless

        if not is_headless():
            try:
                from workbench.plots.compare_plotly import figure_bundle

                # no PNG: plotly's renderer would show it until hovered (figure_bundle says why)
                self.out.outputs = (figure_bundle(comp, FIGURE_NAME, with_png=False),)
                return
            except ImportError:  # plotly missing: the static figure
                pass
        show_figure(self.out, self.figure)

    def _step_range(self, lo: int, hi: int) -> None:
        """The step slider's bounds (in an order the slider accepts: never min above max)."""
        if lo > self.step.max:
            self.step.max = hi
            self.step.min = lo
        else:
            self.step.min = lo
            self.step.max = hi

    def _render_values(self, at: int | None) -> None:
        comp = self.comparison
        if not self.selection.value:
            self.status_text = "select one or more runs"
        elif not comp.curves:
            self.status_text = f"none of the selected runs records {comp.metric}"
        else:
            lacking = f" \u00b7 not recorded by {', '.join(comp.lacking)}" if comp.lacking else ""
            self.status_text = (f"{len(comp.curves)} run{'s' if len(comp.curves) != 1 else ''} with "
                                f"{metric_label(comp.metric)}{lacking}")
        self.status.value = html.escape(self.status_text)
        if self.values is None or not len(self.values):
            self.values_text = Table("", "")
        else:
            head = f"values at step {at} (each run's last point at or before it)" if at is not None else "values"
            table = html_table(self.values, precision=4)
            self.values_text = Table(f"{head}\n{table.text}", f"<b>{html.escape(head)}</b>{table.html}")
        self.values_html.value = self.values_text.html

    # ---- display
    def static(self) -> list:
        """The runs table, the status line, the figure (a PNG output named :data:`FIGURE_NAME`) and the values table,
        for a saved notebook (tables as :class:`workbench.plots.tables.Table`: HTML, and text in a text export)."""
        from workbench.widgets.dashboard import figure_image

        out = [self.runs_text, text_block(self.status_text), figure_image(FIGURE_NAME, self.comparison.png())]
        return out + ([self.values_text] if self.values_text.text else [])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        from workbench.widgets.dashboard import is_headless

        if is_headless():
            for item in self.static():
                display(item)
        else:
            from workbench.widgets.layout import show_live

            show_live(self.ui)
