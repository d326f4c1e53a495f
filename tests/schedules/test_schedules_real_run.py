"""The simulator's order is the order megatron-core really executes: a real PP=2 x VPP=2 run on CPU.

torchrun starts two ranks of the workbench backend (gloo, CPU mode) with micro-batch
timing on every step; each rank's recorded op sequence must equal :func:`operation_order`,
and the overlay report must be computable from the real events.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from workbench.config import preset
from workbench.run.reader import read_events
from workbench.schedules import load_measured, measured_report, operation_order
from tests.support import torchrun_args


@pytest.mark.slow
def test_real_interleaved_run_follows_the_simulated_order(tmp_path):
    base = preset("tiny")
    cfg = base.replace(**{
        "parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2, "parallel.nproc_per_node": 2,
        "train.global_batch_size": 4 * base.train.micro_batch_size,  # dp = 1 -> 4 micro-batches
        "train.train_iters": 3, "train.microbatch_timing_interval": 1, "train.eval_interval": 0,
        "checkpoint.save_on_exit": False,
    })
    assert cfg.validate() == [] and cfg.derived().num_microbatches == 4
    cfg_path = cfg.save(tmp_path / "run.json")
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, *torchrun_args(2),
                        "-m", "workbench.rank", "--config", str(cfg_path), "--run-dir", str(run_dir)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    events = [e for e in read_events(run_dir) if e["event"] == "microbatch"]
    assert {e["rank"] for e in events} == {0, 1}
    for e in events:
        got = [(o["kind"], o["microbatch"], o["chunk"]) for o in e["ops"]]
        assert got == operation_order("interleaved", 2, 4, 2, rank=e["rank"]), (e["iteration"], e["rank"])
    ms = load_measured(run_dir)
    assert (ms.timeline.p, ms.timeline.v, ms.timeline.m) == (2, 2, 4) and ms.repaired_ops == ms.dropped_ops == 0
    _, report = measured_report(ms)
    assert report["measured_step_ms"] > 0 and report["closed_form_bubble_fraction"] == pytest.approx(1 / 8)
    for rank in report["ranks"]:
        assert sum(rank["time_ms"].values()) == pytest.approx(report["measured_step_ms"], rel=1e-6)
