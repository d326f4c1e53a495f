"""The advisor widget: sorted HTML table, memory-vs-speed scatter, one click loads a layout into the config form."""

from __future__ import annotations

import pytest

from workbench.config import preset


@pytest.fixture(scope="module")
def form():
    from workbench.widgets.config_form import ConfigForm

    return ConfigForm(preset("gpt2-medium"), show_dashboard=False)


def test_table_lists_evaluated_rows_in_speed_order(form):
    from workbench.widgets.advisor import AdvisorWidget

    w = AdvisorWidget(form, gpus=2, gpu="H200-141GB", top=4)
    rows = w.shown_rows()
    assert rows and [r.prediction.tokens_per_s for r in rows] == sorted((r.prediction.tokens_per_s for r in rows), reverse=True)
    html = w.table.value
    assert html.count("<tr") == len(rows) + 1  # header + one per row
    assert rows[0].label in html and "pick: <b>" in w.status.value
    assert len(w.buttons) == len(rows)
    assert all(b.disabled == (not r.fits) for b, r in zip(w.buttons, rows))


def test_click_loads_the_layout_into_the_form(form):
    from workbench.widgets.advisor import AdvisorWidget

    w = AdvisorWidget(form, gpus=2, gpu="H200-141GB", top=4)
    rows = w.shown_rows()
    i = next(k for k, r in enumerate(rows) if r.fits and (r.layout.tp, r.layout.pp) != (1, 1) or k == len(rows) - 1)
    w.buttons[i].click()
    lay = rows[i].layout
    cfg = form.config
    assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.train.micro_batch_size) == (lay.tp, lay.pp, lay.micro_batch_size)
    assert cfg.parallel.nproc_per_node == 2 and cfg.train.fp8 == lay.fp8 and cfg.parallel.recompute == lay.recompute
    assert form.problems == [] and w.loaded.to_dict() == cfg.to_dict()


def test_scatter_has_a_point_per_evaluated_layout_and_the_capacity_line():
    from workbench.widgets.advisor import AdvisorWidget

    w = AdvisorWidget(preset("llama3.2-3b", **{"train.global_batch_size": 16}), gpus=2, gpu="H100-80GB", top=3)
    fig = w.scatter(80.0)
    ax = fig.axes[0]
    n = sum(len(c.get_offsets()) for c in ax.collections)
    evaluated = [r for r in w.advice.rows if r.memory_gib is not None]
    assert n == len(evaluated) + 1  # every evaluated layout, plus the pick's ring
    assert any(line.get_xdata()[0] == 80.0 for line in ax.lines)
    assert w.loaded is None and w.load(0).parallel.nproc_per_node == 2


def test_invalid_config_shows_the_problem_instead_of_a_table():
    from workbench.widgets.advisor import AdvisorWidget

    w = AdvisorWidget(preset("gpt2-medium", **{"train.lr": -1.0}), gpus=2)
    assert w.advice is None and "train.lr" in w.status.value and w.rows_box.children == ()


def test_an_moe_config_shows_the_refusal_instead_of_a_table():
    from workbench.widgets.advisor import AdvisorWidget

    w = AdvisorWidget(preset("moe-research"), gpus=4)
    assert w.advice is None and w.shown_rows() == [] and w.buttons == []
    assert "model.moe" in w.status.value and "workbench plan" in w.status.value
