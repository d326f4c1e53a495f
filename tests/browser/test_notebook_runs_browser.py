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

A screenshot of every step goes to ``<artefacts>/screenshots``.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from tests.browser.test_notebooks_in_jupyterlab import TEXT_REPR, Notebook, _alive, _wait_text
from tests.support.notebook_checks import BROWSER_RUNS, check_shows, figure_names

pytestmark = pytest.mark.slow

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
RUN_ALL_SECONDS = {"07_bert": 900, "08_t5": 600}
WATCH = re.compile(r"(^|\W)watch\(")

CELL_SOURCES_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  return nb.widgets.map(c => c.model.type === 'code' ? c.model.sharedModel.getSource() : null);
}"""

# what every cell's output area shows, in full
OUTPUT_TEXT_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map(
  c => c.model.type === 'code' ? c.outputArea.node.innerText : '').join('\\n')"""

# natural vs displayed width of every figure a cell output (PNG), e.g. the schedules notebook's Gantt charts
IMAGES_JS = """() => Array.from(document.querySelectorAll('.jp-RenderedImage img')).map(
  i => ({natural: i.naturalWidth, shown: i.getBoundingClientRect().width}))"""

# the <img> each cell's output area draws, by cell (the page's cells are the saved notebook's, in order)
CELL_IMAGES_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.map(
  c => c.model.type === 'code' ? c.outputArea.node.querySelectorAll('.jp-OutputArea-output img').length : 0)"""

#: the output types JupyterLab draws before a PNG when an output holds both (its renderers' ranks): a PNG output of the
#: saved copy counts as an image only without one of these (the run browser's figure carries plotly's JSON: plotly's renderer
#: draws it, not an <img>)
RANKED_ABOVE_PNG = (WIDGET_MIME, "application/vnd.plotly.v1+json", "application/javascript", "text/html", "text/markdown",
                    "image/svg+xml", "text/latex")

# a reopened notebook's page: its kernel started, or JupyterLab asking which to start
REOPENED_JS = """() => window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel?.status === 'idle'
  || Array.from(document.querySelectorAll('.jp-Dialog button')).some(b => b.innerText.trim() === 'Select')"""

# every widget output of the notebook on the page is drawn or says why not: none is missing or still "Loading widget..."
# (ipywidgets' renderer, until its model is found or the manager knows it will not be)
SETTLED_JS = """() => window.jupyterapp.shell.currentWidget.content.widgets.every(cell => {
  if (cell.model.type !== 'code') return true;
  const children = Array.from(cell.outputArea.node.children);
  return cell.model.outputs.toJSON().every((o, i) => {
    const view = o.data && o.data['%s'];
    if (!view || view.model_id === '') return true;
    const node = children[i] && children[i].querySelector(':scope > .jp-OutputArea-output');
    return !!node && !node.textContent.includes('Loading widget...');
  });
})""" % WIDGET_MIME


def _code_outputs(nb: Notebook) -> dict[int, list[dict]]:
    """Outputs by code-cell index (the page's cell index), from the page."""
    by: dict[int, list[dict]] = {}
    for o in nb.outputs():
        by.setdefault(o["cell"], []).append(o)
    return by


def _watch_cells(nb: Notebook) -> list[int]:
    sources = nb.page.evaluate(CELL_SOURCES_JS)
    return [i for i, s in enumerate(sources) if s is not None and WATCH.search(s)]


def _check_ran_to_the_end(nb: Notebook) -> list[dict]:
    st = nb.page.evaluate("""() => {
      const nb = window.jupyterapp.shell.currentWidget.content;
      return nb.widgets.filter(c => c.model.type === 'code').map(c => c.model.executionCount);
    }""")
    outs = nb.outputs()
    errors = [o for o in outs if o["type"] == "error"]
    assert not errors, f"{nb.name}: cells failed: {errors}"
    assert all(c is not None for c in st), f"{nb.name}: cells that did not run: {st}"
    # a widget is drawn, or it was closed by its own code (a finished progress bar: nothing left to show)
    bad = [o for o in outs if o["widget"] and ((not o["rendered"] and o["text"].strip()) or "Error displaying widget" in o["text"])]
    assert not bad, f"{nb.name}: widgets not drawn: {bad}"
    assert not [o for o in outs if TEXT_REPR.match(o["text"] or "")], f"{nb.name}: text reprs instead of widgets"
    return outs


def _shows_like_its_family(name: str, text: str, scales: list[dict]) -> None:
    """What the notebook showed (``text``: its outputs' text; ``scales``: its figures' natural and shown widths)
    looks like what its family does."""
    if name in ("07_bert", "08_t5"):
        from tests.support.notebook_checks import _demo_shipped, check_demo_bert, check_demo_t5

        model = "bert-tiny-kjv" if name == "07_bert" else "t5-tiny-kjv"
        if not _demo_shipped(model):  # the checkout lacks it: the notebook says so and how to make it
            assert f"the demo model {model!r} is not in this checkout" in text, text[-3000:]
            return
        assert "the demo model:" in text, text[-3000:]
        lines = [ln.strip() for ln in text.split("the demo model:", 1)[1].splitlines() if "[" in ln or "->" in ln]
        (check_demo_bert if name == "07_bert" else check_demo_t5)(lines)
    elif name == "03_pipeline_schedules":
        # block labels are 8.5 pt or more at 100 dpi (11.8 px in the PNG): shown at >= 85% they are >= 10 px
        imgs = [i for i in scales if i["natural"] >= 1000]
        assert imgs and all(i["shown"] / i["natural"] >= 0.85 for i in imgs), imgs


def _shows_live(nb: Notebook) -> None:
    """On the live page, before it is saved, for the notebooks with an interactive widget (:data:`REOPENED`): every
    widget drawn as a widget once its view arrives (``Notebook.check_all_ran``, stricter than every notebook's check);
    03's schedule explorer draws its chart and the notebook's charts are all there (once a run of its own in
    ``test_notebooks_in_jupyterlab.py``)."""
    if nb.name in REOPENED:
        nb.check_all_ran()
    if nb.name == "03_pipeline_schedules":
        page = nb.page
        explorer = page.locator(".jp-CodeCell", has=page.locator("label.widget-label:text-is('p (stages)')")).last
        explorer.locator(".widget-output img").first.wait_for()
        assert page.locator(".jp-OutputArea-output img").count() >= 5  # the charts of the notebook
        nb.shot("explorer")


def _reopen(browser, lab, artefacts: Path, name: str):
    """The saved copy opened again in a fresh page (a new kernel: no widget model survives), once every widget output
    has found its model (drawn) or said it cannot ("Error displaying widget"), or after a minute."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page = browser.new_page(viewport={"width": 1500, "height": 1100})
    page.set_default_timeout(60_000)
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
    page.goto(f"{lab['url']}/lab/workspaces/{name}-reopened/tree/{name}.ipynb?reset&token={lab['token']}")
    page.wait_for_function(REOPENED_JS, timeout=120_000)
    if page.locator(".jp-Dialog button", has_text="Select").count():
        page.locator(".jp-Dialog button", has_text="Select").click()
    page.wait_for_function("() => window.jupyterapp?.shell?.currentWidget?.content?.widgets?.length > 0", timeout=60_000)
    try:
        page.wait_for_function(SETTLED_JS, timeout=60_000, polling=250)
    except PlaywrightTimeout:  # the checks that follow say which
        print(f"[browser] {name} reopened: widget outputs still loading after a minute")
    return page, console


def within(seconds: float, ok) -> None:
    """Wait until ``ok()`` holds or ``seconds`` pass; the assertion that follows says which."""
    end = time.time() + seconds
    while not ok() and time.time() < end:
        time.sleep(0.25)


def _close(page, lab) -> None:
    session = page.evaluate("() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.id || null")
    page.close()
    if session:
        req = urllib.request.Request(f"{lab['url']}/api/sessions/{session}?token={lab['token']}", method="DELETE")
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except OSError:
            pass


def _figures_not_widgets(nb: Notebook, watch_cells: list[int]) -> None:
    """The cells that watched a run show its figures as PNG outputs, not only a widget."""
    by_cell = _code_outputs(nb)
    for i in watch_cells:
        assert not [o for o in by_cell.get(i, []) if o["widget"]], f"{nb.name}: cell {i} still holds the dashboard widget"


def _saved(lab, name: str):
    """The copy of the notebook as JupyterLab saved it (``Notebook.close``)."""
    import nbformat

    return nbformat.read(lab["root"] / f"{name}.ipynb", as_version=4)


#: the longest runs (~10 minutes together on a 2-core machine): ``test_long_notebook_runs_browser.py`` takes them, so
#: the two files go to two workers
LONG = ("07_bert", "08_t5", "09_moe")
#: the notebooks with an interactive widget: ``test_widgets_reopened_browser.py`` runs them, with every check here, and
#: then reopens their saved copy for its widget checks (one Run All of each, not one per file)
REOPENED = ("02_memory_planner", "03_pipeline_schedules")


@pytest.mark.parametrize("name", [n for n in BROWSER_RUNS if n not in LONG + REOPENED])
def test_notebook_runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name):
    runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name)


def runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name: str, reopened=None):
    """Run All with the notebook's defaults, its checks on the page and on the saved copy, then reopened
    (:func:`_keeps_its_figures`; ``reopened``: a caller's own checks of the reopened page, so that a notebook is reopened
    once); the saved copy (``nbformat``)."""
    from nbconvert import HTMLExporter

    lab = lab_page.lab
    nb = Notebook(lab_page, artefacts, name, {})
    try:
        took = nb.run_all(RUN_ALL_SECONDS.get(name, 300))
        nb.shot("ran-all")
        print(f"{name} ran with its defaults in {took:.0f}s")
        _check_ran_to_the_end(nb)
        shown = nb.page.evaluate(OUTPUT_TEXT_JS)
        scales = nb.page.evaluate(IMAGES_JS)
        watch_cells = _watch_cells(nb)
        _figures_not_widgets(nb, watch_cells)
        _shows_live(nb)
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()  # saves the copy
    saved = _saved(lab, name)
    check_shows(saved, name)  # what the papermill run checked: tests/support/notebook_checks.py
    body, _ = HTMLExporter().from_notebook_node(saved)
    assert body.strip(), f"{name}: empty HTML export"
    _shows_like_its_family(name, shown, scales)
    _keeps_its_figures(browser, lab, artefacts, nb, watch_cells, saved, body, then=reopened)
    return saved


def _saved_images(saved) -> dict[int, int]:
    """The PNG outputs of the saved copy a page draws as an <img>, by cell index (cells without one left out)."""
    counts = {i: sum(1 for o in c.get("outputs", []) if "image/png" in o.get("data", {})
                     and not any(m in o["data"] for m in RANKED_ABOVE_PNG))
              for i, c in enumerate(saved.cells) if c.cell_type == "code"}
    return {i: n for i, n in counts.items() if n}


def _keeps_its_figures(browser, lab, artefacts: Path, nb: Notebook, watch_cells: list[int], saved, html: str,
                       then=None) -> None:
    """Saved (``saved``: the copy's notebook; ``html``: its HTML export) and reopened in a fresh page: every PNG output
    the copy holds is drawn again (an <img> in its cell's output area), the page nowhere says "model not found" or
    "Error displaying widget" (with ``WORKBENCH_STOCK_JUPYTERLAB=1`` a saved widget output says it, as
    docs/notebooks.md warns: not checked then); every cell that watched a run shows its named figures.  ``then``: more
    checks on the reopened page (``page`` -> None), before it is closed."""
    name = nb.name
    shown = {}
    for i in watch_cells:
        data = [o.get("data", {}) for o in saved.cells[i].get("outputs", [])]
        shown[i] = figure_names(saved.cells[i])
        assert "training" in shown[i] and None not in shown[i], f"{name}: cell {i} saved without its named figures: {shown[i]}"
        assert not any(WIDGET_MIME in d for d in data), f"{name}: cell {i} saved a widget a reopened notebook cannot show"
    images = _saved_images(saved)
    stock = os.environ.get("WORKBENCH_STOCK_JUPYTERLAB") == "1" and any(
        WIDGET_MIME in o.get("data", {}) for c in saved.cells if c.cell_type == "code" for o in c.get("outputs", []))
    t0 = time.time()
    page, _console = _reopen(browser, lab, artefacts, name)
    try:
        def lost() -> dict[int, str]:
            now = page.evaluate(CELL_IMAGES_JS)
            return {i: f"{now[i] if i < len(now) else 0} of {n}" for i, n in images.items() if i >= len(now) or now[i] < n}

        within(30, lambda: not lost())
        page.screenshot(path=str(artefacts / "screenshots" / f"{name}-{nb.step + 1:02d}-reopened.png"))
        missing = lost()
        assert not missing, f"{name} reopened: cells whose saved PNG outputs are not drawn again (drawn of saved): {missing}"
        print(f"{name} reopened in {time.time() - t0:.0f}s: {sum(images.values())} saved PNG outputs in {len(images)} cells, "
              "drawn again")
        text = page.locator("body").inner_text()
        said = [ln for ln in text.splitlines() if "model not found" in ln or "Error displaying widget" in ln]
        assert stock or not said, f"{name} reopened: {said}"
        cells = page.locator(".jp-Notebook .jp-Cell")
        for k, i in enumerate(watch_cells):
            cell = cells.nth(i)
            imgs = cell.locator(".jp-OutputArea-output img")
            within(30, lambda: imgs.count() >= len(shown[i]))
            cell.scroll_into_view_if_needed()
            page.screenshot(path=str(artefacts / "screenshots" / f"{name}-{nb.step + 1 + k:02d}-reopened-cell-{i}.png"))
            # every figure it saved (the router dashboard of an MoE run too), drawn again
            assert imgs.count() >= len(shown[i]), f"{name}: reopened cell {i}: {shown[i]}"
            assert "Error displaying widget" not in cell.inner_text(), f"{name}: reopened cell {i}: {cell.inner_text()[:500]}"
        if then is not None:
            then(page)
    finally:
        _close(page, lab)
    assert html.count("data:image/png") >= max(len(watch_cells), sum(images.values())), f"{name}: the HTML export lacks figures"


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
        watch_cell = _watch_cells(nb)[0]
        cell = page.locator(".jp-Notebook .jp-Cell").nth(watch_cell)
        dash = cell.locator(".jupyter-widgets").first
        status = dash.locator(".widget-html").first
        _wait_text(status, r"running.*iteration [1-9]", 300)
        run_dir = Path(re.search(r"run directory: (\S+)", _wait_text(page.locator(".jp-Notebook"), r"run directory: \S+", 10)).group(1))
        nb.shot("running")
        dash.locator("button", has_text="stop").click()
        nb.wait_idle(120)
        cell.locator(".jp-OutputArea-output").last.scroll_into_view_if_needed()
        nb.shot("stopped")
        outs = _code_outputs(nb)
        errors = [o for o in nb.outputs() if o["type"] == "error"]
        # said as what happened to the run (wrapped between words), not as a traceback
        assert [e["ename"] for e in errors] == ["RunStopped"], errors
        assert errors[0]["cell"] == watch_cell
        said = " ".join(errors[0]["text"].split())
        assert said.startswith("The run was stopped at iteration") and "Traceback" not in said, said
        assert "(the stop button)" in said and "queued cell" in said, said  # Run All queued the cells below
        expect(cell.locator(".jp-OutputArea-output img").first).to_be_visible()  # the figures up to the stop
        _figures_not_widgets(nb, [watch_cell])
        # nothing below it ran: no evaluation, no metrics, no generation on the stopped run
        counts = page.evaluate("""() => window.jupyterapp.shell.currentWidget.content.widgets.map(
            c => c.model.type === 'code' ? c.model.executionCount : 'md')""")
        below = [c for c in counts[watch_cell + 1:] if c != "md"]
        assert below and all(c is None for c in below), counts
        assert not any(outs.get(i) for i in range(watch_cell + 1, len(counts))), outs
        assert not (out / "metrics.json").exists()
        assert not _alive(str(run_dir)), _alive(str(run_dir))
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()  # saves the copy
    saved = _saved(lab, nb.name)
    body, _ = HTMLExporter().from_notebook_node(saved)
    _keeps_its_figures(browser, lab, artefacts, nb, [watch_cell], saved, body)
