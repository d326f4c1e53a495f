"""The notebooks as a person sees them: JupyterLab in headless Chromium (see conftest.py for the set-up).

Each test opens a copy of a notebook with its CI parameters, runs every cell through JupyterLab's
own "run all" command, and asserts on the page: every widget output is drawn as a widget (no
"Error displaying widget", no text repr), no cell failed, the browser console logged no error;
then it uses the widgets: the config form's validation and launch button, the dashboard's
progress, loss plot, stacks and stop buttons during a CPU-mode run, the memory planner's numbers
and chart.  A screenshot of every step goes to ``<artefacts>/screenshots``.  03 (the pipeline schedules: its
explorer's chart drawn, the notebook's charts there) is checked on its one Run All in CI, with its defaults, in
``test_widgets_reopened_browser.py`` (``_shows_live`` in ``tests/support/browser_notebooks.py``).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.support.browser_notebooks import POLL_SECONDS, TEXT_REPR, Notebook, alive, wait_text

pytestmark = pytest.mark.slow


def _field_input(scope, label: str):
    """The <input> of an ipywidgets text/number field by its description label."""
    return scope.locator(".widget-inline-hbox", has=scope.page.locator(f"label.widget-label:text-is('{label}')")).locator("input").first


def _set(inp, value) -> None:
    inp.fill(str(value))
    inp.press("Enter")


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
        run2 = re.search(r"RUN2 (\S+)", wait_text(cell, r"RUN2 \S+", 60)).group(1)
        dash = cell.locator(".jupyter-widgets").first
        status = dash.locator(".widget-html").first
        wait_text(status, r"running.*iteration [1-9]", 180)
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
        assert alive(run2), "the stacks button ended the run"
        nb.shot("stacks")
        t_stop = time.time()
        dash.locator("button", has_text="stop").click()
        wait_text(cell, r"second run: stopped", 60)
        # the dashboard, turned into its final status line and figures
        wait_text(cell, r"stopped\s[\s\S]*iteration \d+/", 10)
        print(f"stop click -> watch returned in {time.time() - t_stop:.1f}s")
        end = time.time() + 10
        while alive(run2) and time.time() < end:
            time.sleep(0.2)
        assert not alive(run2), alive(run2)
        nb.shot("stopped")
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()


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
        wait_text(planner, r"not a valid layout", 30)
        end = time.time() + 10
        while planner.locator(".widget-output img").count() and time.time() < end:
            time.sleep(0.3)
        assert planner.locator(".widget-output img").count() == 0, "the previous chart stayed on an invalid layout"
        nb.shot("invalid-tp")
        assert not nb.console, nb.console
    finally:
        nb.shot("end")
        nb.close()
