"""Runs overlaid on one metric (workbench/plots/compare.py), on run directories written with the real event writer."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from workbench.plots.compare import (GIB, available_metrics, compare_runs, ema, find_runs, metric_curve, run_metrics,
                                     runs_frame)

from tests.support.event_runs import T0, config, write_run


def _lines(comp, prefix: str) -> dict:
    """The figure's lines whose gid starts with ``prefix:``, by run name."""
    ax = comp.figure.axes[0]
    return {ln.get_gid().split(":", 1)[1]: ln for ln in ax.get_lines() if (ln.get_gid() or "").startswith(prefix + ":")}


def _ema_expected(values, w):
    """TensorBoard's debiased EMA written out as a weighted mean: s_k = sum_i w^(k-i) y_i / sum_i w^(k-i)."""
    out = []
    for k in range(len(values)):
        weights = [w ** (k - i) for i in range(k + 1)]
        out.append(sum(wt * y for wt, y in zip(weights, values[: k + 1])) / sum(weights))
    return out


@pytest.fixture
def two_runs(tmp_path):
    """``alpha``: a fine-tuning-like run (train and eval accuracy, two ranks of which rank 1 holds the loss, memory);
    ``beta``: a pretraining run logging every other step, no accuracy, on CPU (no MFU, no memory)."""
    a_loss = [2.0, 1.5, 1.2, 1.0, 0.9]
    a_steps = []
    for i, loss in enumerate(a_loss, 1):
        t = T0 + 10.0 * i
        common = {"iteration": i, "time": t, "lr": 1e-3 * i, "consumed_samples": 8 * i, "skipped": False}
        a_steps.append({**common, "rank": 0, "loss": None, "tokens_per_s": 100.0 * i, "grad_norm": 1.0,
                        "mem_allocated": 2 * GIB, "mfu": 0.10})
        a_steps.append({**common, "rank": 1, "loss": loss, "tokens_per_s": 100.0 * i + 7, "grad_norm": 1.0,
                        "mem_allocated": 3 * GIB, "mfu": 0.20, "accuracy": 0.5 + 0.1 * i})
    a_evals = [{"iteration": 3, "time": T0 + 31, "rank": 1, "loss": 1.3, "ppl": math.exp(1.3), "accuracy": 0.62},
               {"iteration": 5, "time": T0 + 51, "rank": 1, "loss": 1.1, "ppl": math.exp(1.1), "accuracy": 0.71}]
    alpha = write_run(tmp_path / "runs" / "alpha", a_steps, a_evals, ranks=(0, 1),
                      cfg=config(seq_length=16, global_batch_size=8, train_iters=5, arch="bert", num_labels=2, nproc=2))
    b_loss = {2: 3.0, 4: 2.5, 6: 2.4, 8: 2.0}
    b_steps = [{"iteration": i, "time": T0 + 5.0 * i, "loss": v, "tokens_per_s": 300.0 + 50 * i, "grad_norm": 2.0,
                "lr": 5e-4, "mfu": None, "mem_allocated": None} for i, v in b_loss.items()]
    beta = write_run(tmp_path / "runs" / "nested" / "beta", b_steps, [{"iteration": 8, "time": T0 + 41, "loss": 2.2,
                                                                        "ppl": math.exp(2.2)}],
                     cfg=config(seq_length=32, global_batch_size=4, train_iters=10))
    return alpha, beta, a_loss, b_loss


def test_overlay_has_one_line_per_run_with_its_values(two_runs):
    alpha, beta, a_loss, b_loss = two_runs
    comp = compare_runs([alpha, beta], "loss", smoothing=0.0)
    ax = comp.figure.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["alpha", "beta"]
    raw = _lines(comp, "raw")
    assert set(raw) == {"alpha", "beta"} and not _lines(comp, "smoothed")  # no smoothing: the raw curve alone
    assert list(raw["alpha"].get_xdata()) == [1, 2, 3, 4, 5]
    assert list(raw["alpha"].get_ydata()) == pytest.approx(a_loss)  # rank 1 holds the loss; rank 0's None is skipped
    assert list(raw["beta"].get_xdata()) == list(b_loss) and list(raw["beta"].get_ydata()) == pytest.approx(list(b_loss.values()))
    # each run's last value: a marker on its last point and the number written beside it
    last = _lines(comp, "last")
    assert list(last["beta"].get_xdata()) == [8] and list(last["beta"].get_ydata()) == [b_loss[8]]
    texts = {t.get_gid(): t.get_text() for t in ax.texts}
    assert texts["last value:alpha"] == f"{a_loss[-1]:.4g}" and texts["last value:beta"] == f"{b_loss[8]:.4g}"
    assert ax.get_yscale() == "linear" and comp.lacking == []


