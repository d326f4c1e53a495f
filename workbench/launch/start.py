"""Starting a run: the run directory's launch files, then torchrun under a supervisor.

    caller --Popen(start_new_session)--> supervisor (``python -m workbench.launch supervise``)
                                            +--> torchrun --> rank processes (own sessions)

The notebook kernel never forks itself into a training job nor touches CUDA, and a crashed or
restarted kernel leaves no GPU process behind: the supervisor (:mod:`workbench.launch.supervisor`)
watches the process that started it.

- :func:`start_run` checks (:func:`workbench.launch.checks.launch_checks`), prepares the run
  directory (``config.json``, ``command.sh``, ``launch.json``) and starts the supervisor;
- :func:`run_supervised` runs any other command (generation's and conversion's ranks) under the
  same supervisor and waits for it.

Torch-free.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from workbench.config import ConfigError, RunConfig
from workbench.launch.checks import launch_checks
from workbench.launch.nodes import DEFAULT_NODE_TIMEOUT
from workbench.launch.plan import BACKEND_ENTRY, LaunchPlan, new_run_dir
from workbench.launch.processes import create_time, live_process, stop
from workbench.launch.slurm import batch_script
from workbench.launch.stall import DEFAULT_STALL_FLOOR, startup_limit
from workbench.launch.supervisor import supervisor_command
from workbench.run import nodes, writer
from workbench.run.nodes import host_name
from workbench.run.files import read_json, write_json_atomic, write_text_atomic

__all__ = ["start_run", "run_supervised", "SupervisedResult", "spawn_supervisor", "stop_supervisor"]


def spawn_supervisor(sup_cmd: list[str], env: dict[str, str] | None, stdout) -> subprocess.Popen:
    run_env = dict(os.environ)
    run_env.update(env or {})
    run_env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(sup_cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                            env=run_env, start_new_session=True, close_fds=True)


def start_run(cfg: RunConfig, run_dir: str | Path | None = None, *, node_rank: int = 0, rdzv_endpoint: str | None = None,
              rdzv_id: str | None = None, run_root: str | Path | None = None, entry: Sequence[str] = BACKEND_ENTRY,
              env: dict[str, str] | None = None, grace: float = 10.0, error_grace: float = 10.0,
              watch_parent: bool = True, check_devices: bool = True, node_timeout: float | None = None,
              stall_floor: float | None = None, startup_timeout: float | None = None,
              ignore_memory_plan: bool = False) -> tuple[LaunchPlan, subprocess.Popen]:
    """Check (:func:`launch_checks`), create the run directory, start torchrun under a supervisor.

    Raises :class:`ConfigError` (nothing started, nothing written) when the config or this
    machine cannot run it.  Returns the plan and the supervisor's Popen.  One node of a
    multi-node run writes into the run directory every node shares, its own files in its node
    directory (:mod:`workbench.run.nodes`); nodes given separate run directories (no shared
    filesystem) each follow their own ranks only.  ``node_timeout``: seconds another node may
    go without a heartbeat before this node stops its job.  ``stall_floor`` / ``startup_timeout``:
    when a rank that makes no progress counts as stalled and ends the run (:mod:`workbench.launch.stall`;
    defaults 300 s / :func:`workbench.launch.stall.startup_limit` of the config; ``stall_floor=0`` turns the watch off).  ``ignore_memory_plan``: launch a CUDA run
    whose memory plan is over the GPUs' memory (:mod:`workbench.launch.preflight`).
    """
    problems = launch_checks(cfg, run_dir=run_dir, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, local=check_devices,
                             node_timeout=node_timeout, stall_floor=stall_floor, startup_timeout=startup_timeout,
                             run_root=run_root, ignore_memory_plan=ignore_memory_plan)
    if problems:
        raise ConfigError(problems)
    node_timeout = float(node_timeout or DEFAULT_NODE_TIMEOUT)
    stall_floor = DEFAULT_STALL_FLOOR if stall_floor is None else float(stall_floor)
    startup_timeout = startup_limit(cfg) if startup_timeout is None else float(startup_timeout)
    run_dir = Path(run_dir).absolute() if run_dir else new_run_dir(cfg.name, run_root)
    notes = writer.claim(cfg, run_dir)  # one writer per checkpoint folder: a live owner is refused (ConfigError)
    notes += hook_notes(cfg)
    for note in notes:
        print(f"[workbench] note: {note}", file=sys.stderr, flush=True)
    try:
        plan, popen = _start(cfg, run_dir, node_rank, rdzv_endpoint, rdzv_id, entry, env, grace, error_grace, watch_parent,
                             node_timeout, stall_floor, startup_timeout, notes)
    except BaseException:
        writer.release(cfg, run_dir)
        raise
    return plan, popen


def _start(cfg: RunConfig, run_dir: Path, node_rank: int, rdzv_endpoint: str | None, rdzv_id: str | None,
           entry: Sequence[str], env: dict[str, str] | None, grace: float, error_grace: float, watch_parent: bool,
           node_timeout: float, stall_floor: float, startup_timeout: float,
           notes: list[str]) -> tuple[LaunchPlan, subprocess.Popen]:
    """:func:`start_run` once checked and its checkpoint folder claimed: the run directory's files, the supervisor."""
    plan = LaunchPlan(run_dir, cfg.parallel.nproc_per_node, cfg.parallel.nnodes, node_rank, rdzv_endpoint,
                      rdzv_id or f"workbench-{cfg.name}", entry=tuple(entry))
    ndir = plan.node_dir
    if cfg.parallel.nnodes > 1:  # the nodes share the file (the same config, checked): first, and never half-written
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(plan.config_path, cfg.to_json())
    (ndir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "events").mkdir(exist_ok=True)
    if cfg.parallel.nnodes > 1:
        write_text_atomic(run_dir / "slurm.sbatch", batch_script(plan, gpus=cfg.parallel.device == "cuda"))
    else:
        cfg.save(plan.config_path)
    torchrun_cmd = plan.command()
    watch_pid = os.getpid() if watch_parent else 0
    sup_cmd = supervisor_command(run_dir, torchrun_cmd, watch_pid=watch_pid, grace=grace, error_grace=error_grace,
                                 node_rank=node_rank, nnodes=cfg.parallel.nnodes, node_timeout=node_timeout,
                                 stall_floor=stall_floor, startup_timeout=startup_timeout)
    (ndir / "command.sh").write_text("#!/bin/bash\n# the torchrun command of this run (this node)\n" + plan.shell() + "\n")
    started = time.time()
    info = {
        "command": torchrun_cmd, "shell": plan.shell(), "supervisor_command": sup_cmd,
        "nproc_per_node": plan.nproc_per_node, "nnodes": plan.nnodes, "node_rank": plan.node_rank,
        "rdzv_endpoint": plan.rdzv_endpoint, "kernel_pid": watch_pid or None, "started": started,
        "host": host_name(), "notes": notes,
    }
    if cfg.parallel.nnodes > 1:
        info.update(node_timeout=node_timeout, ranks=nodes.node_ranks(node_rank, plan.nproc_per_node))
    write_json_atomic(ndir / "launch.json", info)
    with open(ndir / "logs" / "launcher.log", "ab") as log:
        log.write("".join(f"[workbench] note: {n}\n" for n in notes).encode())
        log.flush()
        popen = spawn_supervisor(sup_cmd, env, log)
    meta = read_json(ndir / "launch.json") or {}
    meta.update(supervisor_pid=popen.pid, pgid=popen.pid, supervisor_create_time=create_time(popen.pid))
    write_json_atomic(ndir / "launch.json", meta)
    return plan, popen


