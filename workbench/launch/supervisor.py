"""The supervisor: the process that runs a job's torchrun, watches it, stops it and records how it ended.

``python -m workbench.launch supervise --run-dir DIR ... -- COMMAND`` (:func:`supervisor_command`
builds that line; :mod:`workbench.launch.start` starts it).  The supervisor leads the job's process
group.  It is a Linux child sub-reaper (orphaned ranks re-parent to it), watches the launching
process and kills the whole process tree when that disappears, kills the job when a rank reported
an ``error`` event but the job did not tear down, ends it as ``failed`` when a rank makes no
progress past a bound set by the run's own rhythm (:mod:`workbench.launch.stall`; the ranks'
stacks in ``stall_stacks.txt``), and writes ``<run_dir>/exit_status.json``
(:mod:`workbench.launch.exit_status`: which rank caused a failure), then gives the run's checkpoint folder back
(:mod:`workbench.run.writer`).  It records torchrun and the
ranks (PIDs with create times) in ``launch.json``, and the job cannot outlive it: torchrun and the
ranks die with it even when it is SIGKILLed (:mod:`workbench.launch.ownership`).

One node of a multi-node run keeps its files in its node directory, beats a heartbeat there and
stops its job when another node failed, stopped or went silent (:mod:`workbench.launch.nodes`).

``python -m workbench.launch exit-status --run-dir DIR ...`` records a job's exit status from
outside (the SLURM batch script).  Torch-free; psutil is imported lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from workbench.config import ConfigError, load_config
from workbench.launch import stall
from workbench.launch.exit_status import STATUSES, write_exit_status
from workbench.launch.nodes import DEFAULT_NODE_TIMEOUT, PeerWatch, start_heartbeat
from workbench.launch.ownership import SUPERVISOR_ENV, SUPERVISOR_MODULE, die_with_parent, supervisor_token
from workbench.launch.processes import (
    collect_stacks, create_time, describe, descendants, is_stopped, rank_log, rank_processes, set_child_subreaper,
    signal_all, stop,
)
from workbench.launch.stall import DEFAULT_STARTUP_TIMEOUT
from workbench.run import nodes, writer
from workbench.run.files import read_json, write_json_atomic, write_text_atomic
from workbench.run.reader import RunReader

__all__ = ["supervisor_command", "stop_job", "stall_watch", "end_stalled", "supervise", "main"]


def supervisor_command(run_dir: str | Path, command: Sequence[str], *, watch_pid: int = 0, grace: float = 10.0,
                       error_grace: float = 10.0, node_rank: int = 0, nnodes: int = 1,
                       node_timeout: float = DEFAULT_NODE_TIMEOUT, stall_floor: float | None = None,
                       startup_timeout: float | None = None) -> list[str]:
    """The supervisor's command line for ``command`` (see the module docstring).  ``stall_floor``:
    watch the ranks' progress (:mod:`workbench.launch.stall`; None: no watch, for commands that write no events)."""
    multi = ["--node-rank", str(node_rank), "--nnodes", str(nnodes), "--node-timeout", str(node_timeout)] if nnodes > 1 else []
    if stall_floor:
        multi += ["--stall-floor", str(stall_floor), "--startup-timeout", str(startup_timeout or DEFAULT_STARTUP_TIMEOUT)]
    return [sys.executable, "-m", SUPERVISOR_MODULE, "supervise", "--run-dir", str(run_dir), "--watch-pid", str(watch_pid),
            "--grace", str(grace), "--error-grace", str(error_grace), *multi, "--", *command]


def stop_job(me, child: subprocess.Popen, grace: float) -> None:
    """Graceful stop of the job: ONE SIGTERM per rank, SIGKILL for whatever is left after ``grace``.

    torchrun forwards a SIGTERM to every rank exactly once, so it is the only process signalled
    while it lives (a second SIGTERM makes the backend's ranks leave without finishing the step).
    Ranks orphaned by a dead torchrun get the SIGTERM directly.
    """
    tree = descendants(me)
    term = [p for p in tree if p.pid == child.pid] if child.poll() is None else None
    stop(tree, grace, term=term, more=lambda: descendants(me),
         say=lambda msg: print(f"[supervisor] {msg}", flush=True))


