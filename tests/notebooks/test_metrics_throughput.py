"""`metrics.json`'s tokens_per_s is total tokens over total time, not a mean of per-step rates."""

from __future__ import annotations

import json

import pytest

from workbench.notebook import record_metrics
from workbench.launch import Run


def _write_steps(run_dir, steps, ranks=2):
    (run_dir / "events").mkdir(parents=True)
    for rank in range(ranks):
        with open(run_dir / "events" / f"rank-{rank}.jsonl", "w") as fh:
            for it, (t, step_time, tokens) in enumerate(steps, start=1):
                fh.write(json.dumps({"event": "step", "time": t, "rank": rank, "iteration": it, "loss": 3.0,
                                     "step_time": step_time * (1 + 0.01 * rank), "tokens_per_s": tokens / (step_time * (1 + 0.01 * rank)),
                                     "mfu": 0.1 * step_time}) + "\n")


def test_tokens_per_s_is_total_tokens_over_wall_time(tmp_path):
    # an uneven run: fast steps, then one slow one, and a long pause (eval / checkpoint) between two steps
    tokens = 1000
    steps, t = [], 100.0
    for step_time, pause in [(1.0, 0), (0.1, 0), (0.1, 0), (0.1, 0), (2.0, 0), (0.1, 5.0), (0.1, 0), (0.1, 0)]:
        t += step_time + pause
        steps.append((t, step_time, tokens))
    _write_steps(tmp_path, steps)
    m = Run(tmp_path).final_metrics()
    wall = steps[-1][0] - steps[0][0]  # iterations 2..8 happen between the first and the last step event
    assert m["tokens_per_s"] == pytest.approx(7 * tokens / wall)
    mean_of_rates = sum(tokens / (s * 1.01) for _, s, _ in steps[1:]) / 7
    assert mean_of_rates > 3 * m["tokens_per_s"]  # what it reported before
    assert m["step_time"] == pytest.approx(sum(s * 1.01 for _, s, _ in steps[1:]) / 7)
    path = record_metrics(m, tmp_path / "out")
    assert json.loads(path.read_text())["tokens_per_s"] == pytest.approx(m["tokens_per_s"])


def test_one_step_run_uses_its_step_time(tmp_path):
    _write_steps(tmp_path, [(10.0, 0.5, 2000)], ranks=1)
    assert Run(tmp_path).final_metrics()["tokens_per_s"] == pytest.approx(4000)


def test_steps_with_an_mfu_and_no_step_time_give_no_throughput_and_no_error(tmp_path):
    """Records that carry an MFU and tokens/s but no step time (a run logging before its first timed step): no
    tokens/s and no MFU to give, and no division by zero."""
    (tmp_path / "events").mkdir()
    with open(tmp_path / "events" / "rank-0.jsonl", "w") as fh:
        for it in (1, 2, 3):
            fh.write(json.dumps({"event": "step", "time": 10.0, "rank": 0, "iteration": it, "loss": 3.0,
                                 "step_time": 0.0, "tokens_per_s": 100.0, "mfu": 0.2}) + "\n")
    m = Run(tmp_path).final_metrics()
    assert "tokens_per_s" not in m and "mfu" not in m, m
