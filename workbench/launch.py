"""Launching and supervising processes: the one launch path of the workbench.

Why a supervisor: the notebook kernel must never fork itself into a training job nor touch CUDA,
and a crashed or restarted kernel must not leave GPU processes behind.  So a run is:

    caller ──Popen(start_new_session)──▶ supervisor (``python -m workbench.launch supervise``)
                                            └─▶ torchrun ──▶ rank processes (own sessions)

- :func:`launch_checks` is every check made before anything starts (the config, its data and
  checkpoint, this machine's GPUs, the rendezvous, the run directory); ``Run.launch`` and
  ``workbench launch`` both call it, so the same bad input gives the same problems.
- :func:`start_run` prepares the run directory (``config.json``, ``command.sh``,
  ``launch.json``) and starts the supervisor; :func:`run_supervised` runs any other
  command (generation's ranks) under the same supervisor and waits for it.
- The **supervisor** leads the job's process group.  It is a Linux child sub-reaper (orphaned
  ranks re-parent to it), watches the launching process and kills the whole process tree
  when that disappears, kills the job when a rank reported an ``error`` event but the job
  did not tear down, ends it as ``failed`` when a rank makes no progress past a bound set by the
  run's own rhythm (:mod:`workbench.run.stall`; the ranks' stacks in ``stall_stacks.txt``), and
  writes ``<run_dir>/exit_status.json`` (:func:`write_exit_status`, :mod:`workbench.run.exit_status`:
  which rank caused a failure).
  It records torchrun and the ranks (PIDs with create times) in ``launch.json``, and the job
  cannot outlive it: torchrun and the ranks die with it even when it is SIGKILLed
  (:mod:`workbench.run.procs`).
- **Network.**  torchrun runs through :mod:`workbench.torchrun`: one node listens on 127.0.0.1
  only (rendezvous, the ranks' store, gloo/NCCL sockets); several nodes: node 0's store on the
  ``rdzv_endpoint`` address only.
- **Several nodes** (``nnodes > 1``, one ``workbench launch --node-rank K`` per node, static
  rendezvous) share one run directory on a shared filesystem; each node's supervisor keeps its
  files in its node directory, beats a heartbeat there and stops its job when another node
  failed, stopped or went silent (:mod:`workbench.run.nodes`), so one node's failure never
  leaves the other waiting in a collective for gloo's or NCCL's whole timeout.

No megatron-core or torch here; psutil is imported lazily.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Sequence

from workbench.config import ConfigError, Problem, RunConfig, load_config
from workbench.run import nodes, procs, stall
from workbench.run.exit_status import STATUSES, write_exit_status
from workbench.run.files import read_json, write_json_atomic, write_text_atomic
from workbench.run.reader import RunReader
from workbench.torchrun import MODULE as TORCHRUN_MODULE
from workbench.torchrun import bind_problem, one_node_args

__all__ = [
    "BACKEND_ENTRY",
    "STATUSES",
    "LaunchPlan",
    "new_run_dir",
    "detect_gpus",
    "launch_problems",
    "launch_checks",
    "apply_overrides",
    "start_run",
    "run_supervised",
    "local_torchrun",
    "write_exit_status",
]

#: torchrun's entry for the real backend; tests may launch a script path instead.
BACKEND_ENTRY: tuple[str, ...] = ("-m", "workbench.backend")
DEFAULT_RUN_ROOT = "runs"
DEFAULT_RDZV_PORT = 29500
#: the supervisor's command line (``python -m workbench.launch supervise ...``)
SUPERVISOR_MODULE = procs.SUPERVISOR_MODULE


# --------------------------------------------------------------------------- commands


@dataclass
class LaunchPlan:
    """Everything needed to write the exact torchrun / SLURM commands of one run."""

    run_dir: Path
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    python: str = field(default_factory=lambda: sys.executable)
    entry: tuple[str, ...] = BACKEND_ENTRY

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).absolute()
        self.entry = tuple(str(e) for e in self.entry)
        if self.rdzv_id is None:
            # must be the same on every node (each node may have its own run directory)
            self.rdzv_id = "workbench"

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def node_dir(self) -> Path:
        """This node's launch files (the run directory itself on node 0: :mod:`workbench.run.nodes`)."""
        return nodes.node_dir(self.run_dir, self.node_rank)

    @property
    def log_dir(self) -> Path:
        return self.node_dir / "logs" / "torchrun"

    def torchrun_args(self) -> list[str]:
        """Rendezvous + logging options.  One node: a c10d rendezvous on the loopback at a port the OS picks
        (no clashes, nothing listening beyond 127.0.0.1: :mod:`workbench.torchrun`); several nodes: the
        static rendezvous at ``rdzv_endpoint``, whose store node 0 opens on that address only."""
        if self.nnodes == 1 and not self.rdzv_endpoint:
            args = one_node_args()
        else:
            endpoint = self.rdzv_endpoint or f"localhost:{DEFAULT_RDZV_PORT}"
            # static rendezvous: node ranks are the ones given, so global rank = node_rank*nproc + local_rank
            args = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--rdzv-endpoint", endpoint, "--rdzv-id", str(self.rdzv_id)]
        return args + ["--nproc-per-node", str(self.nproc_per_node), "--log-dir", str(self.log_dir),
                       "--redirects", "3", "--tee", "3"]

    def entry_args(self) -> list[str]:
        return [*self.entry, "--config", str(self.config_path), "--run-dir", str(self.run_dir)]

    def command(self) -> list[str]:
        """The torchrun command line this node runs (torch's torchrun through :mod:`workbench.torchrun`)."""
        return [self.python, "-m", TORCHRUN_MODULE, *self.torchrun_args(), *self.entry_args()]

    def shell(self) -> str:
        return shlex.join(self.command())

    def slurm_script(self, *, partition: str | None = None, account: str | None = None,
                     time_limit: str | None = None, gpus: bool = True, port: int | None = None) -> str:
        """A SLURM batch script: one ``srun`` task per node, each running torchrun.

        Uses the c10d rendezvous on the first node of the allocation (PyTorch's recommended
        multi-node recipe), so every node runs the identical command; the endpoint is that node's
        address as SLURM reaches it (``NodeAddr``: its host name unless the cluster sets another)
        and ``port``, or a port derived from the job id (jobs sharing a node do not clash).  The
        script's output is the run's ``logs/launcher.log`` (``Run.log_tail()``).

        Stopping (``scancel``, the time limit, a preemption): SLURM sends SIGTERM to every process
        of the job, SIGKILL after its ``KillWait``.  Each rank gets that SIGTERM once, so the ranks
        stop together at a step boundary (``run_end`` "stopped", the checkpoint on exit).  torchrun
        starts with SIGTERM ignored and left out of its handled signals (``PET_SIGNALS_TO_HANDLE``,
        torch >= 2.8): it would forward a second SIGTERM, on which a rank leaves mid-step and its
        peers fail in their collective.  (The ranks inherit the ignored SIGTERM until the backend
        installs its handler, a few seconds into their start: a stop in that window ends at the
        SIGKILL.)  ``srun`` runs in the background so that the script sees the signal at once: it
        records ``exit_status.json`` as ``stopped`` then (SIGKILL may follow) and again when srun
        returns; otherwise it records the job's own result (:func:`write_exit_status`).
        """
        q = shlex.quote
        py, run_dir = q(self.python), q(str(self.run_dir))
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={self.run_dir.name}",
            f"#SBATCH --nodes={self.nnodes}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --exclusive",  # the whole node for its one torchrun: every core and all memory to the ranks
            "#SBATCH --mem=0",
            f"#SBATCH --output={self.run_dir}/logs/launcher.log",
            "#SBATCH --open-mode=append",
        ]
        if gpus:
            lines.append(f"#SBATCH --gpus-per-node={self.nproc_per_node}")
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        if account:
            lines.append(f"#SBATCH --account={account}")
        if time_limit:
            lines.append(f"#SBATCH --time={time_limit}")
        rdzv_port = str(int(port)) if port else "$((15000 + SLURM_JOB_ID % 10000))"
        status = f"{py} -m workbench.launch exit-status --run-dir {run_dir}"
        lines += [
            "# generated by workbench.launch; submit with: sbatch " + q(str(self.run_dir / "slurm.sbatch")),
            "# (partition / account / time limit: sbatch's SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT)",
            "set -uo pipefail",
            'started="$(date +%s)"',
            'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            "# the rendezvous is on the first node, at its address as SLURM reaches it (NodeAddr: the host name",
            "# unless the cluster sets another), its store listening on that address only; one torchrun per node",
            'head_addr="$(sinfo -h -N -n "$head_node" -o %o 2>/dev/null | head -n 1)"',
            'head_addr="${head_addr:-$head_node}"',
            f'rdzv_port="{rdzv_port}"',
            "export PYTHONUNBUFFERED=1",
            'echo "[workbench] SLURM job $SLURM_JOB_ID: $SLURM_NNODES node(s) ($SLURM_JOB_NODELIST), '
            'rendezvous $head_addr:$rdzv_port"',
            "# Stopping (scancel, the time limit, a preemption): SLURM sends SIGTERM to every process of the job",
            "# and SIGKILL after KillWait.  Each rank gets that SIGTERM once and the ranks stop together at a step",
            "# boundary; torchrun leaves SIGTERM alone (forwarded, it would be a second one: ranks leave mid-step).",
            "# This script notes the signal and records the run as stopped (at once, and again at the end).",
            "export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT",
            "signals=0",
            "trap 'signals=$((signals + 1))' TERM INT",
            "# srun (>= 22.05) does not inherit the job's CPUs: give the one task per node all of them",
            f"srun --kill-on-bad-exit=1 --cpus-per-task=\"$SLURM_CPUS_ON_NODE\" bash -c 'trap \"\" TERM; exec \"$@\"' torchrun {py} -m {TORCHRUN_MODULE} \\",
            '    --nnodes "$SLURM_NNODES" --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" \\',
            f'    --rdzv-endpoint "$head_addr:$rdzv_port" --nproc-per-node {self.nproc_per_node} \\',
            f"    --log-dir {q(str(self.log_dir))} --redirects 3 --tee 3 \\",
            "    " + shlex.join(self.entry_args()) + " &",
            "srun_pid=$!",
            "while :; do",
            "    seen=$signals",
            '    wait "$srun_pid"; rc=$?',
            '    [ "$signals" -eq "$seen" ] && break  # srun has ended (a trapped signal only interrupts the wait)',
            f'    [ "$seen" -eq 0 ] && {status} --started "$started" --status stopped --reason slurm-signal',
            "done",
            'if [ "$signals" -gt 0 ]; then',
            f'    {status} --returncode "$rc" --started "$started" --status stopped --reason slurm-signal',
            "else",
            f'    {status} --returncode "$rc" --started "$started"',
            "fi",
            'exit "$rc"',
        ]
        return "\n".join(lines) + "\n"


