"""The widgets and tables as a person reads them: JupyterLab in headless Chromium (conftest.py), every
page's output area 1050 px wide, checked by geometry (bounding boxes, line boxes, scroll widths), with
a screenshot of each step in ``<artefacts>/screenshots``.

- tables (the memory plan of 01, 02, 07 and 08; 02's frames and its GPU-evidence table): HTML tables
  whose every cell is one line and which fit the output; no printed text table;
- the memory planner, the config form and the schedule explorer: no input, dropdown or label clipped
  or scrolled, also after an edit;
- the schedule explorer: two quick changes that end on a refused layout leave no chart under the refusal;
- the dashboard: a one-line status line for a nested run directory, the loss axis over the iterations
  so far, "no GPU memory on CPU", "1 micro-batch";
- the config form: each family's and device's fields, switching as arch and device change; the MoE settings
  an optional group, collapsed on a dense config;
- a message shown with ``say``: its lines wrap between words, never inside one.

The notebook pages here are scratch notebooks: the cells a test needs, some copied verbatim from the
repository's notebooks (the cells that show a plan), so a notebook that went back to printing the text
table fails here.  The tests that each show a few widgets share one scratch notebook (``shared``: one kernel and
one Run All for all of them, each test's cells a group of their own that only that test reads and drives);
02 runs whole in a notebook of its own.  Each opens in the worker's JupyterLab page (``lab_page``, conftest.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.browser_widgets import Scratch, field, set_slider

pytestmark = pytest.mark.slow

NOTEBOOKS = ROOT / "notebooks"

# every th / td of every table under a root: its line boxes (a wrapped cell has more than one),
# and each table's width against its output's
TABLES_JS = """(root) => {
  const lines = (el) => {
    const r = document.createRange(); r.selectNodeContents(el);
    return new Set(Array.from(r.getClientRects()).filter(b => b.width > 0).map(b => Math.round(b.top))).size;
  };
  return Array.from(root.querySelectorAll('table')).map(t => {
    const out = t.closest('.jp-OutputArea-output');
    const cells = Array.from(t.querySelectorAll('th, td')).filter(c => c.innerText.trim());
    return {rows: t.querySelectorAll('tr').length, width: t.getBoundingClientRect().width,
            output: out ? out.getBoundingClientRect().width : null,
            wrapped: cells.filter(c => lines(c) > 1).map(c => c.innerText.trim()).slice(0, 8)};
  });
}"""

# every control (ipywidgets' inline boxes: text / number inputs, dropdowns, sliders, checkboxes) under a
# root that is shown: clipped input text or label, a control sticking out of its container, a container
# that scrolls (narrower than its content, or scrolled sideways after an edit)
CLIPPED_JS = """(root) => {
  const bad = [];
  const shown = (el) => el.offsetParent !== null;
  root.querySelectorAll('.widget-inline-hbox').forEach(ctl => {
    if (!shown(ctl)) return;
    const label = ctl.querySelector('label.widget-label');
    const span = ctl.querySelector('.widget-label-basic span');
    const name = (span && span.innerText.trim()) || (label && label.innerText.trim()) || ctl.innerText.trim().slice(0, 30);
    const inp = ctl.querySelector('input:not([type=checkbox]), select, textarea');
    if (inp && inp.scrollWidth > inp.clientWidth + 1) bad.push(name + ': its text is wider than its box');
    if (label && label.innerText.trim() && label.scrollWidth > label.clientWidth + 1) bad.push(name + ': label cut');
    const r = ctl.getBoundingClientRect();
    for (let p = ctl.parentElement; p && p !== root.parentElement; p = p.parentElement) {
      if (!p.classList.contains('widget-box') && !p.classList.contains('jp-OutputArea-output')) continue;
      const q = p.getBoundingClientRect();
      if (r.right > q.right + 1 || r.left < q.left - 1) bad.push(name + ': sticks out of ' + p.className.split(' ').slice(-1)[0]);
      if (p.scrollWidth > p.clientWidth + 1) bad.push(name + ': its container scrolls (' + p.scrollWidth + ' > ' + p.clientWidth + ')');
      if (p.scrollLeft !== 0) bad.push(name + ': its container is scrolled by ' + p.scrollLeft + 'px');
    }
    if (inp) {  // the box itself, not only its text: inside the control
      const b = inp.getBoundingClientRect();
      if (b.right > r.right + 1) bad.push(name + ': box cut at the right');
    }
  });
  return Array.from(new Set(bad));
}"""


@pytest.fixture
def scratch(lab_page, artefacts):
    pages: list[Scratch] = []

    def make(name: str, cells: list[str]) -> Scratch:
        pages.append(Scratch(lab_page, artefacts, name, cells))
        return pages[-1]

    yield make
    for p in pages:
        try:
            p.shot("end")
        finally:
            p.close()


def _shared_groups(run_root: Path) -> list[tuple[str, list[str]]]:
    """The cells of the one-widget tests below, each test's cells a contiguous group (its own variables, so no group's
    widget is another's): (the test's name, its cells)."""
    def form(var: str) -> str:
        return ("from workbench.config import preset\nfrom workbench.widgets.config_form import ConfigForm\n"
                f"{var} = ConfigForm(preset('tiny', **{{'parallel.device': 'cpu'}}))\n{var}")

    return [
        ("plan_cells", [c for name, setup, needle in PLAN_CELLS for c in (setup, _notebook_cell(name, needle))]),
        ("planner_inputs", [PLANNER]),
        ("form_explorer_inputs", [form("form_inputs"), "from workbench.widgets.schedule import ScheduleExplorer\n"
                                                       "ex_inputs = ScheduleExplorer(p=4, m=8, v=2)\nex_inputs"]),
        ("explorer_race", ["from workbench.widgets.schedule import ScheduleExplorer\n"
                           "ex_race = ScheduleExplorer(p=4, m=8, v=2, schedule='interleaved')\nex_race"]),
        ("dashboard", [f"RUN_ROOT = {str(run_root)!r}\n" + DASHBOARD, DASHBOARD_FIGURE,
                       "from workbench.widgets.config_form import ConfigForm\n"
                       "form_dash = ConfigForm(cfg)\nprint(form_dash.report().splitlines()[0])"]),
        ("form_fields", [form("form_fields")]),
        ("moe_group_say", [form("form_moe"), "from workbench.config import ConfigError\nfrom workbench.notebook import say\n"
                           "try:\n    preset('t5-tiny', **{'parallel.pipeline_parallel': 2, 'parallel.nproc_per_node': 2}).check()\n"
                           "except ConfigError as e:\n    say(e, e)"]),
    ]


@pytest.fixture(scope="module")
def shared(lab_page, artefacts):
    """One scratch notebook (one kernel, one Run All) for the tests that each show a few widgets: every test's cells
    (:func:`_shared_groups`) run once through "Run All"; a test reads and drives only the outputs of its own cells.
    ``(page, {test name: the index of its first code cell})``.  Its notebook stays open in the worker's page until the
    module ends, so the one test on a ``scratch`` notebook of its own comes first in this file (pytest runs in file
    order; ``LabPage.open`` refuses to open a second notebook beside one still open)."""
    import shutil

    root = artefacts / "widgets-dashboard-runs"
    shutil.rmtree(root, ignore_errors=True)
    cells, at = [], {}
    for name, group in _shared_groups(root):
        at[name] = len(cells)
        cells += group
    page = None
    try:
        page = Scratch(lab_page, artefacts, "shared", cells)
        page.run_all(300)
        page.console_after_run = page.console  # what Run All logged; each test then checks only its own
        yield page, at
    finally:
        try:
            if page is not None:
                page.shot("end")
        finally:
            if page is not None:
                page.close()
            shutil.rmtree(root, ignore_errors=True)


def _notebook_cell(name: str, needle: str) -> str:
    """The source of the one code cell of notebooks/<name>.ipynb that contains ``needle``."""
    nb = json.loads((NOTEBOOKS / f"{name}.ipynb").read_text())
    found = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code" and needle in "".join(c["source"])]
    assert len(found) == 1, f"notebooks/{name}.ipynb: {len(found)} code cells contain {needle!r} (its plan cell)"
    return found[0]


def _tables_readable(page, root, what: str, at_least: int = 1) -> list[dict]:
    tables = page.evaluate(TABLES_JS, root.element_handle())
    assert len(tables) >= at_least, f"{what}: {len(tables)} tables, expected at least {at_least}"
    for t in tables:
        assert not t["wrapped"], f"{what}: cells wrapped over lines: {t['wrapped']}"
        assert t["output"] is None or t["width"] <= t["output"] + 1, f"{what}: a table {t['width']:.0f}px wide in {t['output']:.0f}px"
    return tables


def _not_clipped(page, root, what: str) -> None:
    bad = page.evaluate(CLIPPED_JS, root.element_handle())
    assert not bad, f"{what}: {bad}"


# --------------------------------------------------------------------------- item: tables


def test_memory_planner_notebook_tables_are_one_line_per_row(scratch):
    """02 as a whole (its memory plans, frames and the GPU-evidence table): every table fits the output
    and no cell wraps; no text table printed."""
    import nbformat

    nb = nbformat.read(NOTEBOOKS / "02_memory_planner.ipynb", as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    cells.insert(sum(1 for c in nb.cells[:at + 1] if c.cell_type == "code"), "ci = True")
    page = scratch("02_tables", cells)
    page.run_all(300)
    notebook = page.page.locator(".jp-Notebook")
    tables = _tables_readable(page.page, notebook, "02_memory_planner", at_least=5)
    plans = page.page.locator(".jp-OutputArea-output .workbench-plan")
    assert plans.count() >= 2, "02 shows its two memory plans as tables"
    page.shot("plan-table", plans.first)
    evidence = page.page.locator(".jp-OutputArea-output", has_text="alloc err %").last
    if evidence.count():
        page.shot("gpu-evidence-table", evidence)
    text = page.page.evaluate("() => Array.from(document.querySelectorAll('.jp-OutputArea-output pre'))"
                              ".map(p => p.innerText).join('\\n')")
    assert "(GiB)" not in text, "a memory plan printed as a text table"
    print(f"02: {len(tables)} tables, widest {max(t['width'] for t in tables):.0f}px")
    assert not page.console, page.console


#: the notebooks whose cell shows a memory plan: (notebook, the set-up that cell needs, a text only that cell holds)
PLAN_CELLS = [
    ("01_quickstart", "from workbench.config import preset\nfrom workbench.widgets.config_form import ConfigForm\n"
                      "form = ConfigForm(preset('tiny', **{'parallel.device': 'cpu'}))", "form.report()"),
    ("07_bert", "from workbench.config import preset\ncfg = preset('bert-tiny', **{'parallel.device': 'cpu'})", "plan_table("),
    ("08_t5", "from workbench.config import preset\ncfg = preset('t5-tiny', **{'parallel.device': 'cpu'})", "plan_table("),
]


def test_notebook_plan_cells_show_a_table(shared):
    """The cell of 01, 07 and 08 that shows a memory plan (copied from the notebook): an HTML table, one line per row.
    Each after its own set-up on the shared page (its group: set-up, plan cell, set-up, plan cell, ...)."""
    page, at = shared
    for k, (name, _, _) in enumerate(PLAN_CELLS):
        i = at["plan_cells"] + 2 * k + 1
        out = page.outputs(i)
        assert out.count() >= 1 and not out.locator("pre", has_text="(GiB)").count(), f"{name}: the plan printed as text"
        _tables_readable(page.page, page.cell(i), name)
        page.shot(f"{name}-plan", out.first)


# --------------------------------------------------------------------------- item: clipped inputs


PLANNER = ("from workbench.config import preset\nfrom workbench.widgets.planner import MemoryPlanner\n"
           "big = preset('gpt2-large', **{'parallel.tensor_parallel': 2, 'parallel.nproc_per_node': 4,"
           " 'train.micro_batch_size': 32, 'train.global_batch_size': 128})\n"
           "w = MemoryPlanner(big, gpu='A100-40GB')\nw")


def test_memory_planner_inputs_are_never_clipped(shared):
    page, at = shared
    ui = page.outputs(at["planner_inputs"]).first
    ui.locator(".widget-output img").first.wait_for()
    _not_clipped(page.page, ui, "planner")
    page.shot("planner", ui)
    box = ui.locator(".widget-inline-hbox", has=page.page.locator("label.widget-label:text-is('micro-batches/step')"))
    inp = box.locator("input").first
    inp.click()
    inp.fill("16")
    inp.press("Enter")
    page.wait_idle(30)  # the kernel re-planned
    assert inp.input_value() == "16"
    # the edit left the focus in the box: nothing scrolled sideways, the label whole
    assert inp.evaluate("el => document.activeElement === el")
    _not_clipped(page.page, ui, "planner after editing micro-batches/step")
    label = box.locator("label.widget-label")
    assert label.inner_text() == "micro-batches/step"
    lb, bb = label.bounding_box(), box.bounding_box()
    assert lb["x"] >= bb["x"] - 1, (lb, bb)
    page.shot("planner-edited", ui)


def test_config_form_and_schedule_explorer_inputs_are_never_clipped(shared):
    page, at = shared
    form = page.outputs(at["form_explorer_inputs"]).first
    for tab in ("model", "parallel", "train", "data", "checkpoint"):
        form.locator(".lm-TabBar-tab", has_text=re.compile(rf"^\s*{tab}\s*$")).first.click()
        time.sleep(0.3)
        _not_clipped(page.page, form, f"config form, {tab} tab")
    _tables_readable(page.page, form, "config form's memory plan")
    page.shot("config-form", form)
    explorer = page.outputs(at["form_explorer_inputs"] + 1).first
    _not_clipped(page.page, explorer, "schedule explorer")
    page.shot("schedule-explorer", explorer)


# --------------------------------------------------------------------------- item: stale chart


def test_schedule_explorer_never_leaves_a_chart_under_a_refusal(shared):
    """Two changes within ~0.1 s, the second refused (p=2 then m=9, interleaved): the chart goes; back to a
    valid layout, one chart comes back."""
    page, at = shared
    pg = page.page
    ui = page.outputs(at["explorer_race"]).first
    status, charts = ui.locator(".widget-html").first, ui.locator(".widget-output img")
    charts.first.wait_for()
    stale = []
    for attempt in range(4):
        set_slider(pg, ui, "p (stages)", 2)
        time.sleep(0.1)
        set_slider(pg, ui, "m (micro-b.)", 9)
        end = time.time() + 20
        while "m=9" not in status.inner_text() and time.time() < end:
            time.sleep(0.2)
        assert "refused" in status.inner_text() and "m=9" in status.inner_text(), status.inner_text()
        page.wait_idle(30)
        time.sleep(1.5)  # what a late echo of the previous chart would need to come back
        if charts.count():
            stale.append(attempt)
            page.shot(f"stale-chart-{attempt}", ui)
        set_slider(pg, ui, "p (stages)", 4)
        time.sleep(0.1)
        set_slider(pg, ui, "m (micro-b.)", 8)
        end = time.time() + 20
        while ("bubble" not in status.inner_text() or charts.count() != 1) and time.time() < end:
            time.sleep(0.2)
        assert "bubble" in status.inner_text() and charts.count() == 1, (status.inner_text(), charts.count())
    assert not stale, f"a chart stayed under the refusal in attempts {stale} of 4"
    page.shot("explorer-valid", ui)


# --------------------------------------------------------------------------- item: dashboard


DASHBOARD = """\
import math
from pathlib import Path
from workbench.config import preset
from workbench.run.events import EventWriter
from workbench.launch import Run
from workbench.widgets.dashboard import Dashboard

