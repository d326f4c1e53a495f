"""Generation's ranks start through the same supervised launch as training: a killed caller leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from workbench.launch import run_supervised


def _wait_until(cond, timeout, what):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def test_output_and_exit_code_come_back(tmp_path):
    res = run_supervised([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], tmp_path / "w")
    assert res.returncode == 3 and "hello" in res.output
    assert (tmp_path / "w" / "exit_status.json").exists()


def test_timeout_stops_the_tree(tmp_path):
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_supervised([sys.executable, "-c", code], tmp_path / "w", timeout=3, grace=2)
    pid = int(pidfile.read_text())
    _wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20, "the command to be stopped")


def test_killed_caller_leaves_no_orphans(tmp_path):
    pidfile = tmp_path / "pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    caller = textwrap.dedent(f"""
        import sys
        from workbench.launch import run_supervised
        run_supervised([sys.executable, "-c", {child!r}], {str(tmp_path / "w")!r})
    """)
    k = subprocess.Popen([sys.executable, "-c", caller], cwd=os.getcwd())
    _wait_until(lambda: pidfile.exists() and pidfile.read_text(), 60, "the supervised command to start")
    pid = int(pidfile.read_text())
    os.kill(k.pid, signal.SIGKILL)  # no atexit, no cleanup in the caller
    k.wait()
    _wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 30,
                "the orphaned command to be killed by the supervisor")