def local_torchrun(nproc_per_node: int, *, python: str | None = None) -> list[str]:
    """The head of a one-node torchrun command (up to the entry point) whose rendezvous and stores listen
    on the loopback only: generation's and verification's ranks (training's: :class:`LaunchPlan`)."""
    return [python or sys.executable, "-m", TORCHRUN_MODULE, *one_node_args(), "--nproc-per-node", str(int(nproc_per_node))]


def new_run_dir(name: str, run_root: str | Path | None = None) -> Path:
    """A fresh, unique run directory path ``<root>/<name>-<UTC timestamp>-<4 hex>`` (not created)."""
    root = Path(run_root or os.environ.get("WORKBENCH_RUNS", DEFAULT_RUN_ROOT))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return (root / f"{safe}-{stamp}-{uuid.uuid4().hex[:4]}").absolute()


def detect_gpus() -> int:
    """Number of visible NVIDIA GPUs, asked of ``nvidia-smi`` so the kernel never initialises CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    exe = shutil.which("nvidia-smi")
    if not exe:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def launch_problems(cfg: RunConfig, *, local: bool = True) -> list[Problem]:
    """Config problems plus what this machine cannot run (checked before any process starts)."""
    problems = list(cfg.validate())
    if not problems:  # data and checkpoint paths are only worth checking for a well-formed config
        from workbench.data import check_data

        problems += check_data(cfg)
        from workbench.run.checkpoint import load_problems

        problems += load_problems(cfg)
    if local and cfg.parallel.device == "cuda":
        gpus = detect_gpus()
        if gpus == 0:
            problems.append(Problem("parallel.device", "device is 'cuda' but no NVIDIA GPU is visible on this machine",
                                    "use device: cpu with a tiny model (preset 'tiny'), or run on a GPU machine"))
        elif cfg.parallel.nproc_per_node > gpus:
            problems.append(Problem("parallel.nproc_per_node", f"{cfg.parallel.nproc_per_node} processes per node but only {gpus} GPU(s) visible",
                                    f"use nproc_per_node <= {gpus}"))
        from workbench import kernels

        if kernels.choose(cfg).attention == "te" and not kernels.te_available():  # explicit: auto never picks an absent TE
            problems.append(Problem("model.attention_backend", f"Transformer Engine's layer is asked for but TE is not usable "
                                    f"here ({kernels.te_status()[1]})", "install it (bash launch/install_te.sh), or set "
                                    "attention_backend: auto" + (" and te_userbuffers: false" if cfg.parallel.te_userbuffers else "")))
    return problems


def apply_overrides(cfg: RunConfig, *, nproc_per_node: int | None = None, nnodes: int | None = None) -> RunConfig:
    """``cfg`` with the launch's process counts written in (so the backend sees the same world size)."""
    overrides: dict[str, int] = {}
    if nproc_per_node is not None:
        overrides["parallel.nproc_per_node"] = int(nproc_per_node)
    if nnodes is not None:
        overrides["parallel.nnodes"] = int(nnodes)
    return cfg.replace(**overrides) if overrides else cfg