def test_ranks_are_combined_per_step(two_runs):
    alpha, *_ = two_runs
    tput = metric_curve(alpha, "tokens_per_s")
    assert tput.y == [100.0 * i for i in range(1, 6)]  # the slowest rank's tokens/s: the job's pace
    mem = metric_curve(alpha, "mem_allocated")
    assert mem.y == pytest.approx([3.0] * 5)  # the worst rank's memory, in GiB
    mfu = metric_curve(alpha, "mfu")
    assert mfu.y == pytest.approx([10.0] * 5)  # the slowest rank's, like tokens/s, in percent


def test_smoothing_draws_the_ema_over_the_faint_raw_curve(two_runs):
    alpha, beta, a_loss, b_loss = two_runs
    w = 0.7
    comp = compare_runs([alpha, beta], "loss", smoothing=w)
    smoothed, raw = _lines(comp, "smoothed"), _lines(comp, "raw")
    assert list(smoothed["alpha"].get_ydata()) == pytest.approx(_ema_expected(a_loss, w))
    assert list(smoothed["beta"].get_ydata()) == pytest.approx(_ema_expected(list(b_loss.values()), w))
    assert list(raw["alpha"].get_ydata()) == pytest.approx(a_loss)  # the raw curve stays, faint
    assert raw["alpha"].get_alpha() < 0.5 and (smoothed["alpha"].get_alpha() or 1.0) == 1.0
    assert raw["alpha"].get_color() == smoothed["alpha"].get_color()
    # the legend names each run once (the smoothed curve), never the faint one
    assert [t.get_text() for t in comp.figure.axes[0].get_legend().get_texts()] == ["alpha", "beta"]
    assert ema([4.0, 1.0], 0.0) == [4.0, 1.0]
    with pytest.raises(ValueError):
        ema([1.0], 1.0)
    with pytest.raises(ValueError):
        compare_runs([alpha], "loss", smoothing=-0.1)


def test_log_scale(two_runs):
    alpha, beta, *_ = two_runs
    assert compare_runs([alpha, beta], "grad_norm", log_y=True).figure.axes[0].get_yscale() == "log"
    assert compare_runs([alpha, beta], "grad_norm").figure.axes[0].get_yscale() == "linear"


def test_metrics_are_discovered_from_the_events(two_runs):
    alpha, beta, *_ = two_runs
    a, b = run_metrics(alpha), run_metrics(beta)
    assert {"loss", "accuracy", "eval loss", "eval ppl", "eval accuracy", "tokens_per_s", "mfu", "mem_allocated",
            "grad_norm", "lr"} <= set(a)
    assert a["eval accuracy"] == 2 and a["loss"] == 5
    assert "accuracy" not in b and "eval accuracy" not in b
    assert "mfu" not in b and "mem_allocated" not in b  # empty on CPU: not a metric of that run
    for not_a_metric in ("iteration", "time", "rank", "skipped", "consumed_samples"):
        assert not_a_metric not in a
    union = available_metrics([alpha, beta])
    assert set(union) == set(a) | set(b) and union[0] == "loss"


def test_fine_tuning_accuracy_is_plotted_and_a_run_without_it_is_named(two_runs):
    alpha, beta, *_ = two_runs
    comp = compare_runs([alpha, beta], "eval accuracy", smoothing=0.0)
    assert [c.run for c in comp.curves] == ["alpha"] and comp.lacking == ["beta"]
    raw = _lines(comp, "raw")
    assert list(raw["alpha"].get_xdata()) == [3, 5] and list(raw["alpha"].get_ydata()) == pytest.approx([0.62, 0.71])
    notes = [t.get_text() for t in comp.figure.axes[0].texts if t.get_gid() == "notes"]
    assert notes and "beta" in notes[0]
    table = comp.values_at(4)
    row = table.set_index("run").loc["beta"]
    assert "does not record eval accuracy" in row["note"] and math.isnan(row["value"])
    assert table.set_index("run").loc["alpha", "value"] == pytest.approx(0.62)  # the last point at or before step 4
    # the train accuracy of the steps too
    assert metric_curve(alpha, "accuracy").y == pytest.approx([0.5 + 0.1 * i for i in range(1, 6)])
    # no run records it: an empty figure that says so, no exception
    none = compare_runs([beta], "eval accuracy")
    assert none.curves == [] and none.lacking == ["beta"]
    assert any("no run records eval accuracy" in t.get_text() for t in none.figure.axes[0].texts)


