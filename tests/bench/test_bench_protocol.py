"""bench/harness's measurement protocol on planted step times: the warm-up waits for steady steps (on two gloo ranks,
for the same steps on both), the timed median is the steady one, a run that never settles says so, repeats
interleave, and a ratio whose range crosses its target is not met."""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402


class Planted:
    """A fake step and clock: each call of ``step`` advances the clock by the next planted duration."""

    def __init__(self, durations):
        self.durations = iter(durations)
        self.now = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += next(self.durations)
        self.calls += 1


WARMUP = [3.0, 2.0, 1.5, 1.25, 1.12, 1.06, 1.03]  # a compile, then a slow settle
STEADY = [1.00, 1.01, 0.99, 1.02, 0.98, 1.005, 0.995]  # median 1.00


def test_warm_up_runs_until_the_last_steps_agree_then_the_median_is_the_steady_ones():
    p = harness.Protocol(steps=21, warmup_min=5, warmup_max=60, window=5, tolerance=0.03)
    t = Planted(WARMUP + list(itertools.islice(itertools.cycle(STEADY), 200)))
    res = harness.measure_steps(t.step, False, p, clock=t.clock)
    # the first window of 5 within 3%: 1.03 and the next four steady steps would span 1.03-0.99 = 4%: not yet
    times = WARMUP + list(itertools.islice(itertools.cycle(STEADY), 200))
    first = next(n for n in range(p.warmup_min, 100) if harness.settled(times[:n], 5, 0.03))
    assert res["steady"] and res["warmup_steps"] == first
    assert all(x <= 1.02 + 1e-9 for x in res["step_times"])  # nothing of the warm-up is timed
    assert len(res["step_times"]) == 21 and res["step_s"] == pytest.approx(1.00)
    assert t.calls == res["warmup_steps"] + 21


def test_a_run_that_never_settles_stops_at_the_bound_and_says_so():
    rng = random.Random(3)
    noisy = [1.0 + rng.uniform(-0.15, 0.15) for _ in range(500)]
    p = harness.Protocol(steps=20, warmup_min=5, warmup_max=25, window=5, tolerance=0.03)
    t = Planted(noisy)
    res = harness.measure_steps(t.step, False, p, clock=t.clock)
    assert not res["steady"] and res["warmup_steps"] == 25
    assert res["step_s"] == pytest.approx(sorted(noisy[25:45])[10])  # the upper median of the timed steps


def test_the_warm_up_is_bounded_in_seconds_too():
    p = harness.Protocol(steps=2, warmup_min=5, warmup_max=1000, warmup_max_s=10.0, window=5, tolerance=0.03)
    t = Planted([3.0, 1.0] * 100)  # never settles; 2 s a pair
    res = harness.warm_up(t.step, False, p, clock=t.clock)
    assert not res["steady"] and res["warmup_s"] >= 10.0 and res["warmup_steps"] < 10


def test_warm_up_ends_only_when_every_rank_votes_so():
    """``agree``: settled steps end the warm-up only when every rank settled; a rank at its bound stops all (``steady``
    false); then the timed steps."""
    p = harness.Protocol(steps=3, warmup_min=2, warmup_max=6, window=2, tolerance=10.0)
    calls = []
    res = harness.measure_steps(lambda: calls.append(1), False, p, agree=lambda settled, bound: (settled, bound))
    assert res["steady"] and res["warmup_steps"] == 2 and len(res["step_times"]) == 3 and len(calls) == 5
    # another rank never settles: this rank runs to its own bound, unsteady
    res = harness.measure_steps(lambda: None, False, p, agree=lambda settled, bound: (False, bound))
    assert not res["steady"] and res["warmup_steps"] == 6 and len(res["step_times"]) == 3
    # another rank reaches its bound first (after 3 steps): every rank stops there, unsteady, although this one settled
    votes = []

    def other_rank_bounded(settled: bool, bound: bool) -> tuple[bool, bool]:
        votes.append(settled)
        return False, bound or len(votes) >= 3

    res = harness.measure_steps(lambda: None, False, p, agree=other_rank_bounded)
    assert not res["steady"] and res["warmup_steps"] == 3


