"""The browser tests' scratch notebooks (no tests here): :class:`Scratch`, a notebook of the cells a test needs open in
the worker's JupyterLab page (``lab_page``, ``tests/browser/conftest.py``), its output area 1050 px wide once run, and
the ipywidgets controls on its page (:func:`field`, :func:`set_slider`).

Used by ``tests/browser/test_widgets_browser.py`` (its ``scratch`` and ``shared`` pages) and
``tests/browser/test_run_browser_browser.py``; test files import these from here, never from each other.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.support.browser_notebooks import POLL_SECONDS, QUIET_POLLS

OUTPUT_PX = 1050

STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session?.kernel;
  const code = w.content.widgets.filter(c => c.model.type === 'code');
  return {kernel: kernel ? kernel.status : null, counts: code.map(c => c.model.executionCount),
          running: code.filter(c => (c.promptNode?.textContent || '').includes('*')).length,
          errors: code.flatMap(c => c.model.outputs.toJSON().filter(o => o.output_type === 'error')
                                      .map(o => o.ename + ': ' + o.evalue))};
}"""


class Scratch:
    """A scratch notebook of ``cells`` open in the worker's JupyterLab page (``lab_page``), its output area 1050 px
    wide once run."""

    def __init__(self, lab_page, artefacts: Path, name: str, cells: list[str]):
        import nbformat

        self.name, self.artefacts, self.app, self.step = name, artefacts, lab_page, 0
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
        nbformat.write(nb, lab_page.lab["root"] / f"{name}.ipynb")
        self.page = lab_page.page
        self._console_from = lab_page.open(f"{name}.ipynb")

    @property
    def console(self) -> list[str]:
        """The browser errors logged since this notebook was opened."""
        return self.app.console[self._console_from:]

    def run_all(self, timeout: float) -> None:
        self.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        self.wait_idle(timeout)
        st = self.page.evaluate(STATE_JS)
        assert not st["errors"], f"{self.name}: cells failed: {st['errors']}"
        assert all(c is not None for c in st["counts"]), f"{self.name}: cells that did not run: {st['counts']}"
        self.fit()

    def wait_idle(self, timeout: float) -> None:
        end, quiet = time.time() + timeout, 0
        while time.time() < end:
            st = self.page.evaluate(STATE_JS)
            quiet = quiet + 1 if st["kernel"] == "idle" and st["running"] == 0 else 0
            if quiet >= QUIET_POLLS:
                return
            time.sleep(POLL_SECONDS)
        self.shot("timeout")
        raise AssertionError(f"{self.name}: cells still running after {timeout}s")

    def fit(self) -> None:
        """Resize the page so that the output area is 1050 px wide."""
        width = lambda: self.page.evaluate(  # noqa: E731
            "() => document.querySelector('.jp-OutputArea-output').getBoundingClientRect().width")
        for _ in range(3):
            w = width()
            if abs(w - OUTPUT_PX) <= 1:
                return
            vp = self.page.viewport_size
            self.page.set_viewport_size({"width": int(round(vp["width"] + OUTPUT_PX - w)), "height": vp["height"]})
            time.sleep(0.5)
        assert abs(width() - OUTPUT_PX) <= 1, width()

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-CodeCell").nth(index)

    def outputs(self, index: int):
        return self.cell(index).locator(".jp-OutputArea-output")

    def shot(self, what: str, locator=None) -> Path:
        self.step += 1
        path = self.artefacts / "screenshots" / f"widgets-{self.name}-{self.step:02d}-{what}.png"
        print(f"[browser] {self.name} step {self.step}: {what}", flush=True)
        try:
            if locator is not None:
                locator.scroll_into_view_if_needed(timeout=10_000)
                locator.screenshot(path=str(path), timeout=20_000, animations="disabled")
                return path
        except Exception as e:  # a picture is evidence, not the check: fall back to the viewport
            print(f"[browser] element screenshot failed ({e}); the page instead")
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        """Close its tab and shut its kernel down."""
        self.app.close(save=False)


def field(scope, label: str):
    """An ipywidgets control (input, dropdown or checkbox) by its description."""
    named = scope.page.locator(f"label.widget-label:text-is('{label}'), .widget-label-basic span:text-is('{label}')")
    return scope.locator(".widget-inline-hbox").filter(has=named).first


def set_slider(page, scope, label: str, value: int) -> None:
    slider = scope.locator(".widget-slider", has=page.locator(f"label.widget-label:text-is('{label}')")).first
    slider.locator(".widget-readout").click()
    page.keyboard.press("Control+A")
    page.keyboard.type(str(value))
    page.keyboard.press("Enter")