def test_x_axes_tokens_and_wall_time(two_runs):
    alpha, beta, *_ = two_runs
    tok = metric_curve(alpha, "loss", x="tokens")
    assert tok.x == [8.0 * i * 16 for i in range(1, 6)]  # consumed samples x seq_length
    ev = metric_curve(beta, "eval loss", x="tokens")
    assert ev.x == [8 * 4 * 32.0]  # no step record at its step's consumed samples: step x global batch x seq_length
    wall = metric_curve(beta, "loss", x="wall time")
    assert wall.x == pytest.approx([5.0 * i for i in (2, 4, 6, 8)])  # seconds since run_start
    comp = compare_runs([alpha, beta], "loss", x="tokens", at_step=4)
    assert comp.figure.axes[0].get_xlabel() == "tokens"
    assert comp.values_at(4).set_index("run").loc["alpha", "tokens"] == 4 * 8 * 16
    with pytest.raises(ValueError):
        metric_curve(alpha, "loss", x="epochs")


def test_values_at_a_step(two_runs):
    alpha, beta, a_loss, b_loss = two_runs
    comp = compare_runs([alpha, beta], "loss", smoothing=0.5, at_step=5)
    t = comp.values_at(5).set_index("run")
    assert t.loc["alpha", "step"] == 5 and t.loc["alpha", "value"] == pytest.approx(a_loss[4])
    assert t.loc["beta", "step"] == 4 and t.loc["beta", "value"] == pytest.approx(b_loss[4])  # as of step 5
    assert t.loc["beta", "smoothed"] == pytest.approx(_ema_expected([3.0, 2.5], 0.5)[-1])
    early = comp.values_at(1).set_index("run")
    assert early.loc["alpha", "value"] == pytest.approx(a_loss[0]) and math.isnan(early.loc["beta", "value"])
    assert [ln.get_xdata()[0] for ln in comp.figure.axes[0].get_lines() if ln.get_gid() == "at step"] == [5.0]
    assert comp.steps() == sorted({1, 2, 3, 4, 5} | set(b_loss))


def test_a_resumed_run_keeps_the_newest_record_of_a_step(tmp_path):
    run = write_run(tmp_path / "resumed", [
        {"iteration": 1, "time": T0 + 1, "loss": 5.0}, {"iteration": 2, "time": T0 + 2, "loss": 4.0},
        # restarted from the checkpoint of step 1: step 2 again, then on
        {"iteration": 2, "time": T0 + 10, "loss": 3.5}, {"iteration": 3, "time": T0 + 11, "loss": 3.0}])
    c = metric_curve(run, "loss")
    assert c.steps == [1, 2, 3] and c.y == [5.0, 3.5, 3.0]


def test_runs_under_a_folder_and_their_table(two_runs, tmp_path):
    alpha, beta, a_loss, b_loss = two_runs
    hf = tmp_path / "runs" / "exported-hf"  # a folder with a config.json that is not a run
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    found = find_runs(tmp_path / "runs")
    assert sorted(p.name for p in found) == ["alpha", "beta"]
    assert find_runs(alpha) == [alpha]  # a run directory itself
    assert find_runs(tmp_path / "nowhere") == []
    df = runs_frame([alpha, beta]).set_index("run")
    assert df.loc["alpha", "family"] == "bert classifier" and df.loc["beta", "family"] == "gpt"
    assert df.loc["alpha", "layout"] == "tp1 pp1 dp2" and df.loc["beta", "layout"] == "tp1 pp1 dp1"
    assert df.loc["alpha", "steps"] == "5/5" and df.loc["beta", "steps"] == "8/10"
    assert df.loc["alpha", "last loss"] == pytest.approx(a_loss[-1]) and df.loc["beta", "last loss"] == pytest.approx(b_loss[8])
    assert set(df["status"]) == {"finished"}
    # tokens/s follows the last loss; these records carry no step time, so no run-level throughput: empty cells
    assert list(df.columns).index("tokens/s") == list(df.columns).index("last loss") + 1
    assert df["tokens/s"].isna().all()


