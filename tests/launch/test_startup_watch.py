"""A rank stuck before its first step is caught by a start-up watch scaled to the model's size
(:func:`workbench.launch.stall.startup_limit`), not a fixed 30 minutes.

A tiny CPU config and the launch's fake rank (``tests.support.RANK_SCRIPT``, mode ``partial``: it waits
for a file that never comes before writing any event) under the real supervisor and torchrun.
"""

from __future__ import annotations

import json
import time

import pytest

from workbench.config import preset
from workbench.launch import Run
from workbench.launch.stall import startup_limit

from tests.support import living, run_processes


def _tiny():
    return preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1})


def test_the_limit_grows_with_the_model_and_what_its_first_step_does():
    tiny = startup_limit(_tiny())
    assert 60 <= tiny <= 120  # a tiny CPU model: about a minute, not 30
    small, big = startup_limit(preset("llama3.2-1b")), startup_limit(preset("llama3.1-8b"))
    assert tiny < small < big
    cfg = preset("llama3.2-1b")
    assert startup_limit(cfg.replace(**{"train.compile_kernels": False})) < small  # no compilation to wait for
    assert startup_limit(cfg.replace(**{"checkpoint.load_dir": "/ckpt"})) > small  # a checkpoint to read
    assert startup_limit(cfg.replace(**{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})) < small  # half per rank


@pytest.mark.slow
def test_a_rank_that_never_reaches_step_one_fails_the_run_at_the_limit_its_launch_hands_over(tmp_path, rank_script):
    """The launch hands its supervisor the limit derived from the config (not the 1800 s default), and the supervisor
    fails a run at the limit it was handed.  The derived limit of any config is a minute or more
    (``STARTUP_BASE_S``), so the run that waits it out is given a shorter one the same way (``startup_timeout=``
    only replaces the number the launch passes on): the same supervisor, watch and message, 10 s instead of 61 s."""
    cfg = _tiny()
    derived = startup_limit(cfg)
    run = Run.launch(cfg, run_root=tmp_path / "derived", entry=[str(rank_script)], env={"FAKE_MODE": "partial"},
                     stall_floor=1)
    try:
        sup = json.loads((run.run_dir / "launch.json").read_text())["supervisor_command"]
        assert float(sup[sup.index("--startup-timeout") + 1]) == derived, sup  # before: the 1800 s default
        assert run.status == "starting"
        assert run.stop(grace=5) == "stopped"
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()

    limit = 10.0
    run = Run.launch(cfg, run_root=tmp_path / "runs", entry=[str(rank_script)], env={"FAKE_MODE": "partial"},
                     stall_floor=1, startup_timeout=limit)
    try:
        t0 = time.time()
        assert run.wait(timeout=limit + 90) == "failed"
        took = time.time() - t0
        ex = run.exit_status
        assert ex["reason"] == "stalled" and ex["stall"]["before_first_step"], ex
        assert ex["stall"]["bound_s"] == pytest.approx(limit), ex
        msg = ex["failed_message"]
        assert "before its first step" in msg and f"start-up limit {limit:.0f} s" in msg, msg
        assert "--startup-timeout" in msg and "startup_timeout=" in msg, msg  # how to raise it
        assert took >= limit - 5
        assert not living(run_processes(run.run_dir))
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()