# a CPU run 40 iterations into 1000, in a nested run directory (the rank's own event writer)
rd = Path(RUN_ROOT) / "bert" / "sweep-3" / "very-long-run-directory-name-20261125-183500-abcdef"
rd.mkdir(parents=True)
cfg = preset("tiny", **{"parallel.device": "cpu", "train.train_iters": 1000, "train.global_batch_size": 4,
                        "train.micro_batch_size": 4})
cfg.save(rd / "config.json")
writer = EventWriter(rd, 0)
writer.emit("run_start", config=cfg.to_dict(), world_size=1, kernel_path={})
for i in range(1, 41):
    writer.emit("step", iteration=i, loss=5 * math.exp(-i / 20) + 1, step_time=0.05, tokens_per_s=1000.0 + i,
                lr=3e-4, grad_norm=1.0)
writer.close()
dash = Dashboard(Run.attach(rd), autostart=False)
dash
"""

DASHBOARD_FIGURE = """\
from workbench.plots.training import frames_from_run, training_figure

fig = training_figure(frames_from_run(dash.run), dash.predicted_memory)  # what the dashboard draws
memory = next(ax for ax in fig.axes if ax.get_title().startswith("memory per rank"))
print("LOSS_XMAX", fig.axes[0].get_xlim()[1])
print("MEMORY_TEXT", [t.get_text() for t in memory.texts], "BARS", len(memory.patches))
"""


def test_the_shared_page_ran_all_with_a_clean_console(shared):
    """Run All of the shared page's cells logged no browser error (each test below checks what it logs itself)."""
    page, _ = shared
    assert not page.console_after_run, page.console_after_run


