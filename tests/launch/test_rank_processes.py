"""Which processes are a run's ranks (workbench.launch.processes.rank_processes), against real processes: a rank's
forked children (its data loader's workers) share its command line and environment but are never the rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from workbench.launch.processes import rank_processes

#: a stand-in rank: its command line names workbench.rank, its environment RANK; it forks one child (as a
#: DataLoader forks its workers) and both sleep
FORKING_RANK = "import os, time\nos.fork()\ntime.sleep(60)\n"


def test_a_ranks_forked_workers_are_not_taken_for_the_rank():
    p = subprocess.Popen([sys.executable, "-c", FORKING_RANK, "-m", "workbench.rank"], env={**os.environ, "RANK": "3"})
    try:
        parent = psutil.Process(p.pid)
        deadline = time.time() + 30
        while not parent.children() and time.time() < deadline:
            time.sleep(0.05)
        (child,) = parent.children()
        assert child.environ()["RANK"] == "3" and "workbench.rank" in " ".join(child.cmdline())  # alike but for ppid
        for order in ([parent, child], [child, parent]):  # psutil lists a parent before its children: both orders
            assert {r: q.pid for r, q in rank_processes(order).items()} == {3: p.pid}
    finally:
        for q in parent.children() + [parent]:
            q.kill()
        p.wait()