def stall_watch(run_dir: Path, node_rank: int, floor: float, startup: float) -> stall.StallWatch:
    """The watch over this node's ranks (``launch.json``'s ``nproc_per_node``); a save in flight in the
    config's checkpoint directory counts as progress."""
    meta = read_json(nodes.node_dir(run_dir, node_rank) / nodes.LAUNCH_FILE) or {}
    nproc = int(meta.get("nproc_per_node") or 0)
    activity = [run_dir / "checkpoints"]
    try:
        save_dir = load_config(run_dir / "config.json").checkpoint.save_dir
        if save_dir:
            activity.append(Path(save_dir))
    except (ConfigError, OSError):
        pass
    return stall.StallWatch(nodes.node_ranks(node_rank, nproc) if nproc else [], floor=floor, startup=startup, activity=activity)


def end_stalled(me, child: subprocess.Popen, verdict: stall.Stall, ndir: Path, node_rank: int, nproc: int) -> Path:
    """A stalled job: every rank's stacks into ``<node dir>/stall_stacks.txt`` (a stopped rank cannot print:
    the file says so), then SIGKILL for the whole tree (a stopped process dies of it too).  The file's path."""
    import psutil

    tree = descendants(me)
    ranks = rank_processes(tree)
    logs = {r: rank_log(ndir, r - node_rank * nproc) for r in ranks}
    stacks = collect_stacks(ranks, logs, wait=2.0)
    out = ndir / "stall_stacks.txt"
    lines = [f"# {verdict.message}", f"# written by the supervisor at {datetime.now(timezone.utc).isoformat()}", ""]
    for r in sorted(ranks):
        lines += [f"=== rank {r} (pid {ranks[r].pid})", stacks.get(r) or "(nothing printed: no stderr log)", ""]
    write_text_atomic(out, "\n".join(lines))
    tree = descendants(me)  # the ranks first, then torchrun and whatever else is left
    signal_all([p for p in tree if p.pid in {q.pid for q in ranks.values()}], signal.SIGKILL)
    signal_all(tree, signal.SIGKILL)
    psutil.wait_procs([p for p in tree if p.pid != child.pid], timeout=10)  # torchrun: reaped by its Popen (its exit code)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return out


class _ProcessRecord:
    """launch.json's process records (for Run.stop without a supervisor): every process ever seen under torchrun."""

    def __init__(self, launch_json: Path, torchrun_pid: int):
        self.launch_json, self.torchrun_pid = launch_json, torchrun_pid
        self.recorded: dict[tuple[int, float], dict] = {}

    def __call__(self, tree: list, first: bool = False) -> None:
        new = [r for r in describe(tree, self.torchrun_pid) if (r["pid"], r["create_time"]) not in self.recorded]
        if not new and not first:
            return
        self.recorded.update({(r["pid"], r["create_time"]): r for r in new})
        meta = read_json(self.launch_json) or {}
        meta.update(torchrun_pid=self.torchrun_pid, torchrun_create_time=create_time(self.torchrun_pid),
                    processes=list(self.recorded.values()))
        write_json_atomic(self.launch_json, meta)


def _end_job(me: Any, child: subprocess.Popen, rc: int | None, verdict: "stall.Stall | None", grace: float, ndir: Path, node_rank: int,
             launch_json: Path) -> tuple[int | None, dict]:
    """After the watch loop: a stalled job's stacks written and its ranks killed (nothing would answer a graceful
    stop); a job still running (stop requested, kernel gone, stalled, or hung after an error) taken down whole;
    whatever survived torchrun (orphans re-parented to us as sub-reaper) too.  Returns torchrun's exit code and the
    stall's record for the exit status."""
    stall_info: dict = {}
    if verdict is not None:
        stacks = end_stalled(me, child, verdict, ndir, node_rank, int((read_json(launch_json) or {}).get("nproc_per_node") or 0))
        rc = child.poll()
        stall_info = {"stall": {**verdict.to_dict(), "stacks": str(stacks)}, "failed_message": verdict.message}
    if rc is None:
        stop_job(me, child, grace)
        try:
            rc = child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            rc = child.wait()
    for _ in range(3):
        left = descendants(me)
        if not left:
            break
        stop(left, 1.0)
    return rc, stall_info