def test_the_tables_tokens_per_s_is_the_runs_throughput_as_final_metrics_reports_it(tmp_path):
    """Two ranks, rank 1 the slower; a slow first step (warm-up) and a pause (an eval) before step 4: the table's
    tokens/s is the tokens of steps 2..N over the wall time between the first and the last step event, the same
    number ``Run.final_metrics`` (a sweep's metrics.json) gives, not a mean or median of the per-step rates."""
    from workbench.launch import Run

    seq, gbs = 32, 4
    tokens = seq * gbs  # per step, the whole job's
    step_times = {1: 3.0, 2: 0.5, 3: 0.5, 4: 1.0, 5: 0.5}  # rank 0's; rank 1 takes 1.25x as long
    pauses = {4: 2.0}
    slow = 1.25
    steps, start = [], T0
    for i, st in step_times.items():
        start += pauses.get(i, 0.0)
        for rank, factor in ((0, 1.0), (1, slow)):  # each rank writes its record when its own step ends
            steps.append({"iteration": i, "time": start + st * factor, "rank": rank, "loss": 4.0 - 0.1 * i,
                          "step_time": st * factor, "tokens_per_s": tokens / (st * factor),
                          "consumed_samples": gbs * i})
        start += st * slow  # the next step starts when the slowest rank is done
    run = write_run(tmp_path / "runs" / "timed", steps, ranks=(0, 1),
                    cfg=config(seq_length=seq, global_batch_size=gbs, train_iters=5, nproc=2))
    untimed = write_run(tmp_path / "runs" / "untimed", [{"iteration": 1, "time": T0 + 1, "loss": 5.0}])
    empty = write_run(tmp_path / "runs" / "empty", [])  # started, no step yet

    ends = {i: max(s["time"] for s in steps if s["iteration"] == i) for i in step_times}  # the slowest rank's
    wall = ends[5] - ends[1]  # steps 2..5 happen between the first and the last step's end
    busy = sum(st * slow for i, st in step_times.items() if i > 1)  # the slowest rank's step times
    expected = tokens * (len(step_times) - 1) / max(wall, busy)
    df = runs_frame([run, untimed, empty]).set_index("run")
    assert df.loc["timed", "tokens/s"] == pytest.approx(expected)
    assert df.loc["timed", "tokens/s"] == pytest.approx(Run(run).final_metrics()["tokens_per_s"])  # one definition
    rates = sorted(tokens / (st * slow) for i, st in step_times.items() if i > 1)
    assert abs(df.loc["timed", "tokens/s"] - (rates[1] + rates[2]) / 2) > 0.1 * expected  # not the median rate
    # no throughput recorded (no tokens/s, no step record at all): an empty cell, not an error
    assert math.isnan(df.loc["untimed", "tokens/s"]) and math.isnan(df.loc["empty", "tokens/s"])
    assert df.loc["empty", "steps"] == "0/10"


def test_labels_must_name_every_run(two_runs):
    alpha, beta, *_ = two_runs
    with pytest.raises(ValueError, match="labels: 1 given for 2 runs"):
        compare_runs([alpha, beta], "loss", labels=["only one"])
    comp = compare_runs([alpha, beta], "loss", labels=["a", "b"])
    assert sorted(c.run for c in comp.curves) == ["a", "b"]


def test_the_family_column_is_the_familys_own_label(tmp_path):
    """The run browser's family column comes from each family's declaration (``Family.label``), not from a list of
    family-specific fields in the plots package: GPT names its experts, BERT its classification head; a family this
    version does not know keeps its saved name."""
    from workbench.families import FAMILIES
    from workbench.plots.compare import run_summary

    assert FAMILIES["gpt"].label({"arch": "gpt", "moe": {"num_experts": 8}}) == "gpt moe"
    assert FAMILIES["gpt"].label({"arch": "gpt", "moe": {"num_experts": 1}}) == "gpt"
    assert FAMILIES["bert"].label({"arch": "bert", "num_labels": 3}) == "bert classifier"
    assert FAMILIES["t5"].label({"arch": "t5", "num_labels": 3, "moe": {"num_experts": 8}}) == "t5"

    run = write_run(tmp_path / "other", [{"iteration": 1, "time": T0 + 1, "loss": 5.0}], cfg=config(arch="mamba", train_iters=3))
    row = run_summary(run)
    assert row["family"] == "mamba" and row["steps"] == "1/3"
