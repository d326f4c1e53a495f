"""Measured-vs-ideal overlay on synthetic event directories written with the real EventWriter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.run.events import EventWriter
from workbench.schedules import ScheduleError, load_measured, measured_report, simulate

from tests.support import write_run


def _partition_ok(report):
    for r in report["ranks"]:
        parts = r["time_ms"]
        assert sum(parts.values()) == pytest.approx(report["measured_step_ms"], rel=1e-9)


def test_ideal_events_reproduce_the_ideal_timeline(tmp_path):
    tl = simulate("1f1b", 2, 4, forward=10.0, backward=20.0, unit="ms")
    write_run(tmp_path, {5: tl})
    ms = load_measured(tmp_path)
    assert ms.iteration == 5 and ms.timeline.p == 2 and ms.timeline.m == 4 and ms.device == "synthetic"
    ideal, report = measured_report(ms)
    for r in range(2):
        assert [(o.kind, o.microbatch, o.start, o.end) for o in ideal.ops[r]] == \
               [(o.kind, o.microbatch, o.start, o.end) for o in tl.ops[r]]
    assert report["measured_bubble_fraction"] == pytest.approx(0.25)
    assert report["ideal_bubble_fraction"] == pytest.approx(0.25)
    assert report["closed_form_bubble_fraction"] == pytest.approx(0.25)
    assert report["time_ms"]["comm"] == pytest.approx(0.0)
    assert report["stragglers"] == []
    _partition_ok(report)


def test_send_recv_latency_shows_up_as_comm_time(tmp_path):
    tl = simulate("1f1b", 2, 4, forward=10.0, backward=20.0, latency=2.0, unit="ms")
    write_run(tmp_path, {3: tl})
    _, report = measured_report(load_measured(tmp_path))
    assert report["measured_bubble_fraction"] > report["ideal_bubble_fraction"] == pytest.approx(0.25)
    assert report["time_ms"]["comm"] > 0
    # rank 1's first forward waits for rank 0's F0 (10 ms: pipeline dependency) then 2 ms of send/recv
    r1 = report["ranks"][1]["time_ms"]
    assert r1["wait_upstream"] >= 10.0 and r1["comm"] >= 2.0
    assert report["measured_step_ms"] == pytest.approx(tl.step_time)
    _partition_ok(report)
    assert "comm" in report["summary"]


def test_straggler_rank_is_named(tmp_path):
    tl = simulate("1f1b", 3, 6, forward=[10, 16, 10], backward=[20, 32, 20], unit="ms")
    write_run(tmp_path, {1: tl})
    _, report = measured_report(load_measured(tmp_path))
    assert report["stragglers"] == [1]
    assert report["ranks"][1]["mean_forward_ms"] == pytest.approx(16.0)
    assert "Stragglers" in report["summary"]


def test_tp_ranks_map_to_their_pipeline_stage(tmp_path):
    tl = simulate("1f1b", 2, 4, forward=10.0, backward=20.0, unit="ms")
    write_run(tmp_path, {2: tl}, tp=2, tp_shift_ms=100.0)  # global ranks 0,1 -> pp 0; 2,3 -> pp 1
    ms = load_measured(tmp_path)
    assert ms.global_ranks == [0, 2]
    assert ms.timeline.step_time == pytest.approx(tl.step_time)


def test_interleaved_overlay_figure_and_report(tmp_path):
    from workbench.plots.schedule import measured_overlay

    tl = simulate("interleaved", 2, 4, 2, forward=[8.0, 12.0], backward=[16.0, 24.0], latency=0.5, unit="ms")
    write_run(tmp_path, {4: tl, 8: tl})
    fig, report = measured_overlay(tmp_path)
    assert report["schedule"] == "interleaved" and report["v"] == 2 and report["iteration"] == 8
    assert report["closed_form_bubble_fraction"] == pytest.approx(1 / 8)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 ideal", "rank 0 measured", "rank 1 ideal", "rank 1 measured"]
    assert f"{report['measured_bubble_fraction']:.3f}" in ax.get_title()
    out = tmp_path / "overlay.png"
    fig.savefig(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _partition_ok(report)


def test_iteration_selection(tmp_path):
    tl = simulate("1f1b", 2, 2, unit="ms")
    write_run(tmp_path, {5: tl, 10: tl}, skip={(10, 1)})
    assert load_measured(tmp_path).iteration == 5  # 10 lacks pipeline rank 1
    with pytest.raises(ScheduleError, match="iteration 10"):
        load_measured(tmp_path, iteration=10)


def test_missing_events_are_clear_errors(tmp_path):
    with pytest.raises(ScheduleError, match="no events/"):
        load_measured(tmp_path)
    with EventWriter(tmp_path, 0) as w:
        w.emit("step", iteration=1, loss=1.0)
    with pytest.raises(ScheduleError, match="microbatch_timing_interval"):
        load_measured(tmp_path)


def test_evidence_runs_finds_only_dirs_with_microbatch_timings(tmp_path):
    from workbench.schedules import evidence_runs

    assert evidence_runs(tmp_path) == []
    runs = tmp_path / "evidence" / "runs"
    write_run(runs / "pp2", {1: simulate("1f1b", 2, 2, unit="ms")})
    with EventWriter(runs / "no_timings", 0) as w:
        w.emit("step", iteration=1, loss=2.0)
    assert evidence_runs(runs) == [runs / "pp2"]


def test_unmatched_backward_ids_are_repaired_from_mcore_order(tmp_path):
    tl = simulate("interleaved", 2, 4, 2, forward=5.0, backward=10.0, unit="ms")
    write_run(tmp_path, {1: tl})
    # the backend writes microbatch/chunk -1 for a backward it could not match: blank two of rank 1's
    path = tmp_path / "events" / "rank-1.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    ops = lines[-1]["ops"]
    blanked = [i for i, o in enumerate(ops) if o["kind"] == "B"][:2]
    for i in blanked:
        ops[i]["microbatch"] = ops[i]["chunk"] = -1
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ms = load_measured(tmp_path)
    assert ms.repaired_ops == 2 and ms.dropped_ops == 0
    assert [(o.kind, o.microbatch, o.chunk) for o in ms.timeline.ops[1]] == \
           [(o.kind, o.microbatch, o.chunk) for o in tl.ops[1]]
    # m comes from the run's config through derive(): a config saying 2 micro-batches wins over the events
    other = write_run(tmp_path / "other", {1: tl})
    cfg = json.loads((other / "config.json").read_text())
    cfg["train"]["global_batch_size"] = 2 * cfg["train"]["micro_batch_size"]
    (other / "config.json").write_text(json.dumps(cfg))
    ms = load_measured(other)
    assert ms.timeline.m == 2 and ms.dropped_ops > 0
    _, report = measured_report(ms)
    assert report["dropped_ops"] == ms.dropped_ops and "dropped" in report["summary"]


def test_measured_durations_feed_what_if_simulations(tmp_path, capsys):
    from workbench.cli import main
    from workbench.schedules import measured_durations

    tl = simulate("1f1b", 2, 4, forward=[10.0, 14.0], backward=[20.0, 28.0], unit="ms")
    write_run(tmp_path, {1: tl})
    d = measured_durations(tmp_path)
    assert d["forward"] == pytest.approx([10.0, 14.0]) and d["backward"] == pytest.approx([20.0, 28.0])
    bigger = simulate("1f1b", 2, 16, **d)
    assert bigger.unit == "ms" and bigger.step_time >= 16 * (14.0 + 28.0)
    assert main(["schedule", "--pp", "2", "--microbatches", "16", "--from-run", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["metrics"]["step_time"] == pytest.approx(bigger.step_time) and out["unit"] == "ms"
    assert main(["schedule", "--pp", "4", "--microbatches", "16", "--from-run", str(tmp_path)]) == 2
    assert "use the run's p and v" in capsys.readouterr().err


def test_clock_skew_between_ranks_is_removed_only_when_causality_demands(tmp_path):
    from workbench.schedules import align_clocks

    tl = simulate("1f1b", 2, 4, forward=10.0, backward=20.0, latency=1.0, unit="ms")
    # rank 1's clock started 4 ms late: its times read 4 ms early, so its F0 "starts" before rank 0's F0 ends
    skewed = [tl.ops[0], [type(o)(o.rank, o.kind, o.microbatch, o.chunk, o.start - 4.0, o.end - 4.0) for o in tl.ops[1]]]
    fixed, shifts = align_clocks(skewed, 2)
    # forwards need shift >= 10 - 7 = 3 (F0: r0 ends 10, r1 starts 11 - 4 = 7); backwards allow up to 5
    assert shifts == pytest.approx([0.0, 3.0])
    assert fixed[1][0].start == pytest.approx(fixed[0][0].end)
    same, none = align_clocks(tl.ops, 2)  # consistent clocks are left alone
    assert none == [0.0, 0.0] and same == tl.ops


def _slivers(tmp_path):
    """An interleaved run whose stages are unequal (the last holds the head and the loss: 4.4x the first's time),
    so the first rank idles longer than it computes and its backward chunks are slivers of the step."""
    tl = simulate("interleaved", 2, 8, 2, forward=[1.5, 6.6], backward=[0.6, 5.4], latency=0.5, unit="ms")
    write_run(tmp_path, {3: tl})
    return load_measured(tmp_path)


def test_the_measured_table_shows_shares_of_the_step_and_the_summary_says_why_ideal_is_not_the_closed_form(tmp_path):
    from workbench.plots.schedule import measured_table

    _, report = measured_report(_slivers(tmp_path))
    assert report["ranks"][0]["measured_bubble_fraction"] > 1  # idle / compute: a ratio, not a fraction of anything
    table = measured_table(report)
    shares = [c for c in table.columns if "idle share" in c]
    assert len(shares) == 2 and not [c for c in table.columns if "bubble" in c], list(table.columns)
    assert ((table[shares] >= 0) & (table[shares] < 1)).all().all(), table[shares]
    assert table[shares[0]][0] == pytest.approx(report["ranks"][0]["measured_idle_share"], abs=1e-3)
    # the ideal is not the closed form here, and the summary says which assumption of the closed form the run breaks
    assert report["ideal_bubble_fraction"] > 2 * report["closed_form_bubble_fraction"]
    assert report["stage_imbalance"] == pytest.approx(12.0 / 2.1)
    summary = report["summary"]
    assert "assumes equal stages and free send/recv" in summary and f"{report['stage_imbalance']:.2f}x" in summary, summary
    assert "idle / compute" in summary


def test_every_measured_interleaved_block_is_labelled_in_it_or_in_the_lane_under_it(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from workbench.plots.schedule import LABEL_SIZES, overlay

    ms = _slivers(tmp_path)
    ideal, report = measured_report(ms)
    fig = overlay(ms.timeline, ideal, report)
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    ops = [o for r in range(2) for o in ms.timeline.ops[r]]
    texts = [t for t in ax.texts if t.get_text()]
    labels = sorted(t.get_text().replace("\n", " ") for t in texts)
    assert labels == sorted(f"{o.kind}{o.microbatch} c{o.chunk}" for o in ops)  # each block once, with its chunk
    assert all(t.get_fontsize() >= LABEL_SIZES[-1] for t in texts)
    upright = [t for t in texts if t.get_rotation() == 90]
    assert upright, "the slivers should be labelled in the lane"
    axes_box = ax.get_window_extent(renderer)
    boxes = sorted((t.get_window_extent(renderer) for t in upright), key=lambda b: (round(b.y0), b.x0))
    for a in boxes:
        assert axes_box.x0 - 0.5 <= a.x0 and a.x1 <= axes_box.x1 + 0.5 and axes_box.y0 - 0.5 <= a.y0, (a, axes_box)
    for a, b in zip(boxes, boxes[1:]):  # upright labels of one lane never overlap
        assert not (a.overlaps(b) and a.x1 - b.x0 > 0.5 and b.x1 - a.x0 > 0.5), (a, b)
