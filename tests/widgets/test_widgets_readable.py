"""What the notebooks' widgets and tables show, checked without a browser (tests/browser checks the same
pages' geometry in JupyterLab): plans and wide frames as one-line-per-row HTML tables, planner controls
that keep their width, charts set as widget state (the newest one stays; a refusal clears it), the
dashboard's charts and status line, and the config form showing only the fields that apply."""

from __future__ import annotations

import base64
import dataclasses
import html
import math
import re

import pytest

from workbench.config import preset
from workbench.planner import GiB, format_plan, predict

pytest.importorskip("ipywidgets")

T5_FIELDS = ("model.decoder_num_layers", "model.decoder_seq_length", "model.relative_attention_num_buckets",
             "model.relative_attention_max_distance")


# --------------------------------------------------------------------------- tables


def test_plan_table_is_the_cli_text_and_an_html_table_with_a_row_per_rank():
    from workbench.plots.tables import CELL_CSS, plan_table

    plan = predict(preset("gpt2-large", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 4,
                                           "train.micro_batch_size": 32, "train.global_batch_size": 128}), gpu="A100-40GB")
    table = plan_table(plan)
    assert str(table) == table.text == format_plan(plan)  # print() and the CLI: the text as before
    doc = table._repr_html_()
    body = doc[doc.index("<tbody>"):doc.index("</tbody>")]
    assert body.count("<tr>") == len(plan.ranks)
    assert "white-space: nowrap" in CELL_CSS and "white-space: nowrap" in doc and "table-layout: auto" in doc
    # every line of the text that is not the table is said around it
    text_lines = format_plan(plan).splitlines()
    head = next(i for i, ln in enumerate(text_lines) if ln.rstrip().endswith("(GiB)"))
    notes = text_lines[:head] + text_lines[head + 1 + len(plan.ranks):]
    assert notes and all(html.escape(ln.strip()) in doc for ln in notes)
    # each rank's total and verdict are in its row
    worst = max(plan.ranks, key=lambda r: r.total)
    assert f"{worst.total / GiB:.2f}" in body and ("OOM" in body) == (not plan.fits)


def test_html_table_says_common_columns_once_and_keeps_the_rest():
    import pandas as pd

    from workbench.plots.tables import html_table

    df = pd.DataFrame({"config": ["a", "b"], "err %": [1.234, -2.5], "device": ["NVIDIA H100 80GB HBM3"] * 2,
                       "commit": ["fa77810", "0123abc"]})
    t = html_table(df, common=("device", "commit"))
    assert "device: NVIDIA H100 80GB HBM3" in t.html and "device: NVIDIA H100 80GB HBM3" in t.text
    assert t.html.count("NVIDIA H100") == 1  # not on every row
    assert "fa77810" in t.html and "0123abc" in t.html and ">commit<" in t.html.replace(" ", "")  # differs: stays a column
    assert "1.23" in t.html and "-2.50" in t.html


def test_config_form_shows_its_plan_and_report_as_tables():
    from workbench.widgets.config_form import ConfigForm

    form = ConfigForm(preset("tiny"))
    assert "<table" in form.plan.value and "<pre" not in form.plan.value
    report = form.report()
    assert print_text(report) == str(report) and "memory plan:" in report and form.plan_text in report
    assert "<table" in report._repr_html_() and "valid" in report._repr_html_()


def print_text(obj) -> str:
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        print(obj)
    return buf.getvalue().rstrip("\n")


def test_one_micro_batch_is_singular():
    from workbench.widgets.config_form import ConfigForm
    from workbench.widgets.schedule import ScheduleExplorer

    form = ConfigForm(preset("tiny", **{"train.global_batch_size": 4, "train.micro_batch_size": 4}))
    assert form.config.derived().num_microbatches == 1
    assert "1 micro-batch per step" in form.summary.value and "1 micro-batches" not in form.report()
    form.set("train.global_batch_size", 8)
    assert "2 micro-batches per step" in form.summary.value
    ex = ScheduleExplorer(p=1, m=1, v=1, schedule="1f1b", show=False)
    assert "1 micro-batch</b>" in ex.status.value and "1 micro-batches" not in ex.status.value


# --------------------------------------------------------------------------- planner controls


def _px(value: str) -> float:
    m = re.fullmatch(r"([0-9.]+)px", value or "")
    assert m, f"expected a pixel width, got {value!r}"
    return float(m.group(1))


