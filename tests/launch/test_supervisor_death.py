"""A run's supervisor killed with SIGKILL (no handler runs): the job must not train on.

Real supervisor, real torchrun, real rank processes (the fake rank script of ``tests.support``,
which imports the workbench the way the backend does, and a foreign entry that does not).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from workbench.config import preset
from workbench.launch import Run
from workbench.launch.processes import create_time

from tests.support import living, run_processes, wait_until

pytestmark = pytest.mark.slow


def _cfg(nproc: int = 2):
    return preset("tiny").replace(**{"parallel.nproc_per_node": nproc, "train.train_iters": 4, "train.lr_warmup_iters": 1})


def _step_lines(run_dir: Path) -> int:
    return sum(f.read_text().count('"event": "step"') for f in (run_dir / "events").glob("rank-*.jsonl"))


def _recorded_ranks(run_dir: Path) -> set[int]:
    """PIDs launch.json records as torchrun's children (every one ever seen, short-lived helpers included)."""
    meta = json.loads((run_dir / "launch.json").read_text())
    return {r["pid"] for r in meta["processes"] if r["role"] == "rank"}


def _live_ranks(run_dir: Path) -> set[int]:
    """PIDs of the living rank processes (the run's processes whose parent is torchrun)."""
    torchrun = json.loads((run_dir / "launch.json").read_text())["torchrun_pid"]
    out = set()
    for p in living(run_processes(run_dir)):
        try:
            if p.ppid() == torchrun:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_sigkill_of_the_supervisor_takes_torchrun_and_the_ranks_down(rank_script, tmp_path):
    run = Run.launch(_cfg(), run_root=tmp_path / "runs", entry=[str(rank_script)], env={"FAKE_MODE": "slow"})
    try:
        wait_until(lambda: len(run.events("run_start")) == 2 and _step_lines(run.run_dir) >= 4, 60, "both ranks training")
        procs = living(run_processes(run.run_dir))
        assert len(procs) >= 4, procs  # supervisor, torchrun, two ranks
        wait_until(lambda: _live_ranks(run.run_dir) <= _recorded_ranks(run.run_dir) and len(_live_ranks(run.run_dir)) == 2,
                   20, "launch.json to record torchrun's two ranks")
        os.kill(run._popen.pid, signal.SIGKILL)
        t0 = time.time()
        wait_until(lambda: not living(procs), 10, "every process of the run to die with its supervisor")
        took = time.time() - t0
        run._popen.wait(timeout=5)
        steps = _step_lines(run.run_dir)
        time.sleep(1.0)
        assert _step_lines(run.run_dir) == steps, "the ranks kept training"
        assert not living(run_processes(run.run_dir))
        print(f"job gone {took:.2f}s after the supervisor's SIGKILL")
        other = Run.attach(run.run_dir)
        assert not other.is_alive() and other.processes() == []
        assert other.status == "failed"  # nobody wrote an exit status: the supervisor was killed
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()


FOREIGN_RANK = textwrap.dedent(
    '''
    # a rank entry that never imports the workbench (so no parent-death guard) and ignores SIGTERM
    import os, signal, sys, time
    from pathlib import Path
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir = Path(sys.argv[sys.argv.index("--run-dir") + 1])
    (run_dir / f"foreign-{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.2)
    '''
)


def test_stop_of_an_attached_run_without_supervisor_ends_the_recorded_processes(tmp_path):
    script = tmp_path / "foreign_rank.py"
    script.write_text(FOREIGN_RANK)
    run = Run.launch(_cfg(), run_root=tmp_path / "runs", entry=[str(script)])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        pids = wait_until(lambda: [int(f.read_text()) for f in sorted(run.run_dir.glob("foreign-*.pid"))
                                   if f.read_text()] if len(list(run.run_dir.glob("foreign-*.pid"))) == 2 else None,
                          60, "both foreign ranks")
        wait_until(lambda: {p for r in json.loads((run.run_dir / "launch.json").read_text()).get("processes", [])
                            if r["role"] == "rank" for p in [r["pid"]]} == set(pids), 10, "launch.json to record both ranks")
        ranks = [psutil.Process(p) for p in pids]
        torchrun = psutil.Process(json.loads((run.run_dir / "launch.json").read_text())["torchrun_pid"])
        os.kill(run._popen.pid, signal.SIGKILL)
        run._popen.wait(timeout=5)
        wait_until(lambda: not living([torchrun]), 10, "torchrun to die with its supervisor")
        assert len(living(ranks)) == 2  # no guard in them: they live on, orphaned

        # a recycled PID: the record's create time is not the live process's, so it is never signalled
        meta = json.loads((run.run_dir / "launch.json").read_text())
        meta["processes"].append({"pid": bystander.pid, "create_time": create_time(bystander.pid) - 5.0,
                                  "role": "rank"})
        (run.run_dir / "launch.json").write_text(json.dumps(meta))

        other = Run.attach(run.run_dir)  # another kernel: no supervisor to ask, only the records
        assert other.is_alive() and other.status == "starting"  # alive, and no events written
        assert {p.pid for p in other.processes()} == set(pids)
        t0 = time.time()
        assert other.stop(grace=1.5) == "stopped"
        assert time.time() - t0 < 15
        assert not living(ranks)
        assert not living(run_processes(run.run_dir))
        assert other.exit_status["status"] == "stopped"
        assert bystander.poll() is None, "a process whose PID was recorded with another create time was killed"
    finally:
        bystander.kill()
        bystander.wait()
        for p in living(run_processes(run.run_dir)):
            p.kill()
