"""Pipeline schedule simulator: mcore's operation order, timings, metrics and invariants."""

from __future__ import annotations

import itertools
import random

import pytest

from workbench.schedules import (
    ScheduleError,
    check_schedule,
    closed_form_bubble_fraction,
    inflight_chunks,
    inflight_microbatches,
    operation_order,
    schedule_table,
    simulate,
    warmup_microbatches,
)

F, B = "F", "B"


# --------------------------------------------------------------------------- hand-worked orders


def test_1f1b_p2_m4_order_hand_worked():
    # rank 0: warm-up min(p - 0 - 1, m) = 1 forward, 3 steady (F, B) pairs, 1 cool-down backward.
    assert operation_order("1f1b", 2, 4, rank=0) == [
        (F, 0, 0), (F, 1, 0), (B, 0, 0), (F, 2, 0), (B, 1, 0), (F, 3, 0), (B, 2, 0), (B, 3, 0)]
    # rank 1 (last stage): no warm-up, strict F/B alternation.
    assert operation_order("1f1b", 2, 4, rank=1) == [
        (F, 0, 0), (B, 0, 0), (F, 1, 0), (B, 1, 0), (F, 2, 0), (B, 2, 0), (F, 3, 0), (B, 3, 0)]


def test_interleaved_p2_v2_m4_order_hand_worked():
    # Schedule table (group size g = p = 2): virtual ids 0..7 ->
    #   (mb, chunk) = (0,0) (1,0) (0,1) (1,1) | (2,0) (3,0) (2,1) (3,1)
    # Backward k walks the same table with chunk -> v - 1 - chunk.
    # rank 0 warm-up = 2 (p - 0 - 1) + (v - 1) g = 4; rank 1 warm-up = 0 + 2 = 2.
    assert operation_order("interleaved", 2, 4, 2, rank=0) == [
        (F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),          # warm-up
        (F, 2, 0), (B, 0, 1), (F, 3, 0), (B, 1, 1),          # steady: F(k+4), B(k)
        (F, 2, 1), (B, 0, 0), (F, 3, 1), (B, 1, 0),
        (B, 2, 1), (B, 3, 1), (B, 2, 0), (B, 3, 0)]          # cool-down
    assert operation_order("interleaved", 2, 4, 2, rank=1) == [
        (F, 0, 0), (F, 1, 0),
        (F, 0, 1), (B, 0, 1), (F, 1, 1), (B, 1, 1), (F, 2, 0), (B, 0, 0),
        (F, 3, 0), (B, 1, 0), (F, 2, 1), (B, 2, 1), (F, 3, 1), (B, 3, 1),
        (B, 2, 0), (B, 3, 0)]


def test_gpipe_order_is_all_forward_then_all_backward():
    assert operation_order("gpipe", 3, 3, rank=1) == [(F, 0, 0), (F, 1, 0), (F, 2, 0), (B, 0, 0), (B, 1, 0), (B, 2, 0)]


def test_1f1b_p2_m4_timing_hand_worked():
    # F = 1, B = 2.  Worked by hand:
    # r0: F0 0-1  F1 1-2  B0 4-6  F2 6-7  B1 7-9   F3 9-10  B2 10-12  B3 13-15
    # r1: F0 1-2  B0 2-4  F1 4-5  B1 5-7  F2 7-8   B2 8-10  F3 10-11  B3 11-13
    tl = simulate("1f1b", 2, 4, forward=1.0, backward=2.0)
    got = [[(o.kind, o.microbatch, o.start, o.end) for o in ops] for ops in tl.ops]
    assert got[0] == [(F, 0, 0, 1), (F, 1, 1, 2), (B, 0, 4, 6), (F, 2, 6, 7), (B, 1, 7, 9), (F, 3, 9, 10),
                      (B, 2, 10, 12), (B, 3, 13, 15)]
    assert got[1] == [(F, 0, 1, 2), (B, 0, 2, 4), (F, 1, 4, 5), (B, 1, 5, 7), (F, 2, 7, 8), (B, 2, 8, 10),
                      (F, 3, 10, 11), (B, 3, 11, 13)]
    assert tl.step_time == 15
    assert tl.busy(0) == tl.busy(1) == 12
    assert tl.bubble(0) == tl.bubble(1) == 3
    assert tl.bubble_fraction() == pytest.approx(0.25)
    assert tl.idle_gaps(0) == [(2, 4), (12, 13)]
    assert tl.idle_gaps(1) == [(0, 1), (13, 15)]