_TWO_RANKS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist
from bench import harness
from tests.bench.test_bench_protocol import Planted, rank_durations
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[3]}", rank=rank, world_size=2)
p = harness.Protocol(steps=4, warmup_min=5, warmup_max=60, window=5, tolerance=0.03)
t = Planted(rank_durations(rank))
res = harness.measure_steps(t.step, False, p, clock=t.clock, agree=harness.rank_vote("cpu"))
dist.barrier()
print(json.dumps({"rank": rank, "warmup_steps": res["warmup_steps"], "steady": res["steady"], "calls": t.calls}))
dist.destroy_process_group()
"""


def rank_durations(rank: int) -> list[float]:
    """Rank 0 is steady from its first step; rank 1 compiles, then settles slowly (the PP=2 exit hang's shape)."""
    return (WARMUP if rank else []) + list(itertools.islice(itertools.cycle(STEADY), 200))


def test_two_ranks_whose_steps_settle_apart_warm_up_for_the_same_steps():
    """Two gloo ranks under :func:`harness.rank_vote`: alone they would end their warm-ups steps apart (the later one
    then waits for its peer in a collective forever); voting, both run the later rank's count of steps."""
    import subprocess

    from tests.support import free_port

    p = harness.Protocol(steps=4, warmup_min=5, warmup_max=60, window=5, tolerance=0.03)
    alone = []
    for r in (0, 1):
        t = Planted(rank_durations(r))
        alone.append(harness.warm_up(t.step, False, p, clock=t.clock)["warmup_steps"])
    assert alone[0] < alone[1]
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_RANKS, str(ROOT), str(r), port], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [pr.communicate(timeout=120) for pr in procs]
    assert all(pr.returncode == 0 for pr in procs), [o[1][-2000:] for o in outs]
    rows = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert [r["warmup_steps"] for r in rows] == [alone[1], alone[1]] and all(r["steady"] for r in rows)
    assert rows[0]["calls"] == rows[1]["calls"] == alone[1] + 4


def test_slow_steps_say_their_time_so_a_cut_row_shows_how_far_it_got(capsys):
    p = harness.Protocol(steps=3, warmup_min=2, warmup_max=2, window=2, tolerance=0.03)
    t = Planted([40.0, 0.5, 7.25, 0.25, 12.0])  # warm-up: a 40 s compile, a fast step; timed: slow, fast, slow
    harness.measure_steps(t.step, False, p, clock=t.clock)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[harness] warm-up step 1: 40.00 s", "[harness] timed step 1/3: 7.25 s",
                     "[harness] timed step 3/3: 12.00 s"]


def test_repeats_run_interleaved_in_order():
    order = []
    sides = {name: (lambda i, name=name: order.append((name, i)) or {"tokens_per_s": 1.0}) for name in ("A", "B")}
    res = harness.interleaved(sides, 3)
    assert order == [("A", 0), ("B", 0), ("A", 1), ("B", 1), ("A", 2), ("B", 2)]
    assert all("repeat_wall_s" in r for r in res["A"] + res["B"])


@pytest.mark.parametrize("a, b, met", [
    ([120.0, 118.0, 122.0], [100.0, 108.0, 98.0], False),  # medians 1.20x, but 118 / 108 = 1.09x < 1.15
    ([120.0, 119.0, 122.0], [100.0, 101.0, 99.0], True),   # worst 119 / 101 = 1.178x
])
def test_a_target_is_met_only_when_the_worst_pairing_clears_it(a, b, met):
    r = harness.ratio(a, b, 1.15)
    assert r["ratio"] == pytest.approx(harness.median(a) / harness.median(b))
    assert r["worst"] == pytest.approx(min(a) / max(b)) and r["best"] == pytest.approx(max(a) / min(b))
    assert r["worst"] <= r["ratio"] <= r["best"]
    assert r["met"] is met


def test_compare_reports_both_sides_spread_and_refuses_a_missing_repeat():
    res = {"wb": [{"tokens_per_s": v} for v in (110.0, 100.0, 105.0)], "ref": [{"tokens_per_s": v} for v in (100.0, 90.0, 95.0)]}
    c = harness.compare(res, "wb", "ref", target=1.0)
    assert c["wb"]["median"] == 105.0 and c["wb"]["spread"] == pytest.approx(10.0 / 105.0)
    assert c["ref"]["repeats"] == [100.0, 90.0, 95.0] and c["met"] is True  # worst 100 / 100
    res["ref"][1] = {"error": "OOM"}
    assert harness.compare(res, "wb", "ref") is None