def launch_checks(cfg: RunConfig, *, run_dir: str | Path | None = None, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, local: bool = True, slurm: bool = False,
                  node_timeout: float | None = None, stall_floor: float | None = None,
                  startup_timeout: float | None = None) -> list[Problem]:
    """Every problem that stops a launch, before any process starts (``Run.launch`` and ``workbench launch``).

    ``local``: check this machine's GPUs too (not for a dry run or a SLURM script).  ``slurm``: the
    SLURM script brings its own rendezvous.  ``run_dir``: must be new or empty; for one node of a
    multi-node run it is the run directory every node shares (:mod:`workbench.run.nodes`), which
    must hold nothing of this node yet and no other config.
    """
    problems = launch_problems(cfg, local=local)
    multi = cfg.parallel.nnodes > 1 and not slurm
    if cfg.parallel.nnodes > 1 and not rdzv_endpoint and not slurm:
        problems.append(Problem("rdzv_endpoint", f"{cfg.parallel.nnodes} nodes need a rendezvous endpoint",
                                "pass rdzv_endpoint='HOST:PORT' of node 0 (--rdzv-endpoint), or use the SLURM script (--slurm)"))
    if rdzv_endpoint and not slurm:
        host, _, port = str(rdzv_endpoint).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(Problem("rdzv_endpoint", f"{rdzv_endpoint!r} is not HOST:PORT",
                                    "pass node 0's address and a free TCP port, e.g. --rdzv-endpoint 10.0.0.1:29500"))
        elif node_rank == 0 and (why := bind_problem(host.strip("[]"))):  # node 0's store listens on that address only
            problems.append(Problem("rdzv_endpoint", f"node 0 hosts the rendezvous store on {host}, but {why}",
                                    "pass node 0's own address (the one the other nodes reach it at) as --rdzv-endpoint HOST:PORT"))
    if not 0 <= node_rank < max(cfg.parallel.nnodes, 1):
        problems.append(Problem("node_rank", f"node_rank {node_rank} is outside 0..{cfg.parallel.nnodes - 1}",
                                "use 0 on the first node, 1 on the second, ..."))
    if node_timeout is not None and not (isinstance(node_timeout, (int, float)) and node_timeout > 0):
        problems.append(Problem("node_timeout", f"{node_timeout!r} is not a positive number of seconds",
                                f"pass the seconds another node may go without a heartbeat, e.g. --node-timeout {nodes.DEFAULT_NODE_TIMEOUT:.0f}"))
    for name, value, default, low in (("stall_floor", stall_floor, stall.DEFAULT_STALL_FLOOR, 0.0),
                                      ("startup_timeout", startup_timeout, stall.DEFAULT_STARTUP_TIMEOUT, 1e-9)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and value >= low and value < float("inf")):
            problems.append(Problem(name, f"{value!r} is not {'a number of seconds >= 0' if low == 0 else 'a positive number of seconds'}",
                                    f"pass seconds, e.g. --{name.replace('_', '-')} {default:.0f} (the default)"
                                    + (" or 0 to turn the stall watch off" if low == 0 else "")))
    if run_dir is not None:
        d = Path(run_dir)
        if multi:
            problems += _shared_run_dir_problems(cfg, d, node_rank)
        elif d.exists() and not d.is_dir():
            problems.append(Problem("run_dir", f"{d.absolute()} exists and is not a directory", "pass a new run_dir (or none for a fresh one)"))
        elif d.exists() and any(d.iterdir()):
            problems.append(Problem("run_dir", f"{d.absolute()} exists and is not empty", "pass a new run_dir (or none for a fresh one)"))
    return problems


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shared_run_dir_problems(cfg: RunConfig, d: Path, node_rank: int) -> list[Problem]:
    """A multi-node run directory: shared by the nodes, so the other nodes' files may be there already."""
    d = d.absolute()
    if not d.exists():
        return []
    if not d.is_dir():
        return [Problem("run_dir", f"{d} exists and is not a directory", "pass a new run_dir, the same on every node")]
    own = nodes.node_dir(d, node_rank)
    for name in (nodes.LAUNCH_FILE, nodes.EXIT_STATUS_FILE):
        if (own / name).exists():
            return [Problem("run_dir", f"node {node_rank} of a run was already launched in {d} ({own / name} exists)",
                            "pass a new run_dir for a new run, the same one on every node")]
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        # what another node that is starting at this moment may already have made (its config.json, written
        # atomically, then follows): not a sign of an unrelated directory
        starting = {nodes.NODES_DIR, "events", "logs", "data_cache", "checkpoints", "slurm.sbatch"}
        if any(p.name not in starting and not p.name.startswith((".config.json.tmp-", ".slurm.sbatch.tmp-"))
               for p in d.iterdir()):
            return [Problem("run_dir", f"{d} exists, is not empty and holds no run config",
                            "pass a new run_dir (or none for a fresh one), the same on every node")]
        return []
    try:
        theirs = load_config(cfg_file)
    except ConfigError as e:
        return [Problem("run_dir", f"{cfg_file} (written by another node) does not load: {e.problems[0]}",
                        "pass a new run_dir, the same on every node")]
    mine, other = _flat(cfg.to_dict()), _flat(theirs.to_dict())
    diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
    if diff:
        shown = ", ".join(f"{k} ({other.get(k)!r} there, {mine.get(k)!r} here)" for k in diff[:4]) + (" ..." if len(diff) > 4 else "")
        return [Problem("run_dir", f"{cfg_file}, written by another node of this run, differs from this node's config: {shown}",
                        "launch every node with the same config file and the same --nnodes / --nproc-per-node")]
    return []


