"""The layout advisor in a notebook: a sorted table, a memory-vs-speed scatter, one click loads a layout.

``AdvisorWidget(form_or_config, gpus=8, gpu="H100-80GB")`` runs :func:`workbench.advisor.advise` on the
config (a :class:`~workbench.widgets.config_form.ConfigForm`'s current config, or a RunConfig) and
shows every evaluated layout: the ranked ones that fit, and the faster ones that do not (OOM).  Each
row's button loads that layout into the form (:meth:`ConfigForm.load` of the config with the layout's
overrides); without a form, :attr:`loaded` holds the config.  Drive it programmatically with
:meth:`refresh`, :meth:`load` and :meth:`scatter` (tests, scripts).
"""

from __future__ import annotations

import html
from typing import Any

from workbench.advisor.advise import Advice, AdvisedLayout, advise
from workbench.advisor.perf_model import REASONS
from workbench.config import ConfigError, RunConfig
from workbench.planner import gpu_spec

__all__ = ["AdvisorWidget", "advice_table_html", "scatter_figure"]


def advice_table_html(advice: Advice, rows: list[AdvisedLayout] | None = None) -> str:
    """The advice as an HTML table, in its (speed) order."""
    rows = advice.rows if rows is None else rows
    head = "".join(f"<th>{h}</th>" for h in ("#", "layout", "tok/s", "tok/s/GPU", "MFU", "memory GiB", "fits",
                                             *REASONS, "main cost"))
    body = []
    for r in rows:
        p = r.prediction
        cells = [str(r.rank or ""), html.escape(r.label), f"{p.tokens_per_s:,.0f}", f"{p.tokens_per_s / r.layout.gpus:,.0f}",
                 f"{100 * p.mfu:.1f}%", "" if r.memory_gib is None else f"{r.memory_gib:.1f}",
                 {True: "yes", False: "OOM", None: "?"}[r.fits],
                 *(f"{100 * p.breakdown[k] / p.step_s:.1f}%" for k in REASONS), p.main_reason]
        style = "" if r.fits else ' style="color:#999"'
        body.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return (f"<p>{html.escape(advice.config_name)}: {advice.valid_layouts} valid layouts on {advice.gpus} x {advice.gpu}; "
            f"memory checked for {advice.memory_evaluated} in order of predicted speed</p>"
            f"<table class='wb-advisor'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")


def scatter_figure(advice: Advice, capacity_gib: float | None = None):
    """Memory (the fullest rank, GiB) against predicted tokens/s of every layout whose memory was checked: those that
    fit in blue, OOM in grey, the pick circled, the GPU's memory as a vertical line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = [r for r in advice.rows if r.memory_gib is not None]
    for fits, colour, label in ((True, "tab:blue", "fits"), (False, "0.6", "OOM")):
        pts = [r for r in rows if r.fits is fits]
        ax.scatter([r.memory_gib for r in pts], [r.prediction.tokens_per_s for r in pts], s=18, c=colour, label=label)
    best = advice.best
    if best is not None:
        ax.scatter([best.memory_gib], [best.prediction.tokens_per_s], s=120, facecolors="none", edgecolors="tab:red",
                   label=f"pick: {best.label}")
    if capacity_gib:
        ax.axvline(capacity_gib, color="tab:red", lw=0.8, ls="--")
    ax.set_xlabel("memory of the fullest rank (GiB: reserved + context + NCCL)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title(f"{advice.config_name} on {advice.gpus} x {advice.gpu}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


class AdvisorWidget:
    """Advice for a form's (or a config's) model on ``gpus`` GPUs, with buttons that load a layout."""

    def __init__(self, source: Any, gpus: int = 8, gpu: str = "H100-80GB", nodes: int = 1, top: int = 20, show: int = 40):
        import ipywidgets as W

        self._W = W
        self.form = source if hasattr(source, "load") and hasattr(source, "config") else None
        self.base: RunConfig = self.form.config if self.form is not None else source
        self.gpus, self.gpu, self.nodes, self.top, self.show = gpus, gpu, nodes, top, show
        self.advice: Advice | None = None
        self.error = ""
        self.loaded: RunConfig | None = None
        self.status = W.HTML()
        self.table = W.HTML()
        self.buttons: list[Any] = []
        self.rows_box = W.VBox()
        self.plot = W.Output()
        self.figure = None
        self.refresh_button = W.Button(description="advise", icon="refresh")
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.widget = W.VBox([W.HBox([self.refresh_button, self.status]), self.rows_box, self.plot])
        self.refresh()

    def refresh(self) -> Advice | None:
        """Advise again on the form's current config (or the config given)."""
        base = self.form.config if self.form is not None else self.base
        self.base = base
        try:
            self.advice = advise(base, self.gpus, gpu=self.gpu, nodes=self.nodes, top=self.top)
            self.error = ""
        except ConfigError as e:  # the config's own problems, as the form shows them
            self.advice, self.error = None, str(e)
        self._draw()
        return self.advice

    def shown_rows(self) -> list[AdvisedLayout]:
        """The rows the table shows: the evaluated ones in speed order (at most ``show``)."""
        return [] if self.advice is None else [r for r in self.advice.rows if r.memory_gib is not None][: self.show]

    def _draw(self) -> None:
        W = self._W
        if self.advice is None:
            self.status.value = f"<span style='color:#b00'>{html.escape(self.error)}</span>"
            self.rows_box.children = ()
            return
        a = self.advice
        best = a.best
        self.status.value = (f"pick: <b>{html.escape(best.label)}</b>, {best.prediction.tokens_per_s:,.0f} tok/s"
                             if best else f"<span style='color:#b00'>no layout fits {a.gpu}</span>")
        rows = self.shown_rows()
        self.table.value = advice_table_html(a, rows)
        self.buttons = []
        for i, r in enumerate(rows):
            b = W.Button(description=f"load #{r.rank}" if r.rank else "load (OOM)", layout=W.Layout(width="110px"),
                         disabled=not r.fits, tooltip=r.label)
            b.on_click(lambda _b, i=i: self.load(i))
            self.buttons.append(b)
        self.rows_box.children = (self.table, W.VBox([W.HBox([b, W.HTML(html.escape(r.label))]) for b, r in zip(self.buttons, rows)]))
        self.plot.clear_output(wait=True)
        self.figure = self.scatter(gpu_spec(a.gpu).capacity_bytes / 1024 ** 3)
        with self.plot:
            from IPython.display import display

            display(self.figure)
        import matplotlib.pyplot as plt

        plt.close(self.figure)  # shown once, in the output widget

    def scatter(self, capacity_gib: float | None = None):
        return scatter_figure(self.advice, capacity_gib)

    def load(self, index: int) -> RunConfig:
        """Load the shown row ``index``'s layout into the form (or :attr:`loaded`); returns the config."""
        row = self.shown_rows()[index]
        cfg = self.base.replace(**row.overrides)
        self.loaded = cfg
        if self.form is not None:
            self.form.load(cfg)
        return cfg

    def _ipython_display_(self) -> None:
        from workbench.widgets.layout import show_live

        show_live(self.widget)
