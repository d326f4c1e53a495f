"""The browser tests' notebook pages and their run-all-and-reopen machinery (no tests here): a notebook of
``notebooks/`` opened in the worker's JupyterLab page (:class:`Notebook`; ``lab_page``, ``tests/browser/conftest.py``),
what its page shows, and :func:`runs_with_its_defaults_and_keeps_its_figures`: "Run All" with the notebook's defaults,
its checks on the page and on the copy JupyterLab saved, then the copy reopened in a fresh page (:func:`reopen`) and
its figures checked there (:func:`keeps_its_figures`).

The browser test files import these from here, never from each other: ``test_notebooks_in_jupyterlab.py`` (the
quickstart's and the planner's widgets), ``test_notebook_runs_browser.py``, ``test_long_notebook_runs_browser.py`` and
``test_widgets_reopened_browser.py`` (each notebook's run with its defaults), ``test_run_browser_browser.py`` (its
scratch notebook reopened).  Playwright, nbformat and nbconvert are imported inside the functions that use them.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import psutil

from tests.support import ROOT, run_processes
from tests.support.notebook_checks import check_shows, figure_names

NOTEBOOKS = ROOT / "notebooks"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TEXT_REPR = re.compile(r"^\s*(<?workbench\.|ConfigForm\(|Dashboard\(|MemoryPlanner\(|ScheduleExplorer\(|"
                       r"(VBox|HBox|Box|Tab|Accordion|Button|IntProgress|Image|HTML|Output|IntSlider)\()")

OUTPUTS_JS = """() => {
  const MIME = '%s';
  const nb = window.jupyterapp.shell.currentWidget.content;
  const out = [];
  nb.widgets.forEach((cell, ci) => {
    if (cell.model.type !== 'code') return;
    const outs = cell.model.outputs.toJSON();
    const children = Array.from(cell.outputArea.node.children);
    outs.forEach((o, oi) => {
      const child = children[oi];
      const node = child ? child.querySelector(':scope > .jp-OutputArea-output') : null;
      out.push({cell: ci, type: o.output_type, ename: o.ename || null, evalue: o.evalue || null,
                widget: !!(o.data && o.data[MIME]), model_id: o.data && o.data[MIME] ? o.data[MIME].model_id : null,
                rendered: !!(node && node.querySelector('.jupyter-widgets')),
                text: node ? node.innerText.slice(0, 400) : ''});
    });
  });
  return out;
}""" % WIDGET_MIME

#: an idle kernel and no cell running or queued in this many polls in a row, this many seconds apart: the cells ended
QUIET_POLLS, POLL_SECONDS = 6, 0.25

CELLS_JS = """() => {
  const nb = window.jupyterapp.shell.currentWidget.content;
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session?.kernel;
  const code = nb.widgets.filter(c => c.model.type === 'code');
  return {kernel: kernel ? kernel.status : null, count: code.length,
          counts: code.map(c => c.model.executionCount),
          running: code.filter(c => (c.promptNode?.textContent || '').includes('*')).length};
}"""


# Why a widget output is not drawn: whether the page's widget manager holds the view's model, whether the kernel still
# has its comm open, how many models each side holds, and whether the manager finished restoring from the kernel (before
# it has, a view whose model it lacks waits silently: "Loading widget..."; after, it says "model not found").
UNDRAWN_JS = """async (ids) => {
  const panel = window.jupyterapp.shell.currentWidget;
  let manager = null;
  for (const cell of panel.content.widgets) {
    if (cell.model.type !== 'code') continue;
    for (const area of cell.outputArea.widgets) for (const w of (area.widgets || [])) if (w._manager) manager = w._manager;
  }
  const m = manager ? await manager.promise : null;
  const kernel = panel.sessionContext.session?.kernel;
  let comms = null;
  try { comms = kernel ? (await kernel.requestCommInfo({target_name: 'jupyter.widget'})).content.comms || {} : null; } catch (e) {}
  return {manager_models: m ? Object.keys(m._models).length : null, kernel_comms: comms ? Object.keys(comms).length : null,
          manager_restored: m ? m.restoredStatus : null,
          views: ids.map(id => ({model_id: id, in_manager: m ? id in m._models : null, in_kernel: comms ? id in comms : null}))};
}"""


class Notebook:
    """One notebook open in the worker's JupyterLab page (``lab_page``); screenshots numbered by step."""

    def __init__(self, lab_page, artefacts: Path, name: str, parameters: dict, extra_cells: list[str] = ()):
        import nbformat

        lab = lab_page.lab
        self.name, self.artefacts, self.step, self.app = name, artefacts, 0, lab_page
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", []))
        injected = "# Parameters injected by the browser test (as papermill does)\n" + "".join(
            f"{k} = {v!r}\n" for k, v in parameters.items())
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(injected))
        # as papermill does: a notebook saved without a kernel would open on JupyterLab's kernel chooser
        nb.metadata.setdefault("kernelspec", {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"})
        for src in extra_cells:
            nb.cells.append(nbformat.v4.new_code_cell(src))
        nbformat.write(nb, lab["root"] / f"{name}.ipynb")
        for d in ("evidence",):  # 03 reads the committed GPU runs from ../evidence or ./evidence
            if not (lab["root"] / d).exists():
                (lab["root"] / d).symlink_to(ROOT / d)
        self.page = lab_page.page
        self._console_from = lab_page.open(f"{name}.ipynb")
        self.shot("opened")

    @property
    def console(self) -> list[str]:
        """The browser errors logged since this notebook was opened."""
        return self.app.console[self._console_from:]

    def shot(self, what: str) -> Path:
        self.step += 1
        print(f"[browser] {self.name} step {self.step}: {what}", flush=True)
        path = self.artefacts / "screenshots" / f"{self.name}-{self.step:02d}-{what}.png"
        self.page.screenshot(path=str(path))
        return path

    def command(self, name: str) -> None:
        """Start one of JupyterLab's commands (not awaited: a run command resolves only when its cells end)."""
        self.page.evaluate(f"() => {{ window.jupyterapp.commands.execute('{name}'); }}")

    def run_all(self, timeout: float) -> float:
        t0 = time.time()
        self.command("notebook:run-all-cells")
        self.wait_idle(timeout)
        return time.time() - t0

    def wait_idle(self, timeout: float) -> dict:
        end, quiet = time.time() + timeout, 0
        while time.time() < end:
            st = self.page.evaluate(CELLS_JS)
            quiet = quiet + 1 if st["kernel"] == "idle" and st["running"] == 0 else 0
            if quiet >= QUIET_POLLS:
                return st
            time.sleep(POLL_SECONDS)
        self.shot("timeout")
        raise AssertionError(f"{self.name}: cells still running after {timeout}s")

    def outputs(self) -> list[dict]:
        return self.page.evaluate(OUTPUTS_JS)

    def drawn_outputs(self, timeout: float = 60.0) -> list[dict]:
        """The outputs once every widget output is drawn (or says it cannot be): JupyterLab draws a widget
        view asynchronously after its cell ends, so an idle kernel does not mean a drawn page (on a loaded
        2-core machine the last view can lag the kernel by seconds). Bounded: a widget never drawn stays
        undrawn in what this returns, and the caller's assertion names it."""
        end = time.time() + timeout
        while True:
            outs = self.outputs()
            pending = [o for o in outs if o["widget"] and not o["rendered"] and "Error displaying widget" not in o["text"]]
            if not pending or time.time() > end:
                break
            time.sleep(POLL_SECONDS)
        undrawn = [o for o in outs if o["widget"] and (not o["rendered"] or "Error displaying widget" in o["text"])]
        if undrawn:  # say why, in the output the assertion prints: a view whose model never reached the page differs from a late one
            why = self.page.evaluate(UNDRAWN_JS, [o["model_id"] for o in undrawn])
            print(f"[browser] {self.name}: widget views not drawn: {why}", flush=True)
            for o, view in zip(undrawn, why["views"]):
                o["why"] = {**view, **{k: v for k, v in why.items() if k != "views"}}
        return outs

    def check_all_ran(self) -> list[dict]:
        """Every code cell ran, none failed, every widget is drawn as a widget; returns the outputs."""
        st = self.page.evaluate(CELLS_JS)
        outs = self.drawn_outputs()
        errors = [o for o in outs if o["type"] == "error"]
        assert not errors, f"{self.name}: cells failed: {errors}"
        assert all(c is not None for c in st["counts"]), f"{self.name}: cells that did not run: {st['counts']}"
        widgets = [o for o in outs if o["widget"]]
        assert widgets, f"{self.name}: no widget output at all"
        bad = [o for o in widgets if not o["rendered"] or "Error displaying widget" in o["text"]]
        assert not bad, f"{self.name}: widgets not drawn: {bad}"
        reprs = [o for o in outs if TEXT_REPR.match(o["text"] or "")]
        assert not reprs, f"{self.name}: text reprs instead of widgets: {reprs}"
        assert self.page.get_by_text("Error displaying widget").count() == 0
        return outs

    def last_cell(self):
        return self.page.locator(".jp-Notebook .jp-CodeCell").last

    def close(self) -> None:
        """Save the copy (awaited: the tests read the saved file next), close its tab and shut its kernel down."""
        self.app.close(save=True)


def wait_text(locator, pattern: str, timeout: float) -> str:
    end = time.time() + timeout
    text = ""
    while time.time() < end:
        try:
            text = locator.inner_text(timeout=5_000)
        except Exception:
            text = ""
        if re.search(pattern, text, re.S):
            return text
        time.sleep(POLL_SECONDS)
    raise AssertionError(f"timed out after {timeout}s waiting for /{pattern}/; text: {text[-1500:]!r}")


def alive(run_dir: str) -> list:
    return [p for p in run_processes(Path(run_dir)) if p.status() != psutil.STATUS_ZOMBIE]


# -- a notebook's run with its defaults: Run All, its checks, saved and reopened ---------------------------------------

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


def code_outputs(nb: Notebook) -> dict[int, list[dict]]:
    """Outputs by code-cell index (the page's cell index), from the page."""
    by: dict[int, list[dict]] = {}
    for o in nb.outputs():
        by.setdefault(o["cell"], []).append(o)
    return by


def watching_cells(nb: Notebook) -> list[int]:
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


def reopen(browser, lab, artefacts: Path, name: str):
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


def close_page(page, lab) -> None:
    session = page.evaluate("() => window.jupyterapp.shell.currentWidget?.sessionContext?.session?.id || null")
    page.close()
    if session:
        req = urllib.request.Request(f"{lab['url']}/api/sessions/{session}?token={lab['token']}", method="DELETE")
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except OSError:
            pass


def figures_not_widgets(nb: Notebook, watch_cells: list[int]) -> None:
    """The cells that watched a run show its figures as PNG outputs, not only a widget."""
    by_cell = code_outputs(nb)
    for i in watch_cells:
        assert not [o for o in by_cell.get(i, []) if o["widget"]], f"{nb.name}: cell {i} still holds the dashboard widget"


def saved_copy(lab, name: str):
    """The copy of the notebook as JupyterLab saved it (``Notebook.close``)."""
    import nbformat

    return nbformat.read(lab["root"] / f"{name}.ipynb", as_version=4)


#: the longest runs (~10 minutes together on a 2-core machine): ``test_long_notebook_runs_browser.py`` takes them, so
#: the two files go to two workers
LONG = ("07_bert", "08_t5", "09_moe")
#: the notebooks with an interactive widget: ``test_widgets_reopened_browser.py`` runs them, with every check here, and
#: then reopens their saved copy for its widget checks (one Run All of each, not one per file)
REOPENED = ("02_memory_planner", "03_pipeline_schedules")


def runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name: str, reopened=None):
    """Run All with the notebook's defaults, its checks on the page and on the saved copy, then reopened
    (:func:`keeps_its_figures`; ``reopened``: a caller's own checks of the reopened page, so that a notebook is reopened
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
        watch_cells = watching_cells(nb)
        figures_not_widgets(nb, watch_cells)
        _shows_live(nb)
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()  # saves the copy
    saved = saved_copy(lab, name)
    check_shows(saved, name)  # what the papermill run checked: tests/support/notebook_checks.py
    body, _ = HTMLExporter().from_notebook_node(saved)
    assert body.strip(), f"{name}: empty HTML export"
    _shows_like_its_family(name, shown, scales)
    keeps_its_figures(browser, lab, artefacts, nb, watch_cells, saved, body, then=reopened)
    return saved


def _saved_images(saved) -> dict[int, int]:
    """The PNG outputs of the saved copy a page draws as an <img>, by cell index (cells without one left out)."""
    counts = {i: sum(1 for o in c.get("outputs", []) if "image/png" in o.get("data", {})
                     and not any(m in o["data"] for m in RANKED_ABOVE_PNG))
              for i, c in enumerate(saved.cells) if c.cell_type == "code"}
    return {i: n for i, n in counts.items() if n}


def keeps_its_figures(browser, lab, artefacts: Path, nb: Notebook, watch_cells: list[int], saved, html: str,
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
    page, _console = reopen(browser, lab, artefacts, name)
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
        close_page(page, lab)
    assert html.count("data:image/png") >= max(len(watch_cells), sum(images.values())), f"{name}: the HTML export lacks figures"