# --------------------------------------------------------------------------- process helpers


def _proc(pid: int, create_time: float | None = None):
    """psutil.Process for ``pid`` if it is alive (and is the same process), else None."""
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.05:
            return None  # PID reused
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def _tree(root) -> list:
    import psutil

    try:
        return root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _signal_all(procs: Iterable, sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            pass


def _terminate(procs: list, grace: float) -> None:
    """SIGTERM, wait ``grace`` seconds, SIGKILL whatever is left, then wait for the kills."""
    import psutil

    procs = [p for p in procs if p is not None]
    if not procs:
        return
    _signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=max(grace, 0.0))
    if alive:
        _signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)


def _stop_tree(me, child: subprocess.Popen, grace: float) -> None:
    """Graceful stop of the job: ONE SIGTERM per rank, SIGKILL for whatever is left after ``grace``.

    torchrun forwards a SIGTERM to every rank exactly once, so it is the only process we signal
    while it lives (a second SIGTERM makes the backend's ranks leave without finishing the step).
    Ranks orphaned by a dead torchrun get the SIGTERM directly.
    """
    import psutil

    procs = _tree(me)
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    else:
        _signal_all(procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=max(grace, 0.0))
    alive = [p for p in alive if _alive(p)] + [p for p in _tree(me) if p not in procs]
    if alive:
        print(f"[supervisor] {len(alive)} process(es) still alive after {grace:.0f}s: SIGKILL", flush=True)
        _signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)


