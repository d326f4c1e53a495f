"""Per-rank views label a rank's context-parallel coordinate (#53): rank 1 of a CP=2 x DP=2 world is
``dp0 cp1 tp0 pp0``, from workbench.layout.Layout's coordinates (megatron's tp-cp-ep-dp-pp order), in the memory
plan's bars and the training figure's memory panel."""

from __future__ import annotations

import pandas as pd

from workbench import planner
from workbench.config import preset
from workbench.layout import Layout
from workbench.plots.memory import plan_bars, plan_rank_layout
from workbench.plots.training import TrainingFrames, rank_tick, training_figure


def test_rank_label_names_cp_from_the_layouts_coordinates():
    lay = Layout(world=4, cp=2)
    assert [lay.rank_label(r) for r in range(4)] == ["dp0 cp0 tp0 pp0", "dp0 cp1 tp0 pp0", "dp1 cp0 tp0 pp0",
                                                      "dp1 cp1 tp0 pp0"]
    assert Layout(world=8, tp=2, cp=2).rank_label(3, short=True) == "d0 c1 t1 p0"  # tp fastest, then cp
    assert Layout(world=2, tp=2).rank_label(1) == "dp0 tp1 pp0"  # no CP: no cp coordinate
    assert Layout(world=3, cp=2).rank_label(1) == "rank 1"  # not whole replicas: no coordinates
    for r in range(8):
        c = Layout(world=8, tp=2, cp=2).coords(r)
        assert Layout(world=8, tp=2, cp=2).rank_label(r) == f"dp{c.dp} cp{c.cp} tp{c.tp} pp{c.pp}"


def test_memory_plan_bars_label_the_cp_rank():
    cfg = preset("tiny", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 4})
    plan = planner.predict(cfg, "H100-80GB", suggest=False)
    assert plan_rank_layout(plan) == Layout(world=4, cp=2)
    fig = plan_bars(plan)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["r0\n(d0 c0 t0 p0)", "r1\n(d0 c1 t0 p0)", "r2\n(d1 c0 t0 p0)", "r3\n(d1 c1 t0 p0)"]
    plain = plan_bars(planner.predict(preset("tiny", **{"parallel.nproc_per_node": 2}), "H100-80GB", suggest=False))
    assert [t.get_text() for t in plain.axes[0].get_xticklabels()] == ["r0\n(d0 t0 p0)", "r1\n(d1 t0 p0)"]


def test_the_training_figures_memory_panel_labels_the_cp_rank():
    empty = pd.DataFrame()
    mem = pd.DataFrame({"rank": [0, 1, 2, 3], "mem_allocated": [1e9] * 4, "mem_reserved": [2e9] * 4})
    lay = Layout.of(preset("tiny", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 4}))
    frames = TrainingFrames(empty, empty, empty, mem, device="cuda", layout=lay)
    fig = training_figure(frames)
    ax = next(a for a in fig.axes if a.get_title().startswith("memory per rank"))
    assert [t.get_text() for t in ax.get_xticklabels()] == [rank_tick(r, lay) for r in range(4)]
    assert rank_tick(1, lay) == "1\nd0 c1 t0 p0"
    assert rank_tick(0, None) == "0" and rank_tick(0, Layout(world=1)) == "0"