def _start_node(run_dir: Path, ndir: Path, node_rank: int, nnodes: int, node_timeout: float, error_grace: float,
                beating: threading.Event) -> "PeerWatch | None":
    """On a multi-node run, start this node's heartbeat and return the watch on the other nodes (else None)."""
    if nnodes <= 1:
        return None
    start_heartbeat(ndir, node_rank, beating)
    return PeerWatch(run_dir, node_rank, nnodes, timeout=node_timeout, grace=error_grace)


def _catch_stop_signals(stop_reason: list[str]) -> None:
    """SIGTERM, SIGINT and SIGHUP record the reason ``stopped`` (once) instead of killing the supervisor."""

    def on_signal(signum, _frame):
        if not stop_reason:
            stop_reason.append("stopped")

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)


def _start_torchrun(cmd: list[str]) -> subprocess.Popen:
    """Start torchrun, which dies with us (even of a SIGKILL); its ranks die with it."""
    # torchrun dies with us (even of a SIGKILL), and its ranks die with it (:func:`workbench.launch.ownership.guard_rank`)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{SUPERVISOR_ENV: supervisor_token()})
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,  # inherits our stdout (launcher.log)
                            preexec_fn=die_with_parent(signal.SIGKILL))


def _check_job(me: Any, record: "_ProcessRecord", peers: "PeerWatch | None", watch: stall.StallWatch,
               stop_reason: list[str], node_rank: int,
               error_seen_at: float | None) -> "tuple[dict | None, stall.Stall | None]":
    """The once-a-second check: record processes, stop for a failed peer node, detect a stall: (peer, stall verdict)."""
    record(descendants(me))
    hit = peers.check() if peers is not None and not stop_reason else None
    peer = None
    if hit is not None:
        stop_reason.append(hit[0])
        peer = hit[1]
        print(f"[supervisor] node {node_rank}: {peer['why']}: stopping this node's job", flush=True)
    verdict = watch.check(stopped=lambda: [r for r, p in rank_processes(descendants(me)).items() if is_stopped(p)])
    if verdict is not None and not stop_reason and error_seen_at is None:
        print(f"[supervisor] {verdict.message}: the run is stalled; writing the ranks' stacks and ending it", flush=True)
        stop_reason.append("stalled")
        return peer, verdict
    return peer, None


def _watch_job(child: subprocess.Popen, me: Any, record: "_ProcessRecord", reader: RunReader, watch: stall.StallWatch,
               peers: "PeerWatch | None", stop_reason: list[str], watch_pid: int, node_rank: int, error_grace: float,
               poll: float) -> "tuple[int | None, stall.Stall | None, dict | None]":
    """Poll the job until it exits or must be stopped: (torchrun's exit code or None, stall verdict, failed peer)."""
    import psutil

    error_seen_at: float | None = None
    verdict: stall.Stall | None = None
    peer: dict | None = None
    rc: int | None = None
    polls = 0
    while True:
        rc = child.poll()
        if rc is not None:
            break
        if polls % 5 == 0:  # about once a second
            hit, verdict = _check_job(me, record, peers, watch, stop_reason, node_rank, error_seen_at)
            if hit is not None:
                peer = hit
            if verdict is not None:
                break
        polls += 1
        if not stop_reason and watch_pid and (os.getppid() != watch_pid or not psutil.pid_exists(watch_pid)):
            stop_reason.append("kernel-exited")
            print(f"[supervisor] launching process {watch_pid} is gone: stopping the run", flush=True)
        if stop_reason:
            break
        new_events = reader.poll()
        watch.feed(new_events)
        if error_seen_at is None and any(e.event == "error" for e in new_events):
            error_seen_at = time.time()
        if error_seen_at is not None and time.time() - error_seen_at > error_grace:
            print(f"[supervisor] a rank reported an error {error_grace:.0f}s ago and the job did not tear down: killing it", flush=True)
            stop_reason.append("failed")
            break
        time.sleep(poll)
    return rc, verdict, peer


