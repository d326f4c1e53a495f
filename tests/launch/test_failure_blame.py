"""The rank that caused a failure is the one blamed: a rank that died (a signal, an exit code of its own)
before the first that raised; the survivors' "connection reset by peer" is a symptom.

The real backend in CPU mode (gloo, 2 ranks, the tiny preset) under the real supervisor and torchrun;
the rule itself over torchrun's failure reports (the format torch 2.x prints) without processes.
"""

from __future__ import annotations

import signal

import pytest

from workbench.config import preset
from workbench.run.events import Event, parse_record
from workbench.launch.exit_status import root_cause, torchrun_failures
from workbench.launch.processes import rank_processes
from workbench.launch import Run

from tests.support import living, run_processes, wait_until


def _report(root: tuple[int, int, str], *others: tuple[int, int, str]) -> str:
    """torchrun's ChildFailedError summary: (rank, exitcode, time) of the root cause and of the other failures."""
    def block(i, rank, code, when):
        tb = (f"Signal {-code} ({signal.Signals(-code).name}) received by PID {4000 + rank}" if code < 0
              else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        return (f"[{i}]:\n  time      : {when}\n  host      : localhost\n  rank      : {rank} (local_rank: {rank})\n"
                f"  exitcode  : {code} (pid: {4000 + rank})\n  error_file: <N/A>\n  traceback : {tb}\n")
    failures = "".join(block(i + 1, *o) for i, o in enumerate(others)) or "  <NO_OTHER_FAILURES>\n"
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 + "\nworkbench.rank FAILED\n"
            + "-" * 60 + "\nFailures:\n" + failures + "-" * 60 + "\nRoot Cause (first observed failure):\n"
            + block(0, *root) + "=" * 60 + "\n")


def _error(rank: int, message: str, t: float) -> Event:
    return parse_record({"event": "error", "rank": rank, "time": t, "message": message, "exception": "RuntimeError"})


RESET = "[pair.cc:545] Read error [127.0.0.1]:65258: Connection reset by peer. This is typically caused by a remote worker hanging"


def test_a_rank_killed_by_a_signal_is_blamed_before_the_peer_that_raised():
    # rank 1 SIGKILLed; rank 0 raised "connection reset by peer" and exited 1 (torchrun saw both in one poll)
    for root, other in (((1, -9, "t0"), (0, 1, "t0")), ((0, 1, "t0"), (1, -9, "t0"))):
        first, failures = torchrun_failures("noise\n" + _report(root, other))
        rank, rec = root_cause([_error(0, RESET, 1.0)], failures, first)
        assert rank == 1 and rec["signal"] == "SIGKILL" and "SIGKILL" in rec["message"]


def test_the_teardown_s_signals_are_not_a_cause():
    # rank 1 raised its own error; torchrun's teardown SIGTERM ended rank 0 (-15), a later SIGKILL another rank
    first, failures = torchrun_failures(_report((1, 1, "t0"), (0, -15, "t0"), (2, -9, "t9")))
    assert root_cause([_error(1, "ValueError: bad shard index 7", 5.0)], failures, first)[0] == 1
    # a rank that exited on the stop signal (the backend's 143) did not die of its own
    first, failures = torchrun_failures(_report((0, 143, "t0"), (1, 1, "t0")))
    assert root_cause([_error(1, "boom", 5.0)], failures, first)[0] == 1


def test_an_exit_code_without_an_error_event_is_a_death_and_own_errors_beat_symptoms():
    first, failures = torchrun_failures(_report((0, 1, "t0"), (1, 7, "t0")))
    assert root_cause([_error(0, RESET, 1.0)], failures, first)[0] == 1  # rank 1 exited 7 without saying why
    # no torchrun report (the job was killed whole): the first rank whose error is its own
    assert root_cause([_error(0, RESET, 1.0), _error(1, "CUDA error: an illegal memory access", 2.0)], [], {})[0] == 1
    assert root_cause([_error(1, RESET, 2.0), _error(0, RESET, 1.0)], [], {})[0] == 0


@pytest.mark.slow
def test_sigkill_of_rank_1_blames_rank_1_with_the_signal(tmp_path):
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 2, "train.train_iters": 100000,
                                    "train.lr_warmup_iters": 1, "train.eval_interval": 0, "checkpoint.save_on_exit": False})
    run = Run.launch(cfg, run_root=tmp_path / "runs")
    try:
        wait_until(lambda: len({e.rank for e in run.events("step")}) == 2 and len(run.events("step")) >= 6, 300,
                   "both ranks training")
        ranks = wait_until(lambda: (lambda r: r if len(r) == 2 else None)(rank_processes(run.processes())), 30, "two ranks")
        ranks[1].send_signal(signal.SIGKILL)
        assert run.wait(timeout=120) == "failed"
        ex = run.exit_status
        assert ex["failed_rank"] == 1, ex
        assert ex["failed_signal"] == "SIGKILL" and "SIGKILL" in ex["failed_message"], ex
        f = run.failure
        assert f.rank == 1 and "SIGKILL" in f.message, f
        assert not living(run_processes(run.run_dir))
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()