def test_latency_adds_to_every_cross_rank_hop():
    # p=2, m=1, F=1, B=2, latency L: F0 r0 0-1, F0 r1 (1+L)-(2+L), B0 r1 -(4+L), B0 r0 (4+2L)-(6+2L).
    tl = simulate("1f1b", 2, 1, forward=1, backward=2, latency=0.5)
    assert [(o.start, o.end) for o in tl.ops[1]] == [(1.5, 2.5), (2.5, 4.5)]
    assert [(o.start, o.end) for o in tl.ops[0]] == [(0, 1), (5.0, 7.0)]
    assert tl.step_time == 7.0


# --------------------------------------------------------------------------- cross-check with megatron-core


def test_table_and_warmup_match_megatron_core():
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    class _Group:  # stands in for the pipeline process group: only size() and rank() are read
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    class _Comm:
        def __init__(self, p, r, v):
            self.pp_group = _Group(p, r)
            self.virtual_pipeline_model_parallel_size = v

    checked = 0
    for p, v, m in itertools.product(range(2, 6), range(1, 4), range(1, 13)):
        for g in range(p, m + 1):
            if v > 1:
                assert schedule_table(m, v, g) == get_schedule_table(m, v, g)
            for r in range(p):
                _, _, warm, _ = get_pp_rank_microbatches(m, v, g, p2p_communicator=_Comm(p, r, v if v > 1 else None))
                ours = warmup_microbatches("interleaved" if v > 1 else "1f1b", p, m, v, r, g if v > 1 else None)
                assert ours == warm, (p, v, m, g, r)
                checked += 1
    assert checked > 500


# --------------------------------------------------------------------------- metrics vs closed forms


def _layouts():
    for p in range(1, 7):
        for m in range(1, 17):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
            for v in (2, 3, 4):
                if p >= 2 and m % p == 0:
                    yield "interleaved", p, m, v