def test_dashboard_status_charts_and_wording(shared):
    page, at = shared
    logged = len(page.console)  # the shared page's console: this test's entries only
    i = at["dashboard"]
    pg, dash = page.page, page.outputs(i).first
    status = dash.locator(".widget-html").first
    stop = dash.locator("button", has_text="stop")
    text = status.inner_text()
    assert re.search(r"running\s+iteration 40/1000", text), text
    assert "very-long-run-directory-name" in text and "\n" not in text.strip(), text
    sb, bb = status.bounding_box(), stop.bounding_box()
    line = status.evaluate("el => parseFloat(getComputedStyle(el.querySelector('div') || el).lineHeight) || 20")
    assert sb["height"] <= 1.6 * max(line, bb["height"]), f"the status line wraps: {sb['height']}px"
    assert sb["x"] + sb["width"] <= bb["x"] + 1, "the status line runs under the stop button"
    visible = status.evaluate("""el => {  // the iteration is inside the status box, not cut off
        const r = document.createRange(), w = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
        let n; while ((n = w.nextNode())) { if (n.textContent.includes('iteration')) { r.selectNodeContents(n); break; } }
        const b = r.getBoundingClientRect(), o = el.getBoundingClientRect();
        return b.width > 0 && b.right <= o.right + 1; }""")
    assert visible, "the iteration count is cut off"
    _not_clipped(pg, dash, "dashboard")
    page.shot("dashboard", dash)
    printed = page.outputs(i + 1).first.inner_text()
    xmax = float(re.search(r"LOSS_XMAX (\S+)", printed).group(1))
    assert xmax < 100, f"the loss axis spans {xmax} iterations for a run 40 iterations in"
    assert "['no GPU memory on CPU'] BARS 0" in printed, printed
    wording = page.outputs(i + 2).first.inner_text()
    assert "1 micro-batch per step" in wording and "micro-batches" not in wording, wording
    assert not page.console[logged:], page.console[logged:]


