"""The notebooks as a researcher runs them in JupyterLab (headless Chromium; set-up in conftest.py).

- Every notebook but the quickstart runs to the end through "Run All" with its own defaults (no parameter
  injected): this is the one run of each with its defaults in CI (``BROWSER_RUNS`` in
  ``tests/support/notebook_checks.py``; the quickstart's runs headless through papermill, in
  ``tests/notebooks/test_notebooks.py``, because its checks read what papermill's injected ``out_dir`` collects).
  On the page: no cell fails, every cell runs, every widget is drawn, the console stays clean; what it shows looks
  like what its model family does (BERT fills in words, T5 fills in its sentinels with words; the interleaved Gantt
  chart is drawn at a scale where its block labels are readable).  On the copy JupyterLab saved: the checks the
  papermill run applies (``check_shows``: written to the notebook convention, no error, every cell run, and the
  notebook's own checks of what it shows and of the runs it names), and it exports to HTML.
- Saved and reopened (a fresh page, a new kernel: every notebook this file, ``test_widgets_reopened_browser.py`` and
  ``test_long_notebook_runs_browser.py`` run), a notebook shows what it saved: every PNG output drawn again, nowhere on
  the page "model not found" or "Error displaying widget"; each cell that watched a run shows its named figures; its
  HTML export carries them too.
- Stop during "Run All" halts the notebook (the quickstart): the watching cell says so in one line and the cells
  below it do not run (no evaluation, no generation, no metrics written on the stopped run); saved and reopened, it
  keeps the figures of the run up to the stop (the quickstart's widgets and dashboard are otherwise used in
  ``test_notebooks_in_jupyterlab.py``).

The Run All and reopen machinery these files share is ``tests/support/browser_notebooks.py``'s.
A screenshot of every step goes to ``<artefacts>/screenshots``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.browser_notebooks import LONG, REOPENED, Notebook, alive, code_outputs, figures_not_widgets, \
    keeps_its_figures, runs_with_its_defaults_and_keeps_its_figures, saved_copy, wait_text, watching_cells
from tests.support.notebook_checks import BROWSER_RUNS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", [n for n in BROWSER_RUNS if n not in LONG + REOPENED])
def test_notebook_runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name):
    runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name)


def test_stop_during_run_all_halts_the_notebook(lab_page, browser, artefacts):
    """01 with a long run: "Run All", then stop from the dashboard while it trains; saved and reopened, the watching
    cell keeps the figures of the run up to the stop."""
    from nbconvert import HTMLExporter
    from playwright.sync_api import expect

    out = artefacts / "stop-out"
    lab = lab_page.lab
    nb = Notebook(lab_page, artefacts, "01_quickstart", {"steps": 5000, "out_dir": str(out)})
    page = nb.page
    try:
        nb.command("notebook:run-all-cells")
        watch_cell = watching_cells(nb)[0]
        cell = page.locator(".jp-Notebook .jp-Cell").nth(watch_cell)
        dash = cell.locator(".jupyter-widgets").first
        status = dash.locator(".widget-html").first
        wait_text(status, r"running.*iteration [1-9]", 300)
        shown = wait_text(page.locator(".jp-Notebook"), r"run directory: \S+", 10)
        run_dir = Path(re.search(r"run directory: (\S+)", shown).group(1))
        nb.shot("running")
        dash.locator("button", has_text="stop").click()
        nb.wait_idle(120)
        cell.locator(".jp-OutputArea-output").last.scroll_into_view_if_needed()
        nb.shot("stopped")
        outs = code_outputs(nb)
        errors = [o for o in nb.outputs() if o["type"] == "error"]
        # said as what happened to the run (wrapped between words), not as a traceback
        assert [e["ename"] for e in errors] == ["RunStopped"], errors
        assert errors[0]["cell"] == watch_cell
        said = " ".join(errors[0]["text"].split())
        assert said.startswith("The run was stopped at iteration") and "Traceback" not in said, said
        assert "(the stop button)" in said and "queued cell" in said, said  # Run All queued the cells below
        expect(cell.locator(".jp-OutputArea-output img").first).to_be_visible()  # the figures up to the stop
        figures_not_widgets(nb, [watch_cell])
        # nothing below it ran: no evaluation, no metrics, no generation on the stopped run
        counts = page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets.map(
            c => c.model.type === 'code' ? c.model.executionCount : 'md')""")
        below = [c for c in counts[watch_cell + 1:] if c != "md"]
        assert below and all(c is None for c in below), counts
        assert not any(outs.get(i) for i in range(watch_cell + 1, len(counts))), outs
        assert not (out / "metrics.json").exists()
        assert not alive(str(run_dir)), alive(str(run_dir))
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()  # saves the copy
    saved = saved_copy(lab, nb.name)
    body, _ = HTMLExporter().from_notebook_node(saved)
    keeps_its_figures(browser, lab, artefacts, nb, [watch_cell], saved, body)