def _set_child_subreaper() -> None:
    """Linux: orphaned descendants (e.g. ranks whose torchrun died) re-parent to us, not init."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _create_time(pid: int) -> float | None:
    p = _proc(pid)
    try:
        return p.create_time() if p else None
    except Exception:
        return None


# --------------------------------------------------------------------------- supervisor


def _heartbeat(directory: Path, node_rank: int, done: threading.Event, every: float = 1.0) -> threading.Thread:
    """A thread that rewrites this node's ``heartbeat.json`` every ``every`` seconds until ``done``."""
    def beat() -> None:
        seq = 0
        while True:
            seq += 1
            try:
                nodes.write_heartbeat(directory, node_rank, seq)
            except OSError:
                pass  # a full or flaky shared filesystem: the next beat tries again
            if done.wait(every):
                return

    t = threading.Thread(target=beat, name="heartbeat", daemon=True)
    t.start()
    return t


def _stall_watch(run_dir: Path, node_rank: int, floor: float, startup: float) -> stall.StallWatch:
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


def _end_stalled(me, child: subprocess.Popen, verdict: stall.Stall, ndir: Path, node_rank: int, nproc: int) -> Path:
    """A stalled job: every rank's stacks into ``<node dir>/stall_stacks.txt`` (a stopped rank cannot print:
    the file says so), then SIGKILL for the whole tree (a stopped process dies of it too).  The file's path."""
    import psutil

    tree = _tree(me)
    ranks = procs.rank_processes(tree)
    logs = {r: procs.rank_log(ndir, r - node_rank * nproc) for r in ranks}
    stacks = procs.collect_stacks(ranks, logs, wait=2.0)
    out = ndir / "stall_stacks.txt"
    lines = [f"# {verdict.message}", f"# written by the supervisor at {datetime.now(timezone.utc).isoformat()}", ""]
    for r in sorted(ranks):
        lines += [f"=== rank {r} (pid {ranks[r].pid})", stacks.get(r) or "(nothing printed: no stderr log)", ""]
    write_text_atomic(out, "\n".join(lines))
    tree = _tree(me)  # the ranks first, then torchrun and whatever else is left
    _signal_all([p for p in tree if p.pid in {q.pid for q in ranks.values()}], signal.SIGKILL)
    _signal_all(tree, signal.SIGKILL)
    psutil.wait_procs([p for p in tree if p.pid != child.pid], timeout=10)  # torchrun: reaped by its Popen (its exit code)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return out


