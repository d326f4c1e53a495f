"""A hung rank ends its run: the supervisor sees no progress past the bound, writes the ranks' stacks,
fails the run naming the rank, and leaves no process behind.

The real backend in CPU mode (gloo, 2 ranks, the tiny preset) under the real supervisor and torchrun;
rank 1 is frozen with SIGSTOP (rank 0 then waits in its next collective: gloo would wait 600 s).
The rule that sets the bound (:class:`workbench.launch.stall.StallWatch`) is checked without processes.
"""

from __future__ import annotations

import signal
import time

import pytest

from workbench.config import ConfigError, preset
from workbench.run.events import parse_record
from workbench.launch.processes import rank_processes
from workbench.launch.stall import StallWatch
from workbench.launch import Run

from tests.support import living, run_processes, wait_until


def _ev(kind: str, rank: int, t: float, **f):
    return parse_record({"event": kind, "rank": rank, "time": t, **({"iteration": 1} if kind == "step" else {}), **f})


def test_the_bound_follows_the_run_s_rhythm_and_startup_has_its_own():
    w = StallWatch([0, 1], floor=5, startup=100, now=0.0)
    assert w.check(now=99.0) is None
    s = w.check(now=101.0)
    assert s is not None and s.startup and s.rank == 0 and s.idle_ranks == [0, 1]
    w.feed([_ev("run_start", 0, 90.0), _ev("run_start", 1, 90.0)])
    for i in range(10):  # a step every 2 s on both ranks
        w.feed([_ev("step", 0, 100.0 + 2 * i), _ev("step", 1, 100.0 + 2 * i + 0.1)])
    assert w.bound() == pytest.approx(40.0)  # 20 x the median time between step events, over the floor
    assert w.check(now=118.1 + 39.0) is None
    s = w.check(now=118.1 + 41.0)
    assert s is not None and not s.startup and s.rank == 0  # silent longest
    assert w.check(now=118.1 + 41.0, stopped=lambda: [1]).rank == 1  # a stopped rank is the one named
    w.feed([_ev("eval", 0, 200.0)])  # a long eval once seen (82 s since the last step) raises the bound
    assert w.bound() == pytest.approx(2 * (200.0 - 118.0))
    w.feed([_ev("run_end", 0, 201.0), _ev("run_end", 1, 201.0)])
    assert w.check(now=10_000.0) is None  # ended ranks are not judged
    assert StallWatch([0], floor=0).check(now=1e9) is None  # floor 0: off


def test_a_checkpoint_being_written_is_progress(tmp_path):
    ckpt = tmp_path / "checkpoints"
    w = StallWatch([0], floor=5, startup=5, activity=[ckpt], now=time.time() - 60)
    assert w.check() is not None
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000010" / "__0_0.distcp").write_bytes(b"x")  # written now
    assert w.check() is None


def test_bad_stall_options_are_refused_before_launch(tmp_path, capsys):
    from workbench.cli import main as cli_main

    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1})
    f = str(cfg.save(tmp_path / "cfg.yaml"))
    assert cli_main(["launch", f, "--dry-run", "--stall-floor", "-1", "--startup-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert "stall_floor: -1.0 is not a number of seconds >= 0" in err and "--stall-floor 300" in err
    assert "startup_timeout: 0.0 is not a positive number of seconds" in err
    with pytest.raises(ConfigError):
        Run.launch(cfg, run_root=tmp_path / "runs", stall_floor=float("nan"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_sigstopped_rank_fails_the_run_with_stacks_and_no_orphans(tmp_path):
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 2, "train.train_iters": 100000,
                                    "train.lr_warmup_iters": 1, "train.eval_interval": 0, "checkpoint.save_on_exit": False})
    run = Run.launch(cfg, run_root=tmp_path / "runs", stall_floor=4, startup_timeout=600)
    ranks = {}
    try:
        wait_until(lambda: all(sum(e.rank == r for e in run.events("step")) >= 5 for r in (0, 1)), 300, "both ranks training")
        ranks = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(rank_processes(run.processes())), 30, "two ranks")
        procs = run.processes()
        ranks[1].send_signal(signal.SIGSTOP)
        t0 = time.time()
        assert run.wait(timeout=240) == "failed"
        took = time.time() - t0
        ex = run.exit_status
        assert ex["reason"] == "stalled" and ex["failed_rank"] == 1, ex
        assert ex["returncode"] == -signal.SIGKILL, ex  # torchrun, killed with the ranks
        assert ex["stall"]["stopped"] == [1] and ex["stall"]["bound_s"] >= 4, ex
        assert "rank 1 made no progress" in ex["failed_message"] and "stopped" in ex["failed_message"]
        f = run.failure
        assert f.rank == 1 and "no progress" in f.message, f
        stacks = (run.run_dir / "stall_stacks.txt").read_text()
        assert "rank 1 (pid" in stacks and "is stopped" in stacks
        rank0 = stacks.split("=== rank 0", 1)[1].split("=== rank 1", 1)[0]
        assert "Thread 0x" in rank0 and "File " in rank0, stacks  # faulthandler's dump of rank 0's threads
        assert not living(procs) and not living(run_processes(run.run_dir))
        print(f"stalled run ended {took:.1f}s after the SIGSTOP (bound {ex['stall']['bound_s']:.1f}s)")
        assert took < ex["stall"]["bound_s"] + 60
    finally:
        for p in ranks.values():
            if living([p]):
                p.send_signal(signal.SIGCONT)
        for p in living(run_processes(run.run_dir)):
            p.kill()
