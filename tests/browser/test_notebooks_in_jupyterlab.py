"""The notebooks as a person sees them: JupyterLab in headless Chromium (see conftest.py for the set-up).

Each test opens a copy of a notebook with its CI parameters, runs every cell through JupyterLab's
own "run all" command, and asserts on the page: every widget output is drawn as a widget (no
"Error displaying widget", no text repr), no cell failed, the browser console logged no error;
then it uses the widgets: the config form's validation and launch button, the dashboard's
progress, loss plot, stacks and stop buttons during a CPU-mode run, the memory planner's numbers
and chart.  A screenshot of every step goes to ``<artefacts>/screenshots``.  03 (the pipeline schedules: its
explorer's chart drawn, the notebook's charts there) is checked on its one Run All in CI, with its defaults, in
``test_widgets_reopened_browser.py`` (``_shows_live`` in ``test_notebook_runs_browser.py``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from tests.support import ROOT, run_processes

pytestmark = pytest.mark.slow

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


def _field_input(scope, label: str):
    """The <input> of an ipywidgets text/number field by its description label."""
    return scope.locator(".widget-inline-hbox", has=scope.page.locator(f"label.widget-label:text-is('{label}')")).locator("input").first


def _set(inp, value) -> None:
    inp.fill(str(value))
    inp.press("Enter")


def _alive(run_dir: str) -> list:
    return [p for p in run_processes(Path(run_dir)) if p.status() != psutil.STATUS_ZOMBIE]


SECOND_RUN = """\
# a person's longer run from the same form, watched live; the test clicks "stacks", then "stop"
run2 = Run.launch(form.config.replace(**{"train.train_iters": 1000, "train.eval_interval": 0,
                                         "checkpoint.save_interval": 0, "checkpoint.save_on_exit": False}),
                  run_root=out_dir or "runs")
