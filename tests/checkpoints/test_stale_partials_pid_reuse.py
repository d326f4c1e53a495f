"""A killed save's ``iter_N.tmp-<host>-<pid>`` is tidied on the next save even when its PID now belongs to another,
later process (PIDs are given anew: a restarted container, a busy machine); one whose live process may still be
saving it is left and said, never passed over in silence.  Real processes, real folders."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from workbench.checkpoint import remove_stale_partials
from workbench.checkpoint.tree import _this_host


@pytest.fixture()
def sleeper():
    procs = []

    def start() -> int:
        p = subprocess.Popen(["sleep", "120"])
        procs.append(p)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _leftover(root, iteration: int, pid: int, age_s: float = 0.0):
    d = root / f"iter_{iteration:07d}.tmp-{_this_host()}-{pid}"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x" * 16)
    if age_s:
        t = time.time() - age_s
        os.utime(d, (t, t))
    return d


def test_a_leftover_whose_pid_is_now_a_later_process_is_removed(tmp_path, sleeper):
    pid = sleeper()  # alive, started now: an hour after the leftover was written
    d = _leftover(tmp_path, 4, pid, age_s=3600)
    done = remove_stale_partials(tmp_path)
    assert not d.exists(), done
    assert any(line.startswith(f"removed {d.name}") and "a process started later" in line for line in done), done


def test_a_leftover_whose_live_process_may_still_be_saving_is_left_and_said(tmp_path, sleeper):
    pid = sleeper()
    time.sleep(1.5)  # the folder is written after its process started, as a save writes it
    d = _leftover(tmp_path, 6, pid)
    done = remove_stale_partials(tmp_path)
    assert d.exists()
    assert any(line.startswith(f"left {d.name}") and f"process {pid} is alive" in line for line in done), done
