"""One node's processes of a run on this machine, as the notebook side finds and stops them.

:class:`NodeProcesses` finds the node's supervisor (the handle's own ``Popen``, or the one
``launch.json`` names) and the processes ``launch.json`` records, each only when it provably belongs
to the run directory (:mod:`workbench.launch.ownership`); any other is refused, said once on stderr,
and never signalled.  :meth:`NodeProcesses.stop` stops the node: SIGTERM to the supervisor, which
SIGTERMs torchrun, which SIGTERMs each rank once (the backend finishes its step and saves); SIGKILL
for anything left after the grace period, and the supervisor's process group and every process seen
if even that fails; a killed supervisor's leftovers are stopped from their records.  Torch-free;
psutil is imported lazily.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from workbench.launch.exit_status import write_exit_status
from workbench.launch.ownership import Refusal, live_recorded, verified_supervisor
from workbench.launch.processes import descendants, is_alive, live_process, stop
from workbench.run.reader import RunReader

__all__ = ["NodeProcesses", "stop_orphans"]


class NodeProcesses:
    """Node ``node_rank``'s processes of the run in ``run_dir`` on this machine (``popen``: its supervisor,
    when this process started it)."""

    def __init__(self, run_dir: str | Path, node_rank: int, reader: RunReader, popen: subprocess.Popen | None = None):
        self.run_dir = Path(run_dir)
        self.node_rank = int(node_rank)
        self.reader = reader
        self.popen = popen
        #: processes launch.json names that are not this run's (never signalled), each with why
        self.refusals: list[Refusal] = []

    @property
    def launch_info(self) -> dict:
        return self.reader.launch_info(self.node_rank)

    def refuse(self, why: Refusal | None) -> None:
        """Say once (stderr) that a process ``launch.json`` names is not this run's and is left alone."""
        if why and why not in self.refusals:
            self.refusals.append(why)
            print(f"warning: {why}", file=sys.stderr, flush=True)

    def live_recorded(self, meta: dict) -> list:
        """The live processes ``meta`` (a ``launch.json``) records that provably belong to this run."""
        refused: list[Refusal] = []
        found = live_recorded(meta, self.run_dir, refused)
        for why in refused:
            self.refuse(why)
        return found

    def supervisor(self):
        """The node's live supervisor (psutil), else None."""
        if self.popen is not None:
            if self.popen.poll() is not None:
                return None
            return live_process(self.popen.pid)
        sup, why = verified_supervisor(self.launch_info, self.run_dir)
        self.refuse(why)
        return sup

    def recorded(self) -> list:
        """Live processes that ``launch.json`` records for this run (torchrun, ranks), their create times
        and command lines checked against this run directory."""
        if self.popen is not None and self.popen.poll() is None:
            return []  # our own supervisor is running: its tree is the truth
        return self.live_recorded(self.launch_info)

    def alive(self) -> bool:
        """Whether the node's supervisor, or any process ``launch.json`` records for it, is running."""
        return self.supervisor() is not None or bool(self.recorded())

    def processes(self) -> list:
        """The node's live processes: its supervisor, the supervisor's tree and what ``launch.json`` records."""
        sup = self.supervisor()
        found = [sup, *descendants(sup)] if sup is not None else []
        pids = {p.pid for p in found}
        return found + [p for p in self.recorded() if p.pid not in pids]

    def of_node(self, meta: dict) -> list:
        """Live processes of another node of this run on this machine (``meta``: its ``launch.json``): its
        supervisor's tree and its records, only those that provably belong to this run directory."""
        sup, why = verified_supervisor(meta, self.run_dir)
        self.refuse(why)
        found = [sup, *descendants(sup)] if sup is not None else []
        pids = {p.pid for p in found}
        return found + [p for p in self.live_recorded(meta) if p.pid not in pids]

    def reap(self) -> None:
        """Collect the exit of the supervisor this process started, if it has ended."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, grace: float) -> None:
        """Stop the node (see the module docstring) and record ``stopped`` if nothing recorded how it ended."""
        sup = self.supervisor()
        if sup is None:
            orphans = self.recorded()  # the supervisor is gone (killed) but processes of the run live on
            if orphans:
                stop_orphans(orphans, grace)
            self.reap()
            if orphans and not self.reader.exit_status(self.node_rank):
                write_exit_status(self.run_dir, None, reason="stopped", status="stopped", started=self.launch_info.get("started"),
                                  node_rank=self.node_rank)
            return
        snapshot = [sup, *descendants(sup)]
        try:  # the supervisor leads the process group it created (a new session); any other group is not the run's
            own_group = os.getpgid(sup.pid) == sup.pid
        except OSError:
            own_group = False
        # Only the supervisor is signalled: it SIGTERMs torchrun, which SIGTERMs each rank once
        # (workbench.launch.supervisor.stop_job), and it escalates to SIGKILL after ``grace``.  We wait for
        # that plus a margin, then kill the supervisor's process group and every process seen in the tree.
        stop(snapshot, grace + 8.0, term=[sup], wait_for=[sup], more=lambda: descendants(sup) if is_alive(sup) else [],
             group=sup.pid if own_group else None)
        orphans = self.live_recorded(self.launch_info)  # anything the supervisor recorded and did not take down
        if orphans:
            stop_orphans(orphans, 0.0)
        self.reap()
        if not self.reader.exit_status(self.node_rank):
            write_exit_status(self.run_dir, None, reason="stopped", status="stopped", started=self.launch_info.get("started"),
                              node_rank=self.node_rank)


def stop_orphans(procs: list, grace: float) -> None:
    """Stop processes of a run whose supervisor is gone: SIGTERM torchrun (it forwards one SIGTERM
    to each rank) or, without it, the ranks; SIGKILL whatever is left after ``grace``."""
    torchrun = [p for p in procs if (getattr(p, "info", None) or {}).get("role") == "torchrun"]
    stop(procs, grace, term=torchrun or procs)