def _supervise(run_dir: Path, cmd: list[str], watch_pid: int, grace: float, error_grace: float, poll: float = 0.2, *,
               node_rank: int = 0, nnodes: int = 1, node_timeout: float = nodes.DEFAULT_NODE_TIMEOUT,
               stall_floor: float = 0.0, startup_timeout: float = stall.DEFAULT_STARTUP_TIMEOUT) -> int:
    """Body of the supervisor process (see the module docstring). Returns torchrun's exit code.

    One node of a multi-node run (``nnodes > 1``) keeps its files in its node directory, beats a
    heartbeat there and stops its job when another node failed, stopped or went silent
    (:class:`workbench.run.nodes.PeerWatch`).  ``stall_floor`` > 0: a rank without progress for
    longer than :class:`workbench.run.stall.StallWatch`'s bound ends the job as ``failed`` (reason
    ``stalled``), its ranks' stacks in ``stall_stacks.txt``.
    """
    import psutil

    _set_child_subreaper()
    started = time.time()
    stop_reason: list[str] = []
    ndir = nodes.node_dir(run_dir, node_rank)
    beating = threading.Event()
    peers = None
    peer: dict | None = None
    if nnodes > 1:
        _heartbeat(ndir, node_rank, beating)
        peers = nodes.PeerWatch(run_dir, node_rank, nnodes, timeout=node_timeout, grace=error_grace)

    def on_signal(signum, _frame):
        if not stop_reason:
            stop_reason.append("stopped")

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    # torchrun dies with us (even of a SIGKILL), and its ranks die with it (procs.guard_rank)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{procs.SUPERVISOR_ENV: procs.supervisor_token()})
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,  # inherits our stdout (launcher.log)
                             preexec_fn=procs.die_with_parent(signal.SIGKILL))
    launch_json = ndir / "launch.json"
    recorded: dict[tuple[int, float], dict] = {}

    def record(tree: list, first: bool = False) -> None:
        """launch.json's process records (for Run.stop without a supervisor): every process ever seen."""
        new = [r for r in procs.describe(tree, child.pid) if (r["pid"], r["create_time"]) not in recorded]
        if not new and not first:
            return
        recorded.update({(r["pid"], r["create_time"]): r for r in new})
        meta = read_json(launch_json) or {}
        meta.update(torchrun_pid=child.pid, torchrun_create_time=_create_time(child.pid), processes=list(recorded.values()))
        write_json_atomic(launch_json, meta)

    reader = RunReader(run_dir)
    error_seen_at: float | None = None
    me = psutil.Process()
    record([], first=True)
    watch = _stall_watch(run_dir, node_rank, stall_floor, startup_timeout)
    verdict: stall.Stall | None = None
    rc: int | None = None
    polls = 0
    while True:
        rc = child.poll()
        if rc is not None:
            break
        if polls % 5 == 0:  # about once a second
            record(_tree(me))
            hit = peers.check() if peers is not None and not stop_reason else None
            if hit is not None:
                stop_reason.append(hit[0])
                peer = hit[1]
                print(f"[supervisor] node {node_rank}: {peer['why']}: stopping this node's job", flush=True)
            verdict = watch.check(stopped=lambda: [r for r, p in procs.rank_processes(_tree(me)).items() if procs.is_stopped(p)])
            if verdict is not None and not stop_reason and error_seen_at is None:
                print(f"[supervisor] {verdict.message}: the run is stalled; writing the ranks' stacks and ending it", flush=True)
                stop_reason.append("stalled")
                break
            verdict = None
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

    stall_info: dict = {}
    if verdict is not None:  # stalled: nothing would answer a graceful stop
        stacks = _end_stalled(me, child, verdict, ndir, node_rank, int((read_json(launch_json) or {}).get("nproc_per_node") or 0))
        rc = child.poll()
        stall_info = {"stall": {**verdict.to_dict(), "stacks": str(stacks)}, "failed_message": verdict.message}
    if rc is None:  # stop requested, kernel gone, stalled, or hung after an error: take the whole tree down
        _stop_tree(me, child, grace)
        try:
            rc = child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            rc = child.wait()
    # Whatever survived torchrun (orphans re-parented to us as sub-reaper) goes too.
    for _ in range(3):
        left = _tree(me)
        if not left:
            break
        _terminate(left, 1.0)
    reason = stop_reason[0] if stop_reason else None
    status = "failed" if reason in ("failed", "stalled") else None
    info = write_exit_status(run_dir, rc, reason=reason, status=status, started=started, reader=reader,
                             node_rank=node_rank, peer=peer, failed_rank=verdict.rank if verdict else None, extra=stall_info)
    beating.set()
    where = f"node {node_rank}: " if nnodes > 1 else ""
    print(f"[supervisor] {where}run ended: {info['status']} (torchrun exit code {rc})", flush=True)
    return rc if isinstance(rc, int) else 1