def test_planner_columns_keep_their_width_and_fit_a_1050px_output():
    from workbench.widgets.layout import CHAR_PX
    from workbench.widgets.planner import MemoryPlanner

    w = MemoryPlanner(preset("gpt2-large"), gpu="A100-40GB", show=False)
    row = w.ui.children[0]
    assert row.layout.flex_flow == "row wrap"  # a narrower output wraps a column instead of clipping it
    total = 0.0
    for col in row.children:
        assert col.layout.flex == "0 0 auto"  # a column never shrinks below its controls
        widths = []
        for c in col.children:
            assert c.layout.flex == "0 0 auto" and c.layout.width, f"{c.description!r} has no fixed width"
            widths.append(_px(c.layout.width))
            if hasattr(c.style, "description_width") and c.style.description_width:
                desc = _px(c.style.description_width)
                assert desc >= CHAR_PX * len(c.description), c.description
                assert _px(c.layout.width) - desc >= 75, f"{c.description!r}: no room for its box"
            else:  # a checkbox: its box and label in the width
                assert _px(c.layout.width) >= 24 + CHAR_PX * len(c.description), c.description
        total += max(widths) + 12 + 4  # column margin, widget margins
    assert total <= 1050 - 20, total


# --------------------------------------------------------------------------- charts as widget state


def _png(output: dict) -> bytes:
    assert output["output_type"] == "display_data"
    data = base64.b64decode(output["data"]["image/png"])
    assert data.startswith(b"\x89PNG")
    return data


def test_schedule_explorer_sets_its_chart_as_state_and_a_refusal_clears_it():
    from workbench.widgets.schedule import ScheduleExplorer

    ex = ScheduleExplorer(p=4, m=8, v=2, schedule="interleaved")
    first = _png(ex.out.outputs[0])
    assert len(ex.out.outputs) == 1
    ex.p.value = 2  # two quick changes: a valid layout, then one mcore refuses
    assert len(ex.out.outputs) == 1 and _png(ex.out.outputs[0]) != first
    ex.m.value = 9
    assert ex.timeline is None and ex.out.outputs == () and "m=9" in ex.status.value
    ex.m.value = 8
    assert len(ex.out.outputs) == 1 and ex.timeline.p == 2 and ex.timeline.m == 8


def test_memory_planner_sets_its_chart_as_state_and_a_refusal_clears_it():
    from workbench.widgets.planner import MemoryPlanner

    w = MemoryPlanner(preset("gpt2-medium"), gpu="H100")
    first = _png(w.out.outputs[0])
    w.micro_batch.value = 2
    assert len(w.out.outputs) == 1 and _png(w.out.outputs[0]) != first
    w.tp.value = 3
    assert w.plan is None and w.out.outputs == ()


# --------------------------------------------------------------------------- dashboard charts and status


def _frames(n: int, total: int, device: str, memory=None):
    import pandas as pd

    from workbench.plots.training import TrainingFrames

    it = list(range(1, n + 1))
    steps = pd.DataFrame({"rank": 0, "iteration": it, "loss": [5 * math.exp(-i / 20) + 1 for i in it],
                          "tokens_per_s": [1000.0 + i for i in it], "lr": 3e-4, "grad_norm": 1.0})
    mem = pd.DataFrame(memory or [], columns=["rank", "mem_allocated", "mem_reserved", "mem_peak"])
    return TrainingFrames(steps, steps[["iteration", "loss"]], pd.DataFrame(columns=["iteration", "loss", "ppl"]), mem,
                          train_iters=total, title="run", device=device)


def test_loss_axis_follows_the_iterations_so_far():
    from workbench.plots.training import training_figure

    fig = training_figure(_frames(40, 1000, "cuda"))
    ax_loss, ax_tput = fig.axes[0], fig.axes[1]
    assert ax_loss.get_title() == "loss" and ax_tput.get_title() == "throughput"
    lo, hi = ax_loss.get_xlim()
    assert hi < 50 and lo > -5, (lo, hi)  # not 0..1000: 40 iterations fill the panel
    assert ax_loss.get_xlim() == pytest.approx(ax_tput.get_xlim(), abs=1.0)  # like the throughput panel


def _memory_axis(fig):
    return next(ax for ax in fig.axes if ax.get_title().startswith("memory per rank"))


def test_memory_panel_on_cpu_says_there_is_no_gpu_memory():
    from workbench.plots.training import training_figure

    ax = _memory_axis(training_figure(_frames(10, 100, "cpu"), predicted_memory={0: 2 * GiB, 1: 2 * GiB}))
    assert [t.get_text() for t in ax.texts] == ["no GPU memory on CPU"]
    assert not ax.patches and ax.get_legend() is None


def _bars(ax):
    from matplotlib.patches import Rectangle

    return [p for p in ax.patches if isinstance(p, Rectangle) and p.get_height() == p.get_height() and p.get_height() > 0]


def _legend_clear_of_bars(ax) -> None:
    fig = ax.figure
    fig.canvas.draw()
    box = ax.get_legend().get_window_extent()
    for bar in _bars(ax):
        assert not box.overlaps(bar.get_window_extent()), "the legend covers a bar"