# --------------------------------------------------------------------------- item: config form fields


def _tab(scope, name: str) -> None:
    scope.locator(".lm-TabBar-tab", has_text=re.compile(rf"^\s*{name}\s*$")).first.click()
    time.sleep(0.3)


def _wait_visible(locator, visible: bool, what: str, timeout: float = 20) -> None:
    end = time.time() + timeout
    while locator.is_visible() != visible and time.time() < end:
        time.sleep(0.2)
    assert locator.is_visible() == visible, f"{what} should be {'shown' if visible else 'hidden'}"


def test_config_form_shows_each_family_and_devices_fields(shared):
    page, at = shared
    logged = len(page.console)  # the shared page's console: this test's entries only
    form = page.outputs(at["form_fields"]).first
    t5_only = ("decoder_num_layers", "decoder_seq_length", "relative_attention_num_buckets", "relative_attention_max_distance")
    _tab(form, "model")
    assert field(form, "num_layers").is_visible()
    for label in t5_only:
        _wait_visible(field(form, label), False, f"GPT form: {label}")
    page.shot("gpt-cpu-model", form)
    _tab(form, "train")
    assert field(form, "train_iters").is_visible()
    for label in ("cuda_graphs", "compile_kernels", "fp8"):
        _wait_visible(field(form, label), False, f"CPU: {label}")
    page.shot("gpt-cpu-train", form)
    _tab(form, "parallel")
    _wait_visible(field(form, "tp_comm_overlap"), False, "CPU: tp_comm_overlap")
    field(form, "device").locator("select").select_option("cuda")  # live: the device field alone switches them
    _wait_visible(field(form, "tp_comm_overlap"), True, "CUDA: tp_comm_overlap")
    _tab(form, "train")
    _wait_visible(field(form, "cuda_graphs"), True, "CUDA: cuda_graphs")
    page.shot("gpt-cuda-train", form)
    _tab(form, "model")
    field(form, "arch").locator("select").select_option("t5")
    for label in t5_only:
        _wait_visible(field(form, label), True, f"T5 form: {label}")
    _wait_visible(field(form, "num_tokentypes"), False, "T5 form: BERT's num_tokentypes")
    page.shot("t5-model", form)
    field(form, "arch").locator("select").select_option("bert")
    for label in t5_only:
        _wait_visible(field(form, label), False, f"BERT form: {label}")
    _wait_visible(field(form, "num_tokentypes"), True, "BERT form: num_tokentypes")
    _not_clipped(page.page, form, "config form")
    page.shot("bert-model", form)
    assert not page.console[logged:], page.console[logged:]


