"""bench/harness.run_group: a timed-out launch ends every process it started, also those in sessions of their own
(torchrun's workers are), so the next benchmark variant finds the GPU free."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import harness

# a launcher (like torchrun) whose worker runs in a session of its own and outlives a SIGKILL of the launcher
_LAUNCHER = ("import subprocess, sys, time; "
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # wb-orphan-probe'], "
             "start_new_session=True); print(w.pid, flush=True); time.sleep(120)")


def _probe_pids() -> list[int]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"wb-orphan-probe" in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                out.append(int(cmdline.parent.name))
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timeout_ends_the_launcher_and_its_worker_in_another_session():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_group([sys.executable, "-c", _LAUNCHER], 3.0)
    assert time.monotonic() - start < 30  # not waiting on the worker's hold of the pipes
    assert not [p for p in _probe_pids() if _alive(p)]


def test_an_interrupted_caller_ends_them_too():
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            harness.run_group([sys.executable, "-c", _LAUNCHER], 60.0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not [p for p in _probe_pids() if _alive(p)]


def test_a_run_inside_its_time_returns_its_output_and_code():
    done = harness.run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30.0)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, "out", "err")


def test_a_timed_out_runs_output_is_kept_once():
    with pytest.raises(subprocess.TimeoutExpired) as info:
        harness.run_group([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2.0)
    assert info.value.output == "started\n"


def test_a_repeat_past_its_time_is_a_row_entry_with_its_log_not_the_end_of_the_row(monkeypatch, tmp_path):
    """A reference process that never settles (T5 at 471e8c8) ran past its limit and its exception ended the whole
    row, losing the other repeats and the process's own output: now the repeat is an entry with ``error``."""
    import argparse

    slow = "import sys, time; print('warm-up step 1', flush=True); print('compiling', file=sys.stderr, flush=True); time.sleep(60)"
    monkeypatch.setattr(harness, "torchrun", lambda nproc, args, timeout: harness.run_group([sys.executable, "-c", slow], timeout))
    a = argparse.Namespace(cpu_smoke=False, steps=20, warmup=5, warmup_max=40, timeout=2.0, out=str(tmp_path / "rows.jsonl"),
                           reference_compile="default")
    res = harness.measure("bench/t5_bench.py", "reference", "t5-base", a)
    assert res.get("tokens_per_s") is None
    assert "timed out after 2 s" in res["error"] and "warm-up step 1" in res["error"] and "compiling" in res["error"]
    assert harness.compare({"workbench": [{"tokens_per_s": 1.0}], "reference": [res]}, "workbench", "reference") is None
    partial = (tmp_path / "rows.partial.jsonl").read_text().splitlines()
    assert len(partial) == 1 and "timed out" in partial[0]