def test_memory_panel_centres_each_ranks_bars_on_its_tick_and_keeps_the_legend_clear():
    from workbench.plots.training import training_figure

    # a GPU run before its first step: the planner's bar alone, centred on the rank's tick
    ax = _memory_axis(training_figure(_frames(0, 100, "cuda"), predicted_memory={0: 3 * GiB, 1: 5 * GiB}))
    bars = _bars(ax)
    assert [round(b.get_x() + b.get_width() / 2, 6) for b in bars] == [0.0, 1.0]
    _legend_clear_of_bars(ax)
    # measured allocated and reserved beside the prediction: the group is centred on the tick
    mem = [{"rank": 0, "mem_allocated": 2 * GiB, "mem_reserved": 3 * GiB, "mem_peak": 2 * GiB},
           {"rank": 1, "mem_allocated": 4 * GiB, "mem_reserved": 5 * GiB, "mem_peak": 4 * GiB}]
    ax = _memory_axis(training_figure(_frames(5, 100, "cuda", mem), predicted_memory={0: 3 * GiB, 1: 5 * GiB}))
    for rank in (0, 1):
        group = [b for b in _bars(ax) if abs(b.get_x() + b.get_width() / 2 - rank) < 0.5]
        assert len(group) == 3
        left, right = min(b.get_x() for b in group), max(b.get_x() + b.get_width() for b in group)
        assert (left + right) / 2 == pytest.approx(rank)
    _legend_clear_of_bars(ax)


def test_status_line_is_one_line_with_the_iteration_before_the_path(tmp_path):
    from workbench.widgets.dashboard import status_line

    run_dir = tmp_path / "runs" / "bert" / "sweep-3" / "very-long-run-directory-name-20261125-183500-abcdef"
    line = status_line("running", 40, 1000, run_dir)
    assert "<br" not in line and "white-space: nowrap" in line and "text-overflow: ellipsis" in line
    assert line.index("iteration 40/1000") < line.index("<code>")
    assert f"title='{run_dir}'" in line  # the full path, as a tooltip
    shown = re.search(r"<code>(.*)</code>", line).group(1)
    assert shown == "\u2026/bert/sweep-3/very-long-run-directory-name-20261125-183500-abcdef"


# --------------------------------------------------------------------------- config form fields


def test_each_family_shows_its_own_fields():
    from workbench.widgets.config_form import ConfigForm

    form = ConfigForm(preset("tiny"))  # GPT
    assert not set(T5_FIELDS) & set(form.shown_fields())
    form.preset.value = "bert-tiny"
    assert not set(T5_FIELDS) & set(form.shown_fields())
    form.preset.value = "t5-tiny"
    assert set(T5_FIELDS) <= set(form.shown_fields())
    assert "model.num_tokentypes" not in form.shown_fields()  # BERT's
    form.set("model.arch", "gpt")  # live: the arch field alone switches them
    assert not set(T5_FIELDS) & set(form.shown_fields())


def test_gpu_only_fields_show_on_cuda_only_and_a_refused_one_shows_with_its_problem():
    from workbench.kernel_rule import GPU_ONLY_FIELDS
    from workbench.widgets.config_form import ConfigForm

    assert {"train.cuda_graphs", "parallel.tp_comm_overlap"} <= set(GPU_ONLY_FIELDS)
    form = ConfigForm(preset("tiny", **{"parallel.device": "cpu"}))
    assert not set(GPU_ONLY_FIELDS) & set(form.shown_fields())
    form.set("parallel.device", "cuda")
    assert set(GPU_ONLY_FIELDS) <= set(form.shown_fields())
    form.set("parallel.overlap_grad_reduce", True)
    form.set("parallel.device", "cpu")  # refused on CPU: the field stays in sight, next to its message
    assert "parallel.overlap_grad_reduce" in [p.field for p in form.problems]
    assert set(form.shown_fields()) & set(GPU_ONLY_FIELDS) == {"parallel.overlap_grad_reduce"}


def test_gpu_only_fields_change_nothing_on_cpu_or_are_refused_there():
    """The list the form hides on CPU is what CPU mode ignores (the kernel rule) or refuses (validation)."""
    from workbench.kernel_rule import GPU_ONLY_FIELDS, choose

    def kernels(cfg) -> dict:  # what runs (the reasons' wording aside)
        c = choose(cfg, te=False, apex=False, cuda_available=False)
        return {k: v for k, v in dataclasses.asdict(c).items() if not k.endswith("reason")}

    cpu = preset("tiny", **{"parallel.device": "cpu", "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    base = kernels(cpu)
    assert base["layer"] == "stock" and base["cuda_graphs_impl"] == "" and base["tp_overlap"] == ""
    for name in GPU_ONLY_FIELDS:
        section, key = name.split(".")
        default = getattr(getattr(cpu, section), key)
        on = "tensorwise" if name == "train.fp8" else 1.0 if isinstance(default, float) else not default
        flipped = cpu.replace(**{name: on})
        refused = [p.field for p in flipped.validate()]
        if name in refused or any(f in refused for f in GPU_ONLY_FIELDS):
            continue
        assert kernels(flipped) == base, name