# --------------------------------------------------------------------------- starting


def supervisor_command(run_dir: str | Path, command: Sequence[str], *, watch_pid: int = 0, grace: float = 10.0,
                       error_grace: float = 10.0, node_rank: int = 0, nnodes: int = 1,
                       node_timeout: float = nodes.DEFAULT_NODE_TIMEOUT, stall_floor: float | None = None,
                       startup_timeout: float | None = None) -> list[str]:
    """The supervisor's command line for ``command`` (see the module docstring).  ``stall_floor``:
    watch the ranks' progress (:mod:`workbench.run.stall`; None: no watch, for commands that write no events)."""
    multi = ["--node-rank", str(node_rank), "--nnodes", str(nnodes), "--node-timeout", str(node_timeout)] if nnodes > 1 else []
    if stall_floor:
        multi += ["--stall-floor", str(stall_floor), "--startup-timeout", str(startup_timeout or stall.DEFAULT_STARTUP_TIMEOUT)]
    return [sys.executable, "-m", SUPERVISOR_MODULE, "supervise", "--run-dir", str(run_dir), "--watch-pid", str(watch_pid),
            "--grace", str(grace), "--error-grace", str(error_grace), *multi, "--", *command]


def _spawn_supervisor(sup_cmd: list[str], env: dict[str, str] | None, stdout) -> subprocess.Popen:
    run_env = dict(os.environ)
    run_env.update(env or {})
    run_env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(sup_cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                            env=run_env, start_new_session=True, close_fds=True)


