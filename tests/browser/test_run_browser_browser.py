"""The run browser (``workbench/widgets/runs.py``, the quickstart's last cell) driven through the page (issue #55).

Two finished tiny CPU runs (the backend's own ``Trainer``, one launch: ``tests/support/trainer_runs.py``; their learning
rates differ, so their curves do) in a folder; a scratch notebook whose one cell shows ``RunBrowser(<that folder>)``
opens in the worker's JupyterLab page (``lab_page``, conftest.py) and runs.  Then, with the real ipywidgets controls:

- the page lists both runs, finished, and overlays both (the newest two of two are selected at first);
- the figure is plotly's (``workbench/plots/compare_plotly.py``), drawn by JupyterLab's plotly renderer (not the
  PNG the same output carries): its legend names the runs, and hovering over the plot area shows a hover label that
  names both runs;
- a click on one run in the multi-select: the values table names that run alone and the figure is drawn again (its
  legend names that run alone); a Ctrl+click on the other: the table names both, the status says two runs, the
  figure changes again;
- the metric dropdown set to grad norm, the log-scale toggle, the smoothing slider at 0: each redraws the figure
  (its y-axis title, axis type or lines change) and what the page says follows (the status names the metric; the
  table's values are the grad norms; unsmoothed, each run's smoothed value is its value);
- saved and reopened (a fresh page, a new kernel): the overlay as it was last (plotly's renderer drawing the saved
  figure, or the image it saved), its legend naming both runs, its status line and the note that it is live again
  after re-running, and no "model not found".

Every check reads the page (the plotly chart's SVG, the status line, the tables' cells), not the widget's Python
state.
A screenshot of every step goes to ``<artefacts>/screenshots``.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.support import tiny_run_config
from tests.support.browser_notebooks import close_page, reopen, within
from tests.support.browser_widgets import Scratch, field, set_slider
from tests.support.trainer_runs import run_trainers

pytestmark = pytest.mark.slow

#: run name -> its learning rate (6 steps of the tiny preset each, no checkpoint)
RUNS = {"tiny-lr-3e-3": 3e-3, "tiny-lr-3e-4": 3e-4}

# the tables under a root: each one's header cells and its rows' cells, as the page shows them
TABLES_JS = """(root) => Array.from(root.querySelectorAll('table')).map(t => ({
  head: Array.from(t.querySelectorAll('thead th')).map(c => c.innerText.trim()),
  rows: Array.from(t.querySelectorAll('tbody tr')).map(r => Array.from(r.querySelectorAll('th, td')).map(c => c.innerText.trim()))
}))"""


def _runs(folder: Path) -> dict[str, Path]:
    """The two runs, trained in one launch (a fresh folder: a rerun with the same artefacts starts over)."""
    shutil.rmtree(folder, ignore_errors=True)
    over = {"checkpoint.save_interval": 0, "checkpoint.save_on_exit": False}
    dirs = {name: folder / name for name in RUNS}
    t0 = time.time()
    run_trainers({dirs[name]: tiny_run_config(**{"train.lr": lr, **over}) for name, lr in RUNS.items()}, timeout=300)
    print(f"[browser] the two runs trained in {time.time() - t0:.0f}s", flush=True)
    return dirs


# what a plotly chart draws: its y-axis title and tick labels, its legend's names, its lines (as JSON: a signature
# that changes when the chart is drawn for other runs, another metric, a log axis or other smoothing)
PLOT_JS = """(plot) => JSON.stringify({
  ytitle: plot.querySelector('.g-ytitle')?.textContent || '',
  ytype: plot._fullLayout?.yaxis?.type || '',
  yticks: Array.from(plot.querySelectorAll('.yaxislayer-above .ytick text, .ytick text')).map(t => t.textContent),
  legend: Array.from(plot.querySelectorAll('.legend .legendtext')).map(t => t.textContent),
  lines: Array.from(plot.querySelectorAll('.scatterlayer .trace path.js-line')).map(p => p.getAttribute('d'))
})"""


class Shown:
    """What the run browser's output shows: its figure (a plotly chart), status line and tables."""

    def __init__(self, nb: Scratch, ui):
        self.nb, self.ui, self.page = nb, ui, nb.page
        self.figure = ui.locator(".widget-output .js-plotly-plot")

    def src(self) -> str | None:
        """The chart's signature (:data:`PLOT_JS`), None while there is not exactly one chart with lines."""
        if self.figure.count() != 1:
            return None
        try:
            sig = self.figure.first.evaluate(PLOT_JS)
        except Exception:  # redrawn under us
            return None
        return sig if '"lines":[]' not in sig else None

    def plot(self) -> dict:
        import json

        return json.loads(self.src() or "{}")

    def legend(self) -> list[str]:
        return self.plot().get("legend", [])

    def hover(self) -> str:
        """Hover over the middle of the plot area; the hover label's text (empty when none shows)."""
        drag = self.figure.first.locator(".nsewdrag").first
        drag.scroll_into_view_if_needed()
        box = drag.bounding_box()
        text = ""
        for dx in (0.5, 0.55, 0.45, 0.7, 0.3):  # a few points across the plot, should one fall between steps
            self.page.mouse.move(1, 1)
            drag.hover(position={"x": box["width"] * dx, "y": box["height"] * 0.5}, force=True)
            end = time.time() + 5
            while time.time() < end:
                text = self.figure.first.locator(".hoverlayer").first.text_content() or ""
                if text.strip():
                    return text
                time.sleep(0.2)
        return text

    def tables(self) -> list[dict]:
        return self.page.evaluate(TABLES_JS, self.ui.element_handle())

    def runs_table(self) -> dict:
        return next(t for t in self.tables() if "status" in t["head"])

    def values(self) -> dict[str, dict[str, str]]:
        """The values table: run -> {column: cell}."""
        tables = [t for t in self.tables() if "smoothed" in t["head"]]
        if not tables:
            return {}
        head = tables[-1]["head"]
        return {row[head.index("run")]: dict(zip(head, row)) for row in tables[-1]["rows"]}

    def says(self, line: str) -> bool:
        """The output says ``line`` (the status line: ``2 runs with train loss``)."""
        return line in self.ui.inner_text()

    def after(self, what: str, before: str | None, ok, timeout: float = 60) -> str:
        """Wait until the figure is a new one (its PNG not ``before``) and ``ok()`` holds, the kernel idle; the new
        figure's src.  A screenshot either way."""
        end = time.time() + timeout
        while time.time() < end:
            src = self.src()
            if src and src != before and ok():
                break
            time.sleep(0.25)
        self.nb.wait_idle(60)
        self.nb.shot(what, self.ui)
        src = self.src()
        imgs = self.ui.locator(".widget-output img:visible").count()  # plotly's renderer keeps a hidden <img>
        assert src, f"{what}: no plotly chart on the page ({self.figure.count()} charts, {imgs} <img>)"
        assert imgs == 0, f"{what}: the figure is shown as a PNG, not by plotly's renderer"
        assert src != before, f"{what}: the figure was not drawn again"
        assert ok(), f"{what}: the page shows {self.values()} / {self.ui.inner_text()[-800:]!r}"
        return src