print("RUN2", run2.run_dir)
status2 = watch(run2, check=False)  # the stop is this test's own: it reads the status (a stop ends Run All: test_notebook_runs_browser.py)
print("second run:", status2)
"""


def test_quickstart_form_dashboard_and_stop(lab_page, artefacts):
    from playwright.sync_api import expect

    t0 = time.time()
    nb = Notebook(lab_page, artefacts, "01_quickstart",
                  {"ci": True, "steps": 6, "out_dir": str(artefacts / "quickstart-out"), "max_new_tokens": 8},
                  extra_cells=[SECOND_RUN])
    page = nb.page
    try:
        # run everything up to the person's extra cell: the notebook itself must pass
        cells = page.locator(".jp-Notebook .jp-Cell")
        n = cells.count()
        page.evaluate(f"() => {{ const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = {n - 1}; }}")
        nb.command("notebook:run-all-above")
        nb.wait_idle(420)
        nb.shot("ran-all")
        outs = nb.drawn_outputs()
        errors = [o for o in outs if o["type"] == "error"]
        assert not errors, errors
        widgets = [o for o in outs if o["widget"]]
        assert widgets and not [o for o in widgets if not o["rendered"]], [o for o in widgets if not o["rendered"]]  # the form (a finished run's dashboard turns into its figures)
        assert not [o for o in outs if TEXT_REPR.match(o["text"] or "")]
        assert page.get_by_text("Error displaying widget").count() == 0
        text = "\n".join(o["text"] for o in outs)
        assert "finished" in text and "->" in text, text[-3000:]  # the run finished and generation printed text
        print(f"01_quickstart ran in {time.time() - t0:.0f}s")

        # the config form: an invalid TP shows its message next to the field and disables launch
        form = page.locator(".jp-CodeCell", has=page.locator("button", has_text="launch")).first
        form.locator(".widget-tab .lm-TabBar-tab", has_text=re.compile(r"^\s*parallel\s*$")).first.click()
        tp = _field_input(form, "tensor_parallel")
        launch = form.locator("button", has_text="launch").first
        assert launch.is_enabled()
        _set(tp, 3)
        row = tp.locator("xpath=ancestor::div[contains(@class,'widget-hbox')][1]")
        page.wait_for_function("(el) => el.innerText.includes('\u26a0')", arg=row.element_handle(), timeout=20_000)
        expect(launch).to_be_disabled(timeout=10_000)
        assert "problem" in form.inner_text()
        nb.shot("form-invalid-tp")
        _set(tp, 1)
        page.wait_for_function("(el) => !el.innerText.includes('\u26a0')", arg=row.element_handle(), timeout=20_000)
        expect(launch).to_be_enabled(timeout=10_000)
        nb.shot("form-valid-again")

        # a longer run, watched live: progress and loss plot move, stacks answer, stop ends it
        page.evaluate(f"() => {{ const nb = window.jupyterapp.shell.currentWidget.content; nb.activeCellIndex = {n - 1}; }}")
        nb.command("notebook:run-cell")
        cell = nb.last_cell()
        run2 = re.search(r"RUN2 (\S+)", _wait_text(cell, r"RUN2 \S+", 60)).group(1)
        dash = cell.locator(".jupyter-widgets").first
        status = dash.locator(".widget-html").first
        _wait_text(status, r"running.*iteration [1-9]", 180)
        img = dash.locator("img").first
        first_src, first_status = img.get_attribute("src"), status.inner_text()
        first_bar = dash.locator(".progress-bar").first.get_attribute("style")
        nb.shot("dashboard-running")
        end = time.time() + 120
        while time.time() < end:
            if img.get_attribute("src") != first_src and dash.locator(".progress-bar").first.get_attribute("style") != first_bar:
                break
            time.sleep(POLL_SECONDS)
        else:
            raise AssertionError(f"the dashboard did not move: {first_status!r} -> {status.inner_text()!r}")
        assert status.inner_text() != first_status
        nb.shot("dashboard-updated")
        dash.locator("button", has_text="stacks").click()
        stacks = dash.locator(".widget-accordion .widget-html").nth(1)
        end = time.time() + 30
        while "rank 0" not in (stacks.text_content() or "") and time.time() < end:
            time.sleep(POLL_SECONDS)
        assert "rank 0" in stacks.text_content() and "File" in stacks.text_content(), stacks.text_content()[:500]
        assert _alive(run2), "the stacks button ended the run"
        nb.shot("stacks")
        t_stop = time.time()
        dash.locator("button", has_text="stop").click()
        _wait_text(cell, r"second run: stopped", 60)
        _wait_text(cell, r"stopped\s[\s\S]*iteration \d+/", 10)  # the dashboard, turned into its final status line and figures
        print(f"stop click -> watch returned in {time.time() - t_stop:.1f}s")
        end = time.time() + 10
        while _alive(run2) and time.time() < end:
            time.sleep(0.2)
        assert not _alive(run2), _alive(run2)
        nb.shot("stopped")
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()


def _wait_text(locator, pattern: str, timeout: float) -> str:
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


def test_memory_planner_numbers_and_chart(lab_page, artefacts):
    nb = Notebook(lab_page, artefacts, "02_memory_planner", {"ci": True})
    page = nb.page
    try:
        took = nb.run_all(240)
        nb.shot("ran-all")
        nb.check_all_ran()
        print(f"02_memory_planner ran in {took:.0f}s")
        planner = page.locator(".jp-CodeCell", has=page.locator("label.widget-label:text-is('micro-batch size')")).last
        mbs = _field_input(planner, "micro-batch size")
        status = planner.locator(".widget-html", has_text="worst").first
        before = status.inner_text()
        chart = planner.locator(".widget-output img").first
        chart.wait_for()
        src = chart.get_attribute("src")
        new = 1 if int(mbs.input_value()) != 1 else 2
        _set(mbs, new)
        end = time.time() + 30
        while status.inner_text() == before and time.time() < end:
            time.sleep(0.3)
        assert status.inner_text() != before, before
        end = time.time() + 30
        while time.time() < end and (not chart.count() or chart.get_attribute("src") == src):
            time.sleep(0.3)
        assert chart.get_attribute("src") != src, "the chart did not follow the micro-batch size"
        nb.shot(f"micro-batch-{new}")
        _set(_field_input(planner, "tensor parallel"), 3)
        _wait_text(planner, r"not a valid layout", 30)
        end = time.time() + 10
        while planner.locator(".widget-output img").count() and time.time() < end:
            time.sleep(0.3)
        assert planner.locator(".widget-output img").count() == 0, "the previous chart stayed on an invalid layout"
        nb.shot("invalid-tp")
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()