def hook_notes(cfg: RunConfig) -> list[str]:
    """A resume's line when the hooks its checkpoint recorded differ from the config's (which are the ones the
    ranks import: :func:`workbench.checkpoint.hook_note`); none for a fresh run or agreeing hooks."""
    if not cfg.checkpoint.load_dir:
        return []
    from workbench.checkpoint import CheckpointError, hook_note, read_checkpoint

    try:
        note = hook_note(cfg, read_checkpoint(cfg.checkpoint.load_dir))
    except (CheckpointError, OSError, ValueError):  # the launch checks judged the checkpoint already
        return []
    return [note] if note else []


@dataclass
class SupervisedResult:
    returncode: int
    output: str  # what the command printed (stdout and stderr), unless it went to the terminal
    work_dir: Path


def run_supervised(command: Sequence[str], work_dir: str | Path, *, env: dict[str, str] | None = None,
                   timeout: float | None = None, capture: bool = True, grace: float = 10.0) -> SupervisedResult:
    """Run ``command`` (e.g. a torchrun of generation's ranks) under the supervisor and wait for it.

    The supervisor watches this process: if the caller dies, the command's whole process tree
    goes too; on ``timeout`` (or Ctrl-C) the tree is stopped and :class:`subprocess.TimeoutExpired`
    (or KeyboardInterrupt) is raised.  ``capture``: the output goes to ``<work_dir>/logs/launcher.log``
    and comes back in the result; otherwise it goes to this process's terminal.
    """
    work = Path(work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    sup_cmd = supervisor_command(work, list(command), watch_pid=os.getpid(), grace=grace, error_grace=grace)
    write_json_atomic(work / "launch.json", {"command": list(command), "shell": shlex.join(command),
                                             "supervisor_command": sup_cmd, "kernel_pid": os.getpid(), "started": time.time()})
    log_path = work / "logs" / "launcher.log"
    log = open(log_path, "ab") if capture else None
    start = log_path.stat().st_size if capture else 0
    try:
        popen = spawn_supervisor(sup_cmd, env, log)
        try:
            rc = popen.wait(timeout=timeout)
        except BaseException:  # timeout or interrupt: stop the tree, then re-raise
            stop_supervisor(popen, grace)
            raise
    finally:
        if log is not None:
            log.close()
    output = ""
    if capture:
        with open(log_path, "rb") as fh:
            fh.seek(start)
            output = fh.read().decode("utf-8", "replace")
    return SupervisedResult(int(rc), output, work)


def stop_supervisor(popen: subprocess.Popen, grace: float) -> None:
    """SIGTERM the supervisor (it stops its tree), SIGKILL its process group if it outlives ``grace``."""
    if popen.poll() is None:
        stop([live_process(popen.pid)], grace + 8.0, group=popen.pid)
