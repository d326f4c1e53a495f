"""Widgets: after an invalid value the memory planner and the schedule explorer show the
refusal without the previous chart under it; no description is cut and no box overlaps the next column;
the memory chart's rank labels never touch at 8 ranks."""

from __future__ import annotations

import re

import pytest

from workbench.config import preset

PREVIOUS_CHART = ({"output_type": "display_data", "data": {"text/plain": "<Figure 740x420>", "image/png": "iVBOR"},
                   "metadata": {}},)
MIN_CHAR_PX = 7  # a 13px sans-serif label character is at least this wide on average


def test_planner_refusal_clears_the_previous_chart():
    from workbench.widgets.planner import MemoryPlanner

    w = MemoryPlanner(preset("gpt2-medium"), gpu="H100", show=False)
    w.out.outputs = PREVIOUS_CHART  # what the kernel holds after the last valid layout
    w.set(tp=3)  # 16 heads: not divisible
    assert w.plan is None and "not a valid layout" in w.status.value
    assert w.out.outputs == ()
    w.set(tp=2, dp=1)
    assert w.plan is not None and w.figure is not None


def test_schedule_explorer_refusal_clears_the_previous_chart():
    from workbench.widgets.schedule import ScheduleExplorer

    ex = ScheduleExplorer(p=4, m=8, v=2, schedule="interleaved", show=False)
    ex.out.outputs = PREVIOUS_CHART
    ex.set(m=6)  # interleaving needs m divisible by p
    assert ex.timeline is None and "refused" in ex.status.value
    assert ex.out.outputs == ()
    ex.set(schedule="1f1b", p=4, m=2)  # m < p: a chart, with the warning the CLI gives
    assert ex.timeline is not None and "m=2 &lt; p=4" in ex.status.value and "at least m=4" in ex.status.value
    ex.set(m=8)
    assert "&lt; p" not in ex.status.value


def _px(value: str) -> float:
    m = re.fullmatch(r"([0-9.]+)px", value or "")
    assert m, f"expected a pixel width, got {value!r}"
    return float(m.group(1))


def _check_labels(widgets):
    checked = 0
    for w in widgets:
        desc = getattr(w, "description", "")
        if not desc or not hasattr(w.style, "description_width"):
            continue
        width = _px(w.style.description_width)
        assert width >= MIN_CHAR_PX * len(desc), f"{desc!r} is cut: {width}px"
        assert _px(w.layout.width) >= width + 60, f"{desc!r}: no room left for its input box"
        assert w.layout.flex == "0 0 auto", f"{desc!r} can shrink into the next column"
        checked += 1
    return checked


def test_descriptions_fit_and_boxes_keep_their_width():
    from workbench.widgets.config_form import ConfigForm
    from workbench.widgets.planner import MemoryPlanner
    from workbench.widgets.schedule import ScheduleExplorer

    form = ConfigForm(preset("tiny"))
    assert "make_vocab_size_divisible_by" in [w.description for w in form.fields.values()]
    assert _check_labels(form.fields.values()) == len(form.fields)
    planner = MemoryPlanner(preset("gpt2-medium"), show=False)
    assert _check_labels([planner.tp, planner.pp, planner.vpp, planner.dp, planner.micro_batch, planner.microbatches,
                          planner.seq_length, planner.custom_gib]) == 8
    ex = ScheduleExplorer(show=False)
    assert _check_labels([ex.p, ex.m, ex.v, ex.schedule, ex.ratio, ex.latency]) == 6


@pytest.mark.parametrize("world", [8, 16])
def test_rank_labels_of_the_memory_chart_never_touch(world):
    from workbench.planner import predict
    from workbench.plots.memory import plan_bars

    cfg = preset("gpt2-medium", **{"parallel.tensor_parallel": 2, "parallel.pipeline_parallel": 2,
                                   "parallel.nproc_per_node": world, "train.global_batch_size": 64})
    plan = predict(cfg, gpu="H100")
    fig = plan_bars(plan, measured={r.rank: 10 * 2**30 for r in plan.ranks})
    if not hasattr(fig.canvas, "get_renderer"):  # a pyplot-free Figure: measure as it is drawn to PNG
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels() if t.get_text()), key=lambda b: b.x0)
    assert len(boxes) == world
    gaps = [b.x0 - a.x1 for a, b in zip(boxes, boxes[1:])]
    assert min(gaps) >= 6, gaps