def test_run_browser_overlays_two_runs_through_the_page(lab_page, artefacts):
    """Select runs, a metric, log scale and smoothing by clicking the controls; the figure and the tables follow."""
    a, b = RUNS
    dirs = _runs(artefacts / "run-browser-runs")
    t0 = time.time()
    cell = f"from workbench.widgets.runs import RunBrowser\n\nRunBrowser({str(dirs[a].parent)!r})"
    nb = Scratch(lab_page, artefacts, "run_browser", [cell])  # opened in the worker's page
    try:
        nb.run_all(180)
        ui = nb.outputs(0).first
        shown = Shown(nb, ui)

        # both runs listed, finished, and overlaid
        src = shown.after("opened", None, lambda: set(shown.values()) == {a, b})
        table = shown.runs_table()
        rows = {r[table["head"].index("run")]: r for r in table["rows"]}
        assert set(rows) == {a, b}, table
        assert all(r[table["head"].index("status")] == "finished" for r in rows.values()), table
        assert all(r[table["head"].index("steps")] == "6/6" for r in rows.values()), table
        assert shown.says("2 runs under") and shown.says("2 runs with train loss")
        assert sorted(shown.legend()) == sorted(RUNS), shown.plot()  # the legend names both runs
        assert shown.plot()["ytitle"] == "train loss", shown.plot()
        label = shown.hover()  # hover: a label naming both runs (unified by x) with their values
        nb.shot("hover", ui)
        assert a in label and b in label, f"hover label: {label!r}"
        nb.page.mouse.move(0, 0)

        # one run alone (a click), then both (Ctrl+click the other): the table and the figure follow
        select = ui.locator(".widget-select-multiple select")
        assert sorted(select.locator("option").all_inner_texts()) == sorted(RUNS)
        select.locator("option", has_text=b).click()
        src = shown.after(f"only-{b}", src, lambda: set(shown.values()) == {b} and shown.says("1 run with train loss"))
        alone = shown.values()[b]
        assert shown.legend() == [b], shown.plot()
        select.locator("option", has_text=a).click(modifiers=["Control"])
        src = shown.after("both", src, lambda: set(shown.values()) == {a, b} and shown.says("2 runs with train loss"))
        both = shown.values()
        assert sorted(shown.legend()) == sorted(RUNS), shown.plot()
        assert both[b] == alone, (both, alone)  # the other run's row is what it showed alone
        assert all(v["step"] == "6" for v in both.values()), both  # each run's value at its last step
        loss = {run: float(v["value"]) for run, v in both.items()}
        assert all(5 < x < 12 for x in loss.values()), loss  # a tiny GPT's loss on synthetic data (ln 32k ~ 10.4)

        # another metric: the status names it, the values are the grad norms
        field(ui, "metric").locator("select").select_option(label="grad norm")
        src = shown.after("grad-norm", src, lambda: shown.says("2 runs with grad norm")
                          and set(shown.values()) == {a, b}
                          and all(float(v["value"]) != loss[r] for r, v in shown.values().items()))
        norms = shown.values()
        assert shown.plot()["ytitle"] == "grad norm", shown.plot()  # the chart follows the metric
        assert shown.plot()["ytype"] == "linear", shown.plot()
        assert any(v["smoothed"] != v["value"] for v in norms.values()), norms  # smoothed at the default 0.6

        # log scale: the figure is drawn again, the values stay
        box = ui.locator(".widget-checkbox", has_text="log scale").locator("input[type=checkbox]")
        assert not box.is_checked()
        box.click()
        src = shown.after("log-scale", src, lambda: box.is_checked())
        assert shown.values() == norms and shown.says("2 runs with grad norm")
        assert shown.plot()["ytype"] == "log", shown.plot()  # the chart's y axis is a log axis now (lines redrawn)

        # no smoothing: each run's smoothed value is its value
        set_slider(nb.page, ui, "smoothing", 0)
        src = shown.after("unsmoothed", src, lambda: shown.values() and all(
            v["smoothed"] == v["value"] for v in shown.values().values()))
        assert {r: v["value"] for r, v in shown.values().items()} == {r: v["value"] for r, v in norms.items()}
        assert not nb.console, nb.console
        print(f"run browser driven through the page in {time.time() - t0:.0f}s")
    except BaseException:
        nb.shot("end")
        nb.close()
        raise
    nb.shot("end")
    lab_page.close(save=True)
    _reopened_shows_the_overlay(lab_page, artefacts, nb.name, sorted(RUNS))


