"""Planner widget and chart: headless construction, programmatic control, OOM -> suggestions -> fit."""

from __future__ import annotations

import pytest

from workbench.config import preset
from workbench.planner import COMPONENTS, GiB, predict


def test_chart_has_a_bar_segment_per_component_and_capacity_line():
    from workbench.plots.memory import plan_bars

    cfg = preset("gpt2-medium", **{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 4, "train.global_batch_size": 64})
    plan = predict(cfg, gpu="A100-40GB")
    fig = plan_bars(plan, measured={0: 5 * GiB, 3: 6 * GiB})
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for comp in ("weights", "gradients", "optimizer moments", "activations", "logits loss"):
        assert comp in labels
    assert any(lbl.startswith("A100-40GB") for lbl in labels) and "measured peak allocated" in labels
    assert len(ax.get_xticklabels()) == 4  # one bar per rank
    # the stacked heights of rank 3's bar add up to its predicted total
    st = plan.stages[1]
    heights = [p.get_height() for p in ax.patches if abs(p.get_x() + p.get_width() / 2 - 3) < 1e-6]
    assert sum(heights) == pytest.approx(st.total / GiB, rel=1e-6)


def test_chart_groups_large_worlds_by_stage():
    from workbench.plots.memory import plan_bars

    cfg = preset("gpt2-medium", **{"parallel.tensor_parallel": 4, "parallel.pipeline_parallel": 4, "parallel.nproc_per_node": 64,
                                   "train.global_batch_size": 64})
    fig = plan_bars(predict(cfg), max_bars=32)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [f"stage {i}" for i in range(4)]


def test_widget_headless_oom_then_apply_suggestion_fits():
    from workbench.widgets.planner import MemoryPlanner

    cfg = preset("gpt2-large", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 4, "train.micro_batch_size": 32,
                                  "train.global_batch_size": 128})
    w = MemoryPlanner(cfg, gpu="A100-40GB", show=False)
    assert w.plan is not None and w.plan.fits is False
    assert "OOM" in w.status.value and w.figure is not None
    assert len(w.suggestions_box.children) == 1 + len(w.plan.suggestions) > 1
    fitting = next(i for i, s in enumerate(w.plan.suggestions) if s.fits)
    expected = w.plan.suggestions[fitting].worst_total
    w.apply(fitting)
    assert w.plan.fits is True and w.plan.worst.total == expected
    assert "fits on every rank" in w.status.value


def test_the_offload_suggestion_applies_through_the_widget():
    """Llama-3.1-8B at DP=2 on 80 GB: the optimizer state is what does not fit; applying the offload suggestion sets
    the widget's own control (not only the distributed optimizer), the plan fits and says what the host holds."""
    from workbench.widgets.planner import MemoryPlanner

    cfg = preset("llama3.1-8b", **{"parallel.nproc_per_node": 2, "parallel.distributed_optimizer": True,
                                   "train.micro_batch_size": 1, "train.global_batch_size": 16, "parallel.recompute": "full"})
    w = MemoryPlanner(cfg, gpu="H100", show=False)
    assert w.plan.fits is False and w.offload.value == 0 and "host memory" not in w.status.value
    i = next(i for i, s in enumerate(w.plan.suggestions) if "offload" in s.text)
    w.apply(i)
    assert w.offload.value == 1.0 and w.config.parallel.optimizer_cpu_offload == 1.0 and w.plan.fits is True
    assert "host memory (optimizer CPU offload)" in w.status.value
    w.set(offload=0.0)
    assert w.plan.fits is False and w.config.parallel.optimizer_cpu_offload == 0.0


def test_widget_controls_move_the_plan():
    from workbench.widgets.planner import MemoryPlanner

    w = MemoryPlanner(preset("gpt2-medium"), gpu="H100", show=False)
    before = w.plan.worst.peak_allocated
    w.set(micro_batch=w.micro_batch.value * 2)
    assert w.plan.worst.peak_allocated > before
    w.set(tp=2, dp=1, sp=True)
    assert len(w.plan.ranks) == 2 and w.config.parallel.sequence_parallel
    w.set(gpu="custom", custom_gib=1.0)
    assert w.plan.gpu.capacity_bytes == GiB and w.plan.fits is False
    w.set(tp=3)  # 16 heads are not divisible by 3: the problems are shown instead of a chart
    assert w.plan is None and "tensor_parallel" in w.message and w.figure is None
    with pytest.raises(ValueError, match="unknown control"):
        w.set(bogus=1)


def test_widget_keeps_the_base_configs_context_parallelism():
    from workbench.widgets.planner import MemoryPlanner

    cfg = preset("llama3.2-1b", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "model.seq_length": 8192})
    w = MemoryPlanner(cfg, gpu="H100", show=False)
    w.set(tp=2, dp=1)
    assert w.config.parallel.context_parallel == 2 and w.config.parallel.world_size == 4 and w.config.validate() == []
    assert len(w.plan.ranks) == 4


def test_widget_overlays_measured_run(tmp_path):
    from workbench.run.events import EventWriter
    from workbench.widgets.planner import MemoryPlanner

    with EventWriter(tmp_path, 0) as ev:
        ev.emit("step", iteration=1, mem_peak=3 * GiB)
    w = MemoryPlanner(preset("demo-small"), show=False).show_measured(tmp_path)
    assert w.measured == {0: 3 * GiB}
    labels = [t.get_text() for t in w.figure.axes[0].get_legend().get_texts()]
    assert "measured peak allocated" in labels
    assert set(w.plan.stages[0].components) == set(COMPONENTS)