def start_run(cfg: RunConfig, run_dir: str | Path | None = None, *, node_rank: int = 0, rdzv_endpoint: str | None = None,
              rdzv_id: str | None = None, run_root: str | Path | None = None, entry: Sequence[str] = BACKEND_ENTRY,
              env: dict[str, str] | None = None, grace: float = 10.0, error_grace: float = 10.0,
              watch_parent: bool = True, check_devices: bool = True, node_timeout: float | None = None,
              stall_floor: float | None = None, startup_timeout: float | None = None) -> tuple[LaunchPlan, subprocess.Popen]:
    """Check (:func:`launch_checks`), create the run directory, start torchrun under a supervisor.

    Raises :class:`ConfigError` (nothing started, nothing written) when the config or this
    machine cannot run it.  Returns the plan and the supervisor's Popen.  One node of a
    multi-node run writes into the run directory every node shares, its own files in its node
    directory (:mod:`workbench.run.nodes`); nodes given separate run directories (no shared
    filesystem) each follow their own ranks only.  ``node_timeout``: seconds another node may
    go without a heartbeat before this node stops its job.  ``stall_floor`` / ``startup_timeout``:
    when a rank that makes no progress counts as stalled and ends the run (:mod:`workbench.run.stall`;
    defaults 300 s / 1800 s; ``stall_floor=0`` turns the watch off).
    """
    problems = launch_checks(cfg, run_dir=run_dir, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, local=check_devices,
                             node_timeout=node_timeout, stall_floor=stall_floor, startup_timeout=startup_timeout)
    if problems:
        raise ConfigError(problems)
    node_timeout = float(node_timeout or nodes.DEFAULT_NODE_TIMEOUT)
    stall_floor = stall.DEFAULT_STALL_FLOOR if stall_floor is None else float(stall_floor)
    startup_timeout = stall.DEFAULT_STARTUP_TIMEOUT if startup_timeout is None else float(startup_timeout)
    run_dir = Path(run_dir).absolute() if run_dir else new_run_dir(cfg.name, run_root)
    plan = LaunchPlan(run_dir, cfg.parallel.nproc_per_node, cfg.parallel.nnodes, node_rank, rdzv_endpoint,
                      rdzv_id or f"workbench-{cfg.name}", entry=tuple(entry))
    ndir = plan.node_dir
    if cfg.parallel.nnodes > 1:  # the nodes share the file (the same config, checked): first, and never half-written
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(plan.config_path, cfg.to_json())
    (ndir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "events").mkdir(exist_ok=True)
    if cfg.parallel.nnodes > 1:
        write_text_atomic(run_dir / "slurm.sbatch", plan.slurm_script(gpus=cfg.parallel.device == "cuda"))
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
        "host": nodes.host_name(),
    }
    if cfg.parallel.nnodes > 1:
        info.update(node_timeout=node_timeout, ranks=nodes.node_ranks(node_rank, plan.nproc_per_node))
    write_json_atomic(ndir / "launch.json", info)
    with open(ndir / "logs" / "launcher.log", "ab") as log:
        popen = _spawn_supervisor(sup_cmd, env, log)
    meta = read_json(ndir / "launch.json") or {}
    meta.update(supervisor_pid=popen.pid, pgid=popen.pid, supervisor_create_time=_create_time(popen.pid))
    write_json_atomic(ndir / "launch.json", meta)
    return plan, popen


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
        popen = _spawn_supervisor(sup_cmd, env, log)
        try:
            rc = popen.wait(timeout=timeout)
        except BaseException:  # timeout or interrupt: stop the tree, then re-raise
            _stop_supervisor(popen, grace)
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


def _stop_supervisor(popen: subprocess.Popen, grace: float) -> None:
    """SIGTERM the supervisor (it stops its tree), SIGKILL its process group if it outlives ``grace``."""
    if popen.poll() is None:
        try:
            popen.send_signal(signal.SIGTERM)
            popen.wait(timeout=grace + 8.0)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            popen.wait(timeout=5)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------- process entry


def _main(argv: list[str] | None = None) -> int:
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
    s.add_argument("--node-timeout", type=float, default=nodes.DEFAULT_NODE_TIMEOUT)
    s.add_argument("--stall-floor", type=float, default=0.0, help="0: no stall watch")
    s.add_argument("--startup-timeout", type=float, default=stall.DEFAULT_STARTUP_TIMEOUT)
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
        return _supervise(Path(a.run_dir), cmd, a.watch_pid, a.grace, a.error_grace, node_rank=a.node_rank, nnodes=a.nnodes,
                          node_timeout=a.node_timeout, stall_floor=a.stall_floor, startup_timeout=a.startup_timeout)
    info = write_exit_status(a.run_dir, a.returncode, status=a.status, reason=a.reason, started=a.started)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