def _reopened_shows_the_overlay(lab_page, artefacts, name: str, runs: list[str]) -> None:
    """Saved and reopened (a fresh page, a new kernel): the run browser's output shows the last overlay as it was,
    drawn by plotly's renderer from the saved figure (its legend naming both runs, its y axis the last metric), the
    run table and the values table naming both runs, the status line, and the note that it is live again after
    re-running; no widget says its model is missing."""
    from workbench.widgets.layout import LIVE_NOTE

    page, console = reopen(lab_page.browser, lab_page.lab, artefacts, name)
    try:
        cell = page.locator(".jp-CodeCell").first
        chart, image = cell.locator(".js-plotly-plot"), cell.locator(".jp-OutputArea-output img")
        within(60, lambda: chart.count() >= 1)
        cell.scroll_into_view_if_needed()
        page.screenshot(path=str(artefacts / "screenshots" / f"{name}-reopened.png"), full_page=True)
        text = " ".join(cell.inner_text().split())
        assert "Error displaying widget" not in text and "model not found" not in text, text[-800:]
        print(f"[browser] {name} reopened: {chart.count()} plotly chart(s), {image.count()} image(s)")
        assert chart.count() >= 1, f"no plotly chart reopened ({image.count()} images): {text[-800:]!r}"
        import json

        plot = json.loads(chart.first.evaluate(PLOT_JS))  # the saved figure, drawn: the same legend and axis as live
        assert sorted(plot["legend"]) == runs and plot["ytitle"] == "grad norm" and plot["lines"], plot
        tables = page.evaluate(TABLES_JS, cell.element_handle())
        named = [t for t in tables if "run" in t["head"]]
        assert len(named) >= 2, tables  # the run table and the values table
        for t in named:
            assert sorted(r[t["head"].index("run")] for r in t["rows"]) == runs, t
        assert "2 runs with grad norm" in text, text[-800:]  # the status line as it was last
        assert LIVE_NOTE in text, text[-500:]
        assert not [c for c in console if "model not found" in c], console
    finally:
        close_page(page, lab_page.lab)