def supervise(run_dir: Path, cmd: list[str], watch_pid: int, grace: float, error_grace: float, poll: float = 0.2, *,
               node_rank: int = 0, nnodes: int = 1, node_timeout: float = DEFAULT_NODE_TIMEOUT,
               stall_floor: float = 0.0, startup_timeout: float = DEFAULT_STARTUP_TIMEOUT) -> int:
    """Body of the supervisor process (see the module docstring). Returns torchrun's exit code.

    One node of a multi-node run (``nnodes > 1``) keeps its files in its node directory, beats a
    heartbeat there and stops its job when another node failed, stopped or went silent
    (:class:`workbench.launch.nodes.PeerWatch`).  ``stall_floor`` > 0: a rank without progress for
    longer than :class:`workbench.launch.stall.StallWatch`'s bound ends the job as ``failed`` (reason
    ``stalled``), its ranks' stacks in ``stall_stacks.txt``.
    """
    import psutil

    set_child_subreaper()
    started = time.time()
    stop_reason: list[str] = []
    ndir = nodes.node_dir(run_dir, node_rank)
    beating = threading.Event()
    peers = _start_node(run_dir, ndir, node_rank, nnodes, node_timeout, error_grace, beating)
    _catch_stop_signals(stop_reason)
    child = _start_torchrun(cmd)
    launch_json = ndir / "launch.json"
    record = _ProcessRecord(launch_json, child.pid)
    reader = RunReader(run_dir)
    me = psutil.Process()
    record([], first=True)
    watch = stall_watch(run_dir, node_rank, stall_floor, startup_timeout)
    rc, verdict, peer = _watch_job(child, me, record, reader, watch, peers, stop_reason, watch_pid, node_rank,
                                   error_grace, poll)

    rc, stall_info = _end_job(me, child, rc, verdict, grace, ndir, node_rank, launch_json)
    reason = stop_reason[0] if stop_reason else None
    status = "failed" if reason in ("failed", "stalled") else None
    info = write_exit_status(run_dir, rc, reason=reason, status=status, started=started, reader=reader,
                             node_rank=node_rank, peer=peer, failed_rank=verdict.rank if verdict else None, extra=stall_info)
    beating.set()
    if node_rank == 0:
        _give_back(run_dir)
    where = f"node {node_rank}: " if nnodes > 1 else ""
    print(f"[supervisor] {where}run ended: {info['status']} (torchrun exit code {rc})", flush=True)
    return rc if isinstance(rc, int) else 1


def _give_back(run_dir: Path) -> None:
    """The run's checkpoint folder is free for the next run (:mod:`workbench.run.writer`)."""
    try:
        writer.release(load_config(run_dir / "config.json"), run_dir)
    except (ConfigError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    """``python -m workbench.launch supervise|exit-status ...`` (internal entry points)."""
    ap = argparse.ArgumentParser(prog=f"python -m {SUPERVISOR_MODULE}")
    sp = ap.add_subparsers(dest="cmd", required=True)
    s = sp.add_parser("supervise")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--watch-pid", type=int, default=0)
    s.add_argument("--grace", type=float, default=10.0)
    s.add_argument("--error-grace", type=float, default=10.0)
    s.add_argument("--node-rank", type=int, default=0)
    s.add_argument("--nnodes", type=int, default=1)
    s.add_argument("--node-timeout", type=float, default=DEFAULT_NODE_TIMEOUT)
    s.add_argument("--stall-floor", type=float, default=0.0, help="0: no stall watch")
    s.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT)
    s.add_argument("command", nargs=argparse.REMAINDER)
    e = sp.add_parser("exit-status")
    e.add_argument("--run-dir", required=True)
    e.add_argument("--returncode", type=int, default=None, help="the job's exit code (none: not known yet)")
    e.add_argument("--status", choices=STATUSES, default=None, help="the status to record (default: from the return code and events)")
    e.add_argument("--reason", default=None)
    e.add_argument("--started", type=float, default=None, help="when the run started (seconds since the epoch)")
    a = ap.parse_args(argv)
    if a.cmd == "supervise":
        cmd = list(a.command)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        return supervise(Path(a.run_dir), cmd, a.watch_pid, a.grace, a.error_grace, node_rank=a.node_rank, nnodes=a.nnodes,
                          node_timeout=a.node_timeout, stall_floor=a.stall_floor, startup_timeout=a.startup_timeout)
    info = write_exit_status(a.run_dir, a.returncode, status=a.status, reason=a.reason, started=a.started)
    print(json.dumps(info))
    return 0
