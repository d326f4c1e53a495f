"""The run browser (workbench/widgets/runs.py) on run directories written with the real event writer: headless
construction, the metric dropdown following the selection, the values table at a step, one run alone."""

from __future__ import annotations

import math
import os

import pytest

from tests.support.event_runs import T0, config, write_run


#: the ``ft`` run's tokens per step and the step time of each of its steps (the first: warm-up)
FT_TOKENS = 128
FT_STEP_TIME = {1: 0.9, 2: 0.3, 3: 0.4, 4: 0.3, 5: 0.8, 6: 0.3}


def _metrics(w) -> list[str]:
    return [value for _label, value in w.metric.options]


@pytest.fixture
def runs(tmp_path):
    """``ft``: fine-tuning (train and eval accuracy, step time and tokens/s) logging every step; ``pre``: pretraining
    logging every 3rd step, no throughput, written later (the newer run)."""
    root = tmp_path / "runs"
    ft_loss = [0.9, 0.7, 0.6, 0.5, 0.45, 0.4]
    ft = write_run(root / "bert" / "ft", [
        {"iteration": i, "time": T0 + i, "loss": v, "accuracy": 0.5 + 0.05 * i, "grad_norm": 1.0, "lr": 1e-3,
         "step_time": FT_STEP_TIME[i], "tokens_per_s": FT_TOKENS / FT_STEP_TIME[i]}
        for i, v in enumerate(ft_loss, 1)], [{"iteration": 6, "time": T0 + 6.5, "loss": 0.55, "ppl": math.exp(0.55),
                                               "accuracy": 0.8}],
        cfg=config(arch="bert", num_labels=2, train_iters=6, seq_length=FT_TOKENS // 4, global_batch_size=4))
    pre_loss = {3: 7.0, 6: 6.0, 9: 5.5}
    pre = write_run(root / "pre", [{"iteration": i, "time": T0 + 100 + i, "loss": v, "grad_norm": 3.0, "lr": 5e-4}
                                   for i, v in pre_loss.items()], cfg=config(train_iters=9))
    os.utime(ft / "config.json", (T0, T0))  # ft is the older run
    os.utime(pre / "config.json", (T0 + 100, T0 + 100))
    return root, ft, pre, ft_loss, pre_loss


def test_browser_lists_the_runs_and_overlays_the_newest(runs):
    from workbench.widgets.runs import RunBrowser

    root, ft, pre, ft_loss, pre_loss = runs
    w = RunBrowser(root, show=False)
    assert list(w.table["run"]) == ["pre", "ft"]  # newest first
    row = w.table.set_index("run").loc["ft"]
    assert row["family"] == "bert classifier" and row["steps"] == "6/6" and row["status"] == "finished"
    assert row["last loss"] == pytest.approx(ft_loss[-1])
    # tokens/s, after the last loss: the tokens of steps 2..6 over the wall time from step 1's event to step 6's
    # (one second apart, as written), as Run.final_metrics gives it; the run without throughput: an empty cell
    cols = list(w.table.columns)
    assert cols.index("tokens/s") == cols.index("last loss") + 1
    n = len(FT_STEP_TIME)
    expected = FT_TOKENS * (n - 1) / max(float(n - 1), sum(FT_STEP_TIME[i] for i in range(2, n + 1)))
    assert row["tokens/s"] == pytest.approx(expected)
    assert math.isnan(w.table.set_index("run").loc["pre", "tokens/s"])
    assert ">tokens/s<" in w.runs_html.value and f">{round(expected)}<" in w.runs_html.value  # whole tokens/s
    assert "ft" in w.runs_html.value and "pre" in w.runs_html.value and "bert classifier" in w.runs_html.value
    assert set(w.selection.value) == {str(ft), str(pre)}  # the newest runs are selected at first
    assert w.metric.value == "loss" and sorted(c.run for c in w.comparison.curves) == ["ft", "pre"]
    legend = [t.get_text() for t in w.figure.axes[0].get_legend().get_texts()]
    assert sorted(legend) == ["ft", "pre"]
    # the step slider spans the steps recorded and starts at the last
    assert (w.step.min, w.step.max, w.step.value) == (1, 9, 9)


def test_metric_dropdown_follows_the_selection(runs):
    from workbench.widgets.runs import RunBrowser

    root, ft, pre, *_ = runs
    w = RunBrowser(root, show=False)
    assert {"loss", "accuracy", "eval accuracy", "eval loss", "grad_norm", "lr"} <= set(_metrics(w))
    w.set(metric="eval accuracy")
    assert [c.run for c in w.comparison.curves] == ["ft"] and w.comparison.lacking == ["pre"]
    assert "not recorded by pre" in w.status.value
    # only the pretraining run: its metrics alone; the accuracy it does not record falls back to the loss
    w.selection.value = (str(pre),)  # as a click in the browser does
    assert "accuracy" not in _metrics(w) and "eval accuracy" not in _metrics(w)
    assert set(_metrics(w)) == {"loss", "grad_norm", "lr"}
    assert w.metric.value == "loss" and [c.run for c in w.comparison.curves] == ["pre"]
    # the fine-tuning run again (by name): its accuracy is offered and kept once chosen
    w.set(selection=["ft"], metric="accuracy")
    assert "eval accuracy" in _metrics(w) and w.metric.value == "accuracy"
    assert w.comparison.curves[0].y == pytest.approx([0.5 + 0.05 * i for i in range(1, 7)])
    w.set(selection=["ft", "pre"])
    assert w.metric.value == "accuracy" and w.comparison.lacking == ["pre"]


def test_step_table_shows_each_runs_value(runs):
    from workbench.widgets.runs import RunBrowser

    root, ft, pre, ft_loss, pre_loss = runs
    w = RunBrowser(root, show=False, smoothing=0.0)
    w.set(step=4)
    t = w.values.set_index("run")
    assert t.loc["ft", "step"] == 4 and t.loc["ft", "value"] == pytest.approx(ft_loss[3])
    assert t.loc["pre", "step"] == 3 and t.loc["pre", "value"] == pytest.approx(pre_loss[3])  # its last point by step 4
    assert "values at step 4" in w.values_html.value and f"{ft_loss[3]:.4f}" in w.values_html.value
    w.step.value = 9  # the slider, as a drag does
    t = w.values.set_index("run")
    assert t.loc["pre", "value"] == pytest.approx(pre_loss[9]) and t.loc["ft", "step"] == 6
    assert [ln.get_xdata()[0] for ln in w.figure.axes[0].get_lines() if ln.get_gid() == "at step"] == [9.0]
    # smoothing, log scale and the x axis reach the figure
    w.set(smoothing=0.5, log_y=True, x_axis="wall time")
    ax = w.figure.axes[0]
    assert ax.get_yscale() == "log" and w.comparison.smoothing == 0.5 and "wall time" in ax.get_xlabel()
    assert "wall time" in w.values.columns
    # a metric one run lacks: that run has a row saying so
    w.set(metric="eval accuracy")
    t = w.values.set_index("run")
    assert t.loc["ft", "value"] == pytest.approx(0.8) and "does not record" in t.loc["pre", "note"]
    with pytest.raises(ValueError):
        w.set(colour="red")


def test_one_run_alone(tmp_path):
    from workbench.widgets.runs import FIGURE_NAME, RunBrowser

    run = write_run(tmp_path / "only", [{"iteration": i, "time": T0 + i, "loss": 5.0 - i} for i in (1, 2, 3)])
    w = RunBrowser(tmp_path, show=True)
    assert w.selection.value == (str(run),) and len(w.comparison.curves) == 1
    assert w.values.set_index("run").loc["only", "value"] == pytest.approx(2.0)
    assert len(w.out.outputs) == 1 and "image/png" in w.out.outputs[0]["data"]  # the chart is in the output
    # headless (a saved notebook): the table, the figure as a PNG named "compare", the values
    images = [o for o in w.static() if getattr(o, "metadata", None)]
    assert [o.metadata.get("workbench_figure") for o in images] == [FIGURE_NAME]


def test_no_runs_yet(tmp_path):
    from workbench.widgets.runs import RunBrowser

    w = RunBrowser(tmp_path / "empty", show=False)
    assert "no runs under" in w.runs_html.value and w.comparison.curves == [] and w.step.disabled
    assert "select one or more runs" in w.status.value
    write_run(tmp_path / "empty" / "later", [{"iteration": 1, "time": T0 + 1, "loss": 1.0}])
    w.refresh()  # the refresh button: finds the new run
    assert list(w.table["run"]) == ["later"] and len(w.comparison.curves) == 1 and not w.step.disabled


def test_runs_of_the_same_name_are_told_apart(tmp_path):
    from workbench.widgets.runs import RunBrowser

    for k, parent in enumerate(("gpu", "cpu")):
        write_run(tmp_path / parent / "tiny", [{"iteration": 1, "time": T0 + 1, "loss": 3.0 + k}])
    w = RunBrowser(tmp_path, show=False)
    assert sorted(label for label, _ in w.selection.options) == ["cpu/tiny", "gpu/tiny"]
    assert sorted(c.run for c in w.comparison.curves) == ["cpu/tiny", "gpu/tiny"]
    assert w.values.set_index("run").loc["cpu/tiny", "value"] == pytest.approx(4.0)


def test_a_run_or_metric_the_browser_does_not_have_is_refused_with_what_it_has(runs):
    from workbench.widgets.runs import RunBrowser

    root, ft, pre, *_ = runs
    w = RunBrowser(root, show=False)
    with pytest.raises(ValueError, match=r"selection: no run nope .*runs: .*ft"):
        w.set(selection=["nope"])
    w.set(selection=["pre"])
    with pytest.raises(ValueError, match=r"metric: 'accuracy' is not offered .*loss"):
        w.set(metric="accuracy")  # ft's metric; pre alone does not record it
    assert w.metric.value == "loss" and [c.run for c in w.comparison.curves] == ["pre"]