def test_the_command_line_sets_the_protocol_and_the_smoke_shrinks_it():
    ap = argparse.ArgumentParser()
    harness.add_protocol_args(ap)
    ap.add_argument("--cpu-smoke", action="store_true")
    p = harness.protocol(ap.parse_args([]))
    assert (p.steps, p.repeats, p.warmup_min) == (20, 3, 5)  # the brief's floor: >= 20 timed steps, >= 3 repeats
    p = harness.protocol(ap.parse_args(["--steps", "30", "--repeats", "4", "--warmup", "8", "--warmup-max", "4"]))
    assert (p.steps, p.repeats, p.warmup_min, p.warmup_max) == (30, 4, 8, 8)
    smoke = harness.protocol(ap.parse_args(["--cpu-smoke"]))
    assert smoke.steps <= 2 and smoke.repeats == 1
    assert harness.protocol(ap.parse_args([])).record()["name"] == harness.Protocol.NAME


def test_the_host_profile_names_where_a_step_spends_its_python_time():
    from bench import profiling

    def slow_part():
        return sum(i * i for i in range(20000))

    def step():
        slow_part()

    prof = profiling.host_profile(step, False, True, steps=2)
    assert prof["wall_ms_per_step_under_cprofile"] > 0
    assert any("slow_part" in r["fn"] and r["calls"] == 1 for r in prof["by_cumtime"])  # per step: called once
    assert profiling.host_profile(step, False, False) is None and profiling.profile_steps(step, False, True) is None  # no GPU


def test_the_device_time_counts_kernels_not_the_ranges_annotated_over_them():
    """A profiler's events of one step: two kernels, the optimizer's annotated range over one of them (on the device's
    timeline, as torch mirrors it) and a CPU op: the step's device time is the kernels' alone."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench import profiling

    def event(key, device_us, kind=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(key=key, device_type=kind, self_device_time_total=device_us, count=1,
                               is_user_annotation=annotation, self_cpu_time_total=0.0)

    events = [event("nvjet_sm90_gemm", 3000.0), event("multi_tensor_apply_kernel", 1000.0),
              event("Optimizer.step#AdamW.step", 1000.0, annotation=True), event("aten::mm", 0.0, DeviceType.CPU)]
    got = profiling.summary(SimpleNamespace(key_averages=lambda: events), steps=1, wall_s=0.005)
    assert got["device_ms_per_step"] == 4.0 and got["kernels_per_step"] == 2
    assert got["by_category_ms"] == {"gemm": 3.0, "optimizer / multi-tensor": 1.0}
    assert got["device_busy_fraction"] == 0.8


@pytest.mark.parametrize("durations, p", [
    (WARMUP + STEADY * 30, harness.Protocol(steps=21, warmup_min=5, warmup_max=60, window=5, tolerance=0.03)),
    ([1.0 + random.Random(3).uniform(-0.15, 0.15) for _ in range(80)],
     harness.Protocol(steps=20, warmup_min=5, warmup_max=25, window=5, tolerance=0.03)),
    ([3.0, 1.0] * 40, harness.Protocol(steps=2, warmup_min=5, warmup_max=1000, warmup_max_s=10.0, window=5, tolerance=0.03)),
], ids=["settles", "never-settles", "seconds-bound"])
def test_recorded_step_times_are_split_as_measure_steps_would_have(durations, p):
    """bench/moe_bench.py times the product's own runs from their step events: the same warm-up rule on the
    recorded times gives what driving the steps would have given."""
    t = Planted(durations)
    driven = harness.measure_steps(t.step, False, p, clock=t.clock)
    split = harness.split_recorded(durations, p)
    for key in ("warmup_steps", "steady", "step_times", "step_s"):
        assert split[key] == pytest.approx(driven[key]), key


def test_a_recorded_run_too_short_for_the_timed_steps_is_refused():
    p = harness.Protocol(steps=20, warmup_min=5, warmup_max=60, window=5, tolerance=0.03)
    with pytest.raises(ValueError, match="timed steps"):
        harness.split_recorded(WARMUP + STEADY * 2, p)


def test_a_gpu_probe_refuses_a_machine_without_one_and_appends_its_row(tmp_path, monkeypatch, capsys):
    """``bench.profiling.probe_args`` / ``probe_emit``: the kernel probes' shared command line and output."""
    import torch

    from bench import profiling

    monkeypatch.setattr(sys, "argv", ["probe", "--out", str(tmp_path / "rows.jsonl")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profiling.probe_args("some_probe", "What it measures.\n\nMore.") is None
    assert "some_probe: needs a GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = profiling.probe_args("some_probe", "What it measures.")
    for ms in (1.5, 2.5):
        profiling.probe_emit({"probe": "some_probe", "ms": ms}, args.out)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert rows == [{"probe": "some_probe", "ms": 1.5}, {"probe": "some_probe", "ms": 2.5}]
    assert [json.loads(line)["ms"] for line in capsys.readouterr().out.splitlines()] == [1.5, 2.5]
