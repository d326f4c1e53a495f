"""``Run.attach(dir).stop()`` signals only processes that provably belong to the run directory.

``launch.json`` is a file: whoever can write the run directory can make it name any process of the
user (supervisor, torchrun, ranks, a process group).  A process is signalled only when its create
time is the recorded one AND its command line runs this run directory; a refused one is named,
with why, and left alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from workbench.config import preset
from workbench.launch import Run
from workbench.launch.ownership import verified_supervisor
from workbench.launch.processes import create_time

from tests.support import living


def _bystander(tmp_path, *, own_group: bool) -> subprocess.Popen:
    """An unrelated process of this user: ``sleep`` (optionally leading a process group of its own)."""
    return subprocess.Popen(["sleep", "300"], cwd=tmp_path, start_new_session=own_group)


def _forge(run_dir, meta: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    preset("tiny").save(run_dir / "config.json")
    (run_dir / "events").mkdir(exist_ok=True)
    (run_dir / "launch.json").write_text(json.dumps({"command": ["torchrun"], "nproc_per_node": 1, "nnodes": 1,
                                                     "node_rank": 0, "started": time.time(), **meta}))


def test_forged_supervisor_pid_and_pgid_are_not_signalled(tmp_path, capsys):
    victim = _bystander(tmp_path, own_group=True)
    try:
        _forge(tmp_path / "run", {"supervisor_pid": victim.pid, "supervisor_create_time": create_time(victim.pid),
                                  "pgid": os.getpgid(victim.pid)})
        run = Run.attach(tmp_path / "run")
        assert not run.is_alive() and run.processes() == []
        run.stop(grace=0.5)
        time.sleep(0.2)
        assert victim.poll() is None, f"stop() signalled an unrelated process (exit {victim.returncode})"
        err = capsys.readouterr().err
        seen = (err, run.refusals, verified_supervisor(run.launch_info, tmp_path / "run"), psutil.Process(victim.pid).cmdline())
        assert f"pid {victim.pid} as the supervisor" in err and "sleep 300" in err and "not signalled" in err, seen
        assert any(str(victim.pid) in why for why in run.refusals), seen
    finally:
        victim.kill()
        victim.wait()


def test_forged_process_records_are_not_signalled(tmp_path, capsys):
    """torchrun and rank records (real PIDs, real create times) of processes that do not run this directory."""
    a = _bystander(tmp_path, own_group=False)
    b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "--run-dir", str(tmp_path / "other-run")])
    try:
        _forge(tmp_path / "run", {"torchrun_pid": a.pid, "torchrun_create_time": create_time(a.pid), "pgid": os.getpgid(0),
                                  "processes": [{"pid": a.pid, "create_time": create_time(a.pid), "role": "torchrun"},
                                                {"pid": b.pid, "create_time": create_time(b.pid), "role": "rank"}]})
        run = Run.attach(tmp_path / "run")
        assert not run.is_alive()
        run.stop(grace=0.5)
        time.sleep(0.2)
        assert a.poll() is None and b.poll() is None, "stop() signalled a process that is not this run's"
        err = capsys.readouterr().err
        assert f"pid {a.pid} (torchrun)" in err and f"pid {b.pid} (rank)" in err
        assert not (tmp_path / "run" / "exit_status.json").exists()  # nothing of the run was running: nothing stopped
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_process_that_runs_the_directory_is_still_stopped(tmp_path):
    """The check does not lose the run's own orphans: a recorded process whose command line names the run directory."""
    run_dir = tmp_path / "run"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "--run-dir", str(run_dir)])
    try:
        p = psutil.Process(orphan.pid)
        _forge(run_dir, {"processes": [{"pid": orphan.pid, "create_time": create_time(orphan.pid), "role": "rank"}]})
        run = Run.attach(run_dir)
        assert [q.pid for q in run.processes()] == [orphan.pid]
        assert run.stop(grace=2) == "stopped"
        assert not living([p])  # (stop() has reaped it: psutil waits for the processes it signals)
        assert run.refusals == []
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_a_wall_clock_step_does_not_hide_the_run_s_processes(tmp_path, monkeypatch):
    """The boot time /proc/stat reports moves by a whole second when the wall clock is adjusted (psutil adds it to
    every create time it reads): a recorded process is still recognised, and stopped, after such a step."""
    import psutil._pslinux as pslinux

    run_dir = tmp_path / "run"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "--run-dir", str(run_dir)])
    try:
        _forge(run_dir, {"processes": [{"pid": orphan.pid, "create_time": create_time(orphan.pid), "role": "rank"}]})
        boot = pslinux.boot_time()
        monkeypatch.setattr(pslinux, "boot_time", lambda: boot + 1.0)  # the clock stepped after the record was made
        run = Run.attach(run_dir)
        assert [q.pid for q in run.processes()] == [orphan.pid]
        assert run.stop(grace=2) == "stopped"
        assert orphan.wait(timeout=10) is not None
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_a_record_with_a_wall_clock_create_time_is_still_recognised(tmp_path):
    """A ``launch.json`` an earlier version wrote holds psutil's wall-clock create times: its run is still found
    and stopped (within the second by which psutil's boot time can move), and a PID given to a later process is not."""
    run_dir = tmp_path / "run"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "--run-dir", str(run_dir)])
    try:
        wall = psutil.Process(orphan.pid).create_time()
        _forge(run_dir, {"processes": [{"pid": orphan.pid, "create_time": wall - 5.0, "role": "rank"}]})
        assert Run.attach(run_dir).processes() == []  # five seconds off: not the recorded process
        _forge(run_dir, {"processes": [{"pid": orphan.pid, "create_time": wall, "role": "rank"}]})
        run = Run.attach(run_dir)
        assert [q.pid for q in run.processes()] == [orphan.pid]
        assert run.stop(grace=2) == "stopped"
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()