# every line break inside the preformatted lines under a root: the text either side of it (a break between words
# has a space or a hyphen before it), and each line's computed word-break
BREAKS_JS = """(root) => {
  const inside = [], styles = [];
  let breaks = 0;
  root.querySelectorAll('pre').forEach(pre => {
    styles.push(getComputedStyle(pre).wordBreak);
    const node = pre.firstChild;
    if (!node || node.nodeType !== Node.TEXT_NODE) return;
    const text = node.textContent, r = document.createRange();
    let last = null;
    for (let i = 0; i < text.length; i++) {
      r.setStart(node, i); r.setEnd(node, i + 1);
      const rects = r.getClientRects();
      if (!rects.length) continue;
      const top = Math.round(rects[0].top);
      if (last !== null && top > last + 2) {
        breaks++;
        if (!' -'.includes(text[i - 1]) && text[i] !== ' ') inside.push(text.slice(Math.max(0, i - 12), i) + '|' + text.slice(i, i + 12));
      }
      last = top;
    }
  });
  return {inside, styles, breaks};
}"""


def test_moe_settings_are_an_optional_group_and_messages_wrap_between_words(shared):
    """The config form's MoE settings: a collapsed group labelled optional on a dense GPT config, its switch alone in
    it until it is set, every field a widget, gone for BERT; and a long message shown with ``say`` wraps between
    words where JupyterLab's own ``pre`` would cut words ("di/vides")."""
    page, at = shared
    logged = len(page.console)  # the shared page's console: this test's entries only
    form = page.outputs(at["moe_group_say"]).first
    _tab(form, "model")
    group = form.locator(".lm-AccordionPanel-title, .jupyter-widget-Collapse-header, .p-Collapse-header",
                         has_text="mixture of experts (optional").first
    _wait_visible(group, True, "the MoE group's title")
    _wait_visible(field(form, "num_experts"), False, "a collapsed group: num_experts")
    group.click()
    _wait_visible(field(form, "num_experts"), True, "the opened group: num_experts")
    _wait_visible(field(form, "top_k"), False, "a dense config: top_k")
    box = field(form, "num_experts").locator("input")
    box.fill("8")
    box.press("Enter")
    _wait_visible(field(form, "top_k"), True, "8 experts: top_k")
    _wait_visible(field(form, "load_balancing"), True, "8 experts: load_balancing")
    _not_clipped(page.page, form, "config form, MoE group open")
    page.shot("moe-group", form)
    box.fill("0")
    box.press("Enter")
    _wait_visible(field(form, "top_k"), False, "dense again: top_k")
    field(form, "arch").locator("select").select_option("bert")
    _wait_visible(group, False, "BERT: the MoE group")
    message = page.outputs(at["moe_group_say"] + 1).first
    found = page.page.evaluate(BREAKS_JS, message.element_handle())
    assert found["styles"] and set(found["styles"]) == {"normal"}, found["styles"]
    assert found["breaks"] > 0, "the message should be long enough to wrap at 1050 px"
    assert not found["inside"], f"lines broken inside words: {found['inside']}"
    page.shot("say-wrapped", message)
    assert not page.console[logged:], page.console[logged:]
