"""An interactive pipeline-schedule explorer: sliders for p, m, v and the schedule kind.

Headless-friendly: constructing :class:`ScheduleExplorer` needs no browser, and
:meth:`ScheduleExplorer.set` drives it from code (tests, papermill).  Every change
re-simulates and redraws into an ``Output`` widget (the newest change's chart, whatever the
order the browser sends changes in); a layout mcore would refuse shows the reason instead of a
chart.
"""

from __future__ import annotations

import html
from typing import Any

from workbench.plots.schedule import compare, gantt
from workbench.schedules import SCHEDULES, ScheduleError, Timeline, closed_form_bubble_fraction, simulate

__all__ = ["ScheduleExplorer"]


class ScheduleExplorer:
    """Sliders (p, m, v, backward/forward ratio, latency) + schedule dropdown -> Gantt chart + metrics.

    ``compare=True`` also draws 1F1B (and GPipe) for the same p, m under the selection.
    ``timeline`` / ``figure`` / ``message`` hold the latest result for programmatic use.
    """

    def __init__(self, p: int = 4, m: int = 8, v: int = 2, schedule: str = "interleaved", compare: bool = True,
                 max_p: int = 8, max_m: int = 32, max_v: int = 4, show: bool = True):
        import ipywidgets as W

        from workbench.widgets.layout import columns, labelled

        st, box = labelled(W, ["p (stages)", "m (micro-b.)", "v (chunks)", "schedule", "B / F time", "latency"], 200)
        kw = dict(style=st, layout=W.Layout(width=box.width, flex=box.flex))
        self.p = W.IntSlider(value=p, min=1, max=max_p, description="p (stages)", continuous_update=False, **kw)
        self.m = W.IntSlider(value=m, min=1, max=max_m, description="m (micro-b.)", continuous_update=False, **kw)
        self.v = W.IntSlider(value=v, min=1, max=max_v, description="v (chunks)", continuous_update=False, **kw)
        self.schedule = W.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule", **kw)
        self.ratio = W.FloatSlider(value=2.0, min=0.5, max=4.0, step=0.25, description="B / F time",
                                   continuous_update=False, **kw)
        self.latency = W.FloatSlider(value=0.0, min=0.0, max=1.0, step=0.05, description="latency",
                                     continuous_update=False, **kw)
        self.compare = W.Checkbox(value=compare, description="compare with 1F1B / GPipe")
        self.status = W.HTML()
        self.out = W.Output()
        self.timeline: Timeline | None = None
        self.others: list[Timeline] = []
        self.figure = None
        self.message = ""
        self._show = show
        for w in (self.p, self.m, self.v, self.schedule, self.ratio, self.latency, self.compare):
            w.observe(self._on_change, names="value")
        self.ui = W.VBox([  # rows that wrap where the output is narrower (nothing clipped)
            columns(W, [self.schedule, self.compare]),
            columns(W, [self.p, self.m, self.v]),
            columns(W, [self.ratio, self.latency]),
            self.status,
            self.out,
        ])
        self.update()

    # -- programmatic control
    def set(self, **values: Any) -> "ScheduleExplorer":
        """Set several controls at once (``p=, m=, v=, schedule=, ratio=, latency=, compare=``), redraw once."""
        self._batch = True
        try:
            for k, val in values.items():
                getattr(self, k).value = val
        finally:
            self._batch = False
        self.update()
        return self

    def _on_change(self, _change: dict) -> None:
        if not getattr(self, "_batch", False):
            self.update()

    def update(self) -> Timeline | None:
        """Re-simulate and redraw; returns the new timeline or None (with ``message`` set) if refused."""
        from workbench.widgets.layout import plural
        from workbench.widgets.charts import clear_figure, show_figure

        sched = self.schedule.value
        p, m = self.p.value, self.m.value
        v = self.v.value if sched == "interleaved" else 1
        self.v.disabled = sched != "interleaved"
        kw = dict(forward=1.0, backward=self.ratio.value, latency=self.latency.value)
        self.figure = None
        try:
            self.timeline = simulate(sched, p, m, v, **kw)
            self.others = []
            if self.compare.value:
                for other in ("1f1b", "gpipe"):
                    if other != sched:
                        self.others.append(simulate(other, p, m, 1, **kw))
            self.message = ""
        except ScheduleError as e:
            self.timeline, self.others, self.message = None, [], str(e)
        if self.timeline is None:
            clear_figure(self.out)  # at once, so the previous chart never stays under the refusal
            self.status.value = f"<b style='color:#b00'>refused:</b> {html.escape(self.message)}"
            return None
        tl = self.timeline
        inflight = max(tl.peak_inflight(r) for r in range(p)) / tl.v
        self.status.value = (
            f"step <b>{tl.step_time:.3g}</b> (forward = 1 per stage) &middot; bubble <b>{tl.bubble_fraction():.3f}</b> "
            f"(closed form {closed_form_bubble_fraction(sched, p, m, v):.3f}) &middot; peak in flight on rank 0: "
            f"<b>{plural(inflight, 'micro-batch', 'micro-batches')}</b> of activations")
        if m < p:  # the same warning as `workbench schedule`
            self.status.value += (f"<br><b style='color:#b00'>m={m} &lt; p={p}</b>: the pipeline never fills, every rank "
                                  f"idles more than it works (bubble &gt; 1) &rarr; use at least m={p} micro-batches")
        self.figure = compare([tl] + self.others) if self.others else gantt(tl)
        if self._show:  # one state update replaces the old chart (widgets/charts.py says why not `with out`)
            show_figure(self.out, self.figure)
        return tl

    def _ipython_display_(self) -> None:
        from workbench.widgets.layout import show_live

        show_live(self.ui)