@pytest.mark.parametrize("fwd,bwd", [(1.0, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_bubble_fraction_matches_closed_forms_on_a_grid(fwd, bwd):
    n = 0
    for sched, p, m, v in _layouts():
        tl = simulate(sched, p, m, v, forward=fwd, backward=bwd)
        expected = (p - 1) / (m * (v if sched == "interleaved" else 1))
        assert tl.bubble_fraction() == pytest.approx(expected, abs=1e-9), (sched, p, m, v)
        for r in range(p):  # uniform stages: every rank idles the same
            assert tl.bubble_fraction(r) == pytest.approx(expected, abs=1e-9)
        assert closed_form_bubble_fraction(sched, p, m, v) == pytest.approx(expected)
        # step = ideal compute + bubble: (m + p - 1)(f + b) for 1F1B, textbook
        if sched == "1f1b":
            assert tl.step_time == pytest.approx((m + p - 1) * (fwd + bwd))
        n += 1
    assert n > 250


def test_interleaving_shrinks_the_bubble_and_keeps_the_work():
    one = simulate("1f1b", 4, 8)
    inter = simulate("interleaved", 4, 8, 2)
    assert inter.busy(0) == pytest.approx(one.busy(0))  # same model, chunks take 1/v of a stage
    assert inter.step_time < one.step_time
    assert inter.bubble_fraction() == pytest.approx(one.bubble_fraction() / 2)


def test_slow_stage_sets_the_pace():
    tl = simulate("1f1b", 4, 8, forward=[1, 1, 3, 1], backward=[2, 2, 6, 2])
    assert tl.step_time >= 8 * (3 + 6)
    slow = tl.bubble_fraction(2)
    assert all(tl.bubble_fraction(r) > slow for r in (0, 1, 3))


def test_per_virtual_stage_durations_are_taken_literally():
    fw = [1, 2, 3, 4]  # p=2, v=2: virtual stages (c0 r0, c0 r1, c1 r0, c1 r1)
    tl = simulate("interleaved", 2, 4, 2, forward=fw, backward=[2 * x for x in fw])
    for r in range(2):
        for o in tl.ops[r]:
            vs = o.chunk * 2 + r
            assert o.duration == (fw[vs] if o.kind == F else 2 * fw[vs])


# --------------------------------------------------------------------------- invariants


def _check_invariants(tl, latency=0.0):
    p, v = tl.p, tl.v
    end, start = {}, {}
    for r in range(p):
        ops = tl.ops[r]
        # every (kind, micro-batch, chunk) exactly once
        keys = [(o.kind, o.microbatch, o.chunk) for o in ops]
        assert sorted(keys) == sorted((k, i, c) for k in (F, B) for i in range(tl.m) for c in range(v))
        # one op at a time per rank
        for a, b in zip(ops, ops[1:]):
            assert b.start >= a.end - 1e-12
        for o in ops:
            vs = o.chunk * p + r
            end[(o.kind, o.microbatch, vs)] = o.end
            start[(o.kind, o.microbatch, vs)] = o.start
    nvs = p * v
    for (kind, i, vs), s in start.items():
        if kind == F:
            assert end[(F, i, vs)] <= start[(B, i, vs)] + 1e-12  # every F before its B
            if vs > 0:
                assert s >= end[(F, i, vs - 1)] + latency - 1e-12
        elif vs < nvs - 1:
            assert s >= end[(B, i, vs + 1)] + latency - 1e-12


def test_invariants_random_durations_and_latency():
    rng = random.Random(6)
    for sched, p, m, v in _layouts():
        if rng.random() > 0.35:
            continue
        lat = rng.choice([0.0, 0.1, 0.7])
        fw = [rng.uniform(0.2, 2.0) for _ in range(p)]
        bw = [rng.uniform(0.2, 4.0) for _ in range(p)]
        _check_invariants(simulate(sched, p, m, v, forward=fw, backward=bw, latency=lat), lat)


# --------------------------------------------------------------------------- in-flight micro-batches (planner API)


def test_inflight_closed_forms():
    for p, m in itertools.product(range(1, 7), range(1, 13)):
        for r in range(p):
            assert inflight_microbatches("1f1b", p, m, 1, r) == min(p - r, m)
            assert inflight_microbatches("gpipe", p, m, 1, r) == m
    # interleaved rank 0, many micro-batches: p + (p - 1) / v stage-activations (Korthikanti et al. 2022)
    for p, v in itertools.product(range(2, 6), range(2, 5)):
        assert inflight_microbatches("interleaved", p, 8 * p, v, 0) == pytest.approx(p + (p - 1) / v)


def test_inflight_matches_simulated_peak():
    for sched, p, m, v in _layouts():
        tl = simulate(sched, p, m, v)
        for r in range(p):
            assert tl.peak_inflight(r) == inflight_chunks(sched, p, m, v, r)
            assert tl.metrics()["per_rank"][r]["peak_inflight_microbatches"] == pytest.approx(
                inflight_microbatches(sched, p, m, v, r))


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("args,needle", [
    (("interleaved", 4, 6, 2), "multiple of 4"),
    (("interleaved", 4, 2, 2), "[p=4, m=2]"),
    (("interleaved", 1, 4, 2), "p >= 2"),
    (("1f1b", 2, 4, 2), "v=1"),
    (("1f1b", 0, 4, 1), "positive"),
    (("pipedream-2bw", 2, 4, 1), "unknown schedule"),
])
def test_refused_layouts_name_the_rule(args, needle):
    with pytest.raises(ScheduleError, match=None) as e:
        check_schedule(*args)
    assert needle in str(e.value)


def test_group_size_option_follows_mcore_rules():
    check_schedule("interleaved", 2, 5, 2, microbatch_group_size=3)  # 5 mod 3 = 2 >= p: allowed
    with pytest.raises(ScheduleError):
        check_schedule("interleaved", 3, 7, 2, microbatch_group_size=3)  # 7 mod 3 = 1 < p
    tl = simulate("interleaved", 2, 5, 2, microbatch_group_size=3)
    _check_invariants(tl)


def test_bad_durations_are_refused():
    with pytest.raises(ScheduleError, match="per-stage"):
        simulate("1f1b", 3, 4, forward=[1, 2])
    with pytest.raises(ScheduleError, match="non-negative"):
        simulate("1f1b", 2, 4, backward=-1)
