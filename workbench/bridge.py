"""The launch bridge: start, follow, stop and re-attach ``torchrun`` runs from a notebook or a shell.

Why a bridge: the notebook kernel must never fork itself into a training job nor touch CUDA,
and a crashed or restarted kernel must not leave GPU processes behind.  So a run is:

    kernel ──Popen(start_new_session)──▶ supervisor (``python -m workbench.bridge supervise``)
                                            └─▶ torchrun ──▶ rank processes (own sessions)

- The **supervisor** is a tiny process that leads the run's process group.  It is a Linux
  child sub-reaper (orphaned ranks re-parent to it), watches the launching process (kernel
  PID) and kills the whole process tree when that disappears, kills the job when a rank
  reported an ``error`` event but the job did not tear down, and writes
  ``<run_dir>/exit_status.json`` (status, return code, failed rank).
- :class:`Run` (kernel side) follows ``<run_dir>/events/rank-*.jsonl`` incrementally
  (:class:`workbench.events.EventFollower`, partial lines tolerated), exposes the records as
  pandas DataFrames and a status, surfaces a failing rank with its traceback, and stops the
  run: SIGTERM to the supervisor, which SIGTERMs torchrun, which SIGTERMs each rank once (the
  backend finishes its step and saves); SIGKILL for anything left after the grace period,
  and the kernel side kills the process group and every process it saw if even that fails.
- :meth:`Run.attach` rebuilds all of that from the files of a run directory, whether the
  run is finished or still running (``launch.json`` records the supervisor's PID).

The same module runs notebooks headless through papermill (``workbench notebook run``) and
sweeps a notebook over a parameter grid (``workbench sweep``).  No megatron-core here; pandas,
psutil and papermill are imported lazily so ``import workbench.bridge`` stays light.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
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
import weakref
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from workbench.config import ConfigError, Problem, RunConfig, load_config
from workbench.events import KINDS, EventFollower

__all__ = [
    "BACKEND_ENTRY",
    "STATUSES",
    "LaunchPlan",
    "Failure",
    "Run",
    "new_run_dir",
    "detect_gpus",
    "launch_problems",
    "write_exit_status",
    "run_notebook",
    "NotebookResult",
    "sweep",
    "parse_grid",
    "record_metrics",
    "quickstart_config",
    "generate_from_run",
    "add_cli",
]

#: torchrun's entry for the real backend; tests may launch a script path instead.
BACKEND_ENTRY: tuple[str, ...] = ("-m", "workbench.backend")
STATUSES = ("starting", "running", "finished", "failed", "stopped")
DEFAULT_RUN_ROOT = "runs"
DEFAULT_RDZV_PORT = 29500


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
    def log_dir(self) -> Path:
        return self.run_dir / "logs" / "torchrun"

    def torchrun_args(self) -> list[str]:
        """Rendezvous + logging options. One node: ``--standalone`` (a free port, no clashes)."""
        if self.nnodes == 1 and not self.rdzv_endpoint:
            args = ["--standalone", "--nnodes", "1"]
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
        """The torchrun command line this node runs."""
        return [self.python, "-m", "torch.distributed.run", *self.torchrun_args(), *self.entry_args()]

    def shell(self) -> str:
        return shlex.join(self.command())

    def slurm_script(self, *, partition: str | None = None, account: str | None = None,
                     time_limit: str | None = None, gpus: bool = True, port: int = DEFAULT_RDZV_PORT) -> str:
        """A SLURM batch script: one ``srun`` task per node, each running torchrun.

        Uses the c10d rendezvous on the first node of the allocation (PyTorch's recommended
        multi-node recipe), so every node runs the identical command.
        """
        q = shlex.quote
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name={self.run_dir.name}",
            f"#SBATCH --nodes={self.nnodes}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --output={self.run_dir}/logs/slurm-%j.out",
        ]
        if gpus:
            lines.append(f"#SBATCH --gpus-per-node={self.nproc_per_node}")
        if partition:
            lines.append(f"#SBATCH --partition={partition}")
        if account:
            lines.append(f"#SBATCH --account={account}")
        if time_limit:
            lines.append(f"#SBATCH --time={time_limit}")
        lines += [
            "# generated by workbench.bridge; submit with: sbatch " + q(str(self.run_dir / "slurm.sbatch")),
            "set -uo pipefail",
            'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
            "export PYTHONUNBUFFERED=1",
            f"srun --kill-on-bad-exit=1 {q(self.python)} -m torch.distributed.run \\",
            '    --nnodes "$SLURM_NNODES" --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" \\',
            f'    --rdzv-endpoint "$head_node:{port}" --nproc-per-node {self.nproc_per_node} \\',
            f"    --log-dir {q(str(self.log_dir))} --redirects 3 --tee 3 \\",
            "    " + shlex.join(self.entry_args()),
            "rc=$?",
            f"{q(self.python)} -m workbench.bridge exit-status --run-dir {q(str(self.run_dir))} --returncode \"$rc\"",
            'exit "$rc"',
        ]
        return "\n".join(lines) + "\n"


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
        from workbench.backend.checkpointing import load_problems  # stdlib-only at import

        problems += load_problems(cfg)
    if local and cfg.parallel.device == "cuda":
        gpus = detect_gpus()
        if gpus == 0:
            problems.append(Problem("parallel.device", "device is 'cuda' but no NVIDIA GPU is visible on this machine",
                                    "use device: cpu with a tiny model (preset 'tiny'), or run on a GPU machine"))
        elif cfg.parallel.nproc_per_node > gpus:
            problems.append(Problem("parallel.nproc_per_node", f"{cfg.parallel.nproc_per_node} processes per node but only {gpus} GPU(s) visible",
                                    f"use nproc_per_node <= {gpus}"))
    return problems


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


# --------------------------------------------------------------------------- exit status


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def _root_cause_rank(text: str) -> int | None:
    """The global rank of torchrun's 'Root Cause (first observed failure)' block, if any."""
    i = text.rfind("Root Cause")
    if i < 0:
        return None
    m = re.search(r"rank\s*:\s*(\d+)", text[i:])
    return int(m.group(1)) if m else None


def write_exit_status(run_dir: str | Path, returncode: int | None, *, reason: str | None = None,
                      status: str | None = None, started: float | None = None) -> dict:
    """Write ``<run_dir>/exit_status.json``: status, return code, failed rank (from events or torchrun's report)."""
    run_dir = Path(run_dir)
    from workbench.events import read_events

    events = read_events(run_dir)
    errors = [e for e in events if e.get("event") == "error"]
    ends = [e for e in events if e.get("event") == "run_end"]
    if status is None:
        if reason in ("stopped", "kernel-exited"):
            status = "stopped"
        elif returncode == 0:
            status = "stopped" if any(e.get("status") == "stopped" for e in ends) else "finished"
        else:
            status = "failed"
    failed_rank = errors[0].get("rank") if errors else None
    if failed_rank is None and status == "failed":
        launcher_log = run_dir / "logs" / "launcher.log"
        try:
            failed_rank = _root_cause_rank(launcher_log.read_text(errors="replace")[-20000:])
        except OSError:
            pass
    data = {
        "status": status,
        "returncode": returncode,
        "reason": reason or status,
        "failed_rank": failed_rank,
        "started": started,
        "ended": time.time(),
        "seconds": (time.time() - started) if started else None,
    }
    (run_dir).mkdir(parents=True, exist_ok=True)
    _write_json_atomic(run_dir / "exit_status.json", data)
    return data


# --------------------------------------------------------------------------- supervisor


def _supervise(run_dir: Path, cmd: list[str], watch_pid: int, grace: float, error_grace: float, poll: float = 0.2) -> int:
    """Body of the supervisor process (see the module docstring). Returns torchrun's exit code."""
    import psutil

    _set_child_subreaper()
    started = time.time()
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        if not stop_reason:
            stop_reason.append("stopped")

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)  # inherits our stdout (launcher.log)
    launch_json = run_dir / "launch.json"
    meta = _read_json(launch_json) or {}
    meta.update(torchrun_pid=child.pid)
    _write_json_atomic(launch_json, meta)

    follower = EventFollower(run_dir)
    error_seen_at: float | None = None
    me = psutil.Process()
    rc: int | None = None
    while True:
        rc = child.poll()
        if rc is not None:
            break
        if not stop_reason and watch_pid and (os.getppid() != watch_pid or not psutil.pid_exists(watch_pid)):
            stop_reason.append("kernel-exited")
            print(f"[supervisor] launching process {watch_pid} is gone: stopping the run", flush=True)
        if stop_reason:
            break
        if error_seen_at is None and any(e.get("event") == "error" for e in follower.poll()):
            error_seen_at = time.time()
        if error_seen_at is not None and time.time() - error_seen_at > error_grace:
            print(f"[supervisor] a rank reported an error {error_grace:.0f}s ago and the job did not tear down: killing it", flush=True)
            stop_reason.append("failed")
            break
        time.sleep(poll)

    if rc is None:  # stop requested, kernel gone, or hung after an error: take the whole tree down
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
    status = "failed" if reason == "failed" else None
    info = write_exit_status(run_dir, rc, reason=reason, status=status, started=started)
    print(f"[supervisor] run ended: {info['status']} (torchrun exit code {rc})", flush=True)
    return rc if isinstance(rc, int) else 1


# --------------------------------------------------------------------------- the run


@dataclass
class Failure:
    """Which rank failed and why, for the notebook to show."""

    rank: int | None
    message: str
    traceback: str
    source: str  # "event" (the rank's error event) | "stderr" (tail of its log) | "launcher"
    log_path: str | None = None

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "unknown rank"
        return f"{where} failed: {self.message}\n{self.traceback}".rstrip()


_LIVE_RUNS: "weakref.WeakSet[Run]" = weakref.WeakSet()


@atexit.register
def _stop_live_runs() -> None:  # kernel shutdown / interpreter exit ends the runs it started
    for run in list(_LIVE_RUNS):
        try:
            if run._owned and run.is_alive():
                run.stop(grace=5)
        except Exception:
            pass


class Run:
    """One training run: its directory, its (possibly running) processes and its events.

    Build with :meth:`launch` (starts it) or :meth:`attach` (reads an existing run directory).
    Everything is derived from files plus the process state, so a re-attached run shows the
    same DataFrames and status as the one launched here.
    """

    def __init__(self, run_dir: str | Path, *, popen: subprocess.Popen | None = None, plan: LaunchPlan | None = None):
        self.run_dir = Path(run_dir).absolute()
        self.plan = plan
        self._popen = popen
        self._owned = popen is not None
        self._follower = EventFollower(self.run_dir)
        self._records: dict[str, list[dict]] = {k: [] for k in KINDS}
        self._last_event_time = 0.0  # the newest event's timestamp (any kind, any rank)
        self._lock = threading.RLock()
        self._stop_requested = False
        cfg_path = self.run_dir / "config.json"
        self.config: RunConfig | None = None
        if cfg_path.exists():
            try:
                self.config = load_config(cfg_path)
            except ConfigError as e:  # an older run dir whose config no longer loads: follow its events anyway
                print(f"warning: {cfg_path} does not load with this workbench version ({len(e.problems)} problem(s)); "
                      "progress totals and planner bars are unavailable", file=sys.stderr)
        if popen is not None:
            _LIVE_RUNS.add(self)

    # ---- construction
    @classmethod
    def launch(
        cls,
        cfg: RunConfig,
        run_dir: str | Path | None = None,
        *,
        nproc_per_node: int | None = None,
        nnodes: int | None = None,
        node_rank: int = 0,
        rdzv_endpoint: str | None = None,
        rdzv_id: str | None = None,
        run_root: str | Path | None = None,
        entry: Sequence[str] = BACKEND_ENTRY,
        env: dict[str, str] | None = None,
        grace: float = 10.0,
        error_grace: float = 10.0,
        watch_parent: bool = True,
        check_devices: bool = True,
    ) -> "Run":
        """Validate, create a fresh run dir (config.json saved), start torchrun under a supervisor.

        ``nproc_per_node`` / ``nnodes`` default to the config's ``parallel`` section; when given
        they are written into the saved config so the backend sees the same world size.
        Raises :class:`ConfigError` (nothing started) when the config or this machine cannot run it.
        """
        overrides: dict[str, Any] = {}
        if nproc_per_node is not None:
            overrides["parallel.nproc_per_node"] = int(nproc_per_node)
        if nnodes is not None:
            overrides["parallel.nnodes"] = int(nnodes)
        if overrides:
            cfg = cfg.replace(**overrides)
        problems = launch_problems(cfg, local=check_devices)
        if (cfg.parallel.nnodes > 1 or rdzv_endpoint) and not rdzv_endpoint:
            problems.append(Problem("rdzv_endpoint", f"{cfg.parallel.nnodes} nodes need a rendezvous endpoint", "pass rdzv_endpoint='HOST:PORT' of node 0 (or use the SLURM script)"))
        if not 0 <= node_rank < max(cfg.parallel.nnodes, 1):
            problems.append(Problem("node_rank", f"node_rank {node_rank} is outside 0..{cfg.parallel.nnodes - 1}", "use 0 on the first node, 1 on the second, ..."))
        run_dir = Path(run_dir).absolute() if run_dir else new_run_dir(cfg.name, run_root)
        if run_dir.exists() and any(run_dir.iterdir()):
            problems.append(Problem("run_dir", f"{run_dir} exists and is not empty", "pass a new run_dir (or none for a fresh one)"))
        if problems:
            raise ConfigError(problems)

        plan = LaunchPlan(run_dir, cfg.parallel.nproc_per_node, cfg.parallel.nnodes, node_rank, rdzv_endpoint,
                          rdzv_id or f"workbench-{cfg.name}", entry=tuple(entry))
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "events").mkdir(exist_ok=True)
        cfg.save(plan.config_path)
        if cfg.parallel.nnodes > 1:
            (run_dir / "slurm.sbatch").write_text(plan.slurm_script(gpus=cfg.parallel.device == "cuda"))
        torchrun_cmd = plan.command()
        watch_pid = os.getpid() if watch_parent else 0
        sup_cmd = [sys.executable, "-m", "workbench.bridge", "supervise", "--run-dir", str(run_dir),
                   "--watch-pid", str(watch_pid), "--grace", str(grace), "--error-grace", str(error_grace), "--", *torchrun_cmd]
        (run_dir / "command.sh").write_text("#!/bin/bash\n# the torchrun command of this run (this node)\n" + plan.shell() + "\n")
        started = time.time()
        _write_json_atomic(run_dir / "launch.json", {
            "command": torchrun_cmd, "shell": plan.shell(), "supervisor_command": sup_cmd,
            "nproc_per_node": plan.nproc_per_node, "nnodes": plan.nnodes, "node_rank": plan.node_rank,
            "rdzv_endpoint": plan.rdzv_endpoint, "kernel_pid": watch_pid or None, "started": started,
            "host": os.uname().nodename,
        })
        run_env = dict(os.environ)
        run_env.update(env or {})
        run_env["PYTHONUNBUFFERED"] = "1"
        with open(run_dir / "logs" / "launcher.log", "ab") as log:
            popen = subprocess.Popen(sup_cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=run_env, start_new_session=True, close_fds=True)
        meta = _read_json(run_dir / "launch.json") or {}
        meta.update(supervisor_pid=popen.pid, pgid=popen.pid, supervisor_create_time=_create_time(popen.pid))
        _write_json_atomic(run_dir / "launch.json", meta)
        return cls(run_dir, popen=popen, plan=plan)

    @classmethod
    def attach(cls, run_dir: str | Path) -> "Run":
        """Re-open an existing run directory (finished or still running)."""
        run_dir = Path(run_dir).absolute()
        if not (run_dir / "config.json").exists() and not (run_dir / "events").is_dir():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json or events/); pass the directory Run.launch created")
        meta = _read_json(run_dir / "launch.json") or {}
        plan = None
        if meta.get("command"):
            plan = LaunchPlan(run_dir, int(meta.get("nproc_per_node") or 1), int(meta.get("nnodes") or 1),
                              int(meta.get("node_rank") or 0), meta.get("rdzv_endpoint"))
        run = cls(run_dir, plan=plan)
        return run

    # ---- process state
    @property
    def launch_info(self) -> dict:
        return _read_json(self.run_dir / "launch.json") or {}

    @property
    def exit_status(self) -> dict | None:
        return _read_json(self.run_dir / "exit_status.json")

    def _supervisor(self):
        if self._popen is not None:
            if self._popen.poll() is not None:
                return None
            return _proc(self._popen.pid)
        meta = self.launch_info
        pid = meta.get("supervisor_pid")
        return _proc(int(pid), meta.get("supervisor_create_time")) if pid else None

    def is_alive(self) -> bool:
        """True while the run's supervisor (and so torchrun / the ranks) is running."""
        return self._supervisor() is not None

    def processes(self) -> list:
        """psutil.Process objects of the run that are alive now (supervisor, torchrun, ranks)."""
        sup = self._supervisor()
        return [sup, *_tree(sup)] if sup is not None else []

    # ---- events
    def refresh(self) -> int:
        """Read events written since the last call; returns how many arrived."""
        with self._lock:
            new = self._follower.poll()
            for rec in new:
                self._records.setdefault(rec.get("event", "?"), []).append(rec)
                self._last_event_time = max(self._last_event_time, float(rec.get("time") or 0.0))
            return len(new)

    def events(self, kind: str | None = None) -> list[dict]:
        self.refresh()
        with self._lock:
            if kind is None:
                return sorted((r for rs in self._records.values() for r in rs), key=lambda r: r.get("time", 0))
            return list(self._records.get(kind, []))

    @property
    def status(self) -> str:
        """starting / running / finished / failed / stopped, from events, exit_status.json and the processes."""
        self.refresh()
        ex = self.exit_status
        if ex and ex.get("status") in STATUSES:
            return ex["status"]
        with self._lock:
            errors = bool(self._records["error"])
            ends = list(self._records["run_end"])
            begun = bool(self._records["run_start"] or self._records["step"])
        if self.is_alive():
            if errors:
                return "failed"  # being torn down; the supervisor finishes the job
            return "running" if begun else "starting"
        # not alive and no exit status: the supervisor was killed (or a foreign launcher)
        if errors:
            return "failed"
        if self._stop_requested:
            return "stopped"
        if ends:
            states = {e.get("status") for e in ends}
            for s in ("failed", "stopped"):
                if s in states:
                    return s
            return "finished"
        if self._popen is None and not self.launch_info:
            return "running" if begun else "starting"  # events only (e.g. launched by SLURM): cannot tell
        return "failed"

    @property
    def done(self) -> bool:
        return self.status in ("finished", "failed", "stopped")

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> str:
        """Block until the run ends (or ``timeout`` seconds); returns the status."""
        end = None if timeout is None else time.time() + timeout
        while True:
            st = self.status
            if st in ("finished", "failed", "stopped") and not self.is_alive():
                self._reap()
                return self.status
            if end is not None and time.time() > end:
                return st
            time.sleep(poll)

    def _reap(self) -> None:
        if self._popen is not None:
            try:
                self._popen.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass

    # ---- stop
    def stop(self, grace: float = 10.0) -> str:
        """SIGTERM the run's process group and tree; SIGKILL what is left after ``grace`` seconds.

        Returns the final status.  Leaves no process of the run behind.
        """
        import psutil

        self._stop_requested = True
        sup = self._supervisor()
        if sup is None:
            self._reap()
            return self.status
        snapshot = [sup, *_tree(sup)]
        # Only the supervisor is signalled: it SIGTERMs torchrun, which SIGTERMs each rank once (see
        # _stop_tree), and it escalates to SIGKILL after ``grace``.  We wait for that plus a margin,
        # then kill the process group and every process seen in the tree, whatever happened.
        _signal_all([sup], signal.SIGTERM)
        psutil.wait_procs([sup], timeout=grace + 8.0)
        leftovers = [p for p in snapshot + (_tree(sup) if _alive(sup) else []) if _alive(p)]
        if leftovers:
            pgid = self.launch_info.get("pgid") or sup.pid
            try:
                os.killpg(int(pgid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            _signal_all(leftovers, signal.SIGKILL)
            psutil.wait_procs(leftovers, timeout=5)
        self._reap()
        if not self.exit_status:
            write_exit_status(self.run_dir, None, reason="stopped", status="stopped", started=self.launch_info.get("started"))
        return self.status

    # ---- failures and logs
    def rank_log(self, rank: int, stream: str = "stderr") -> Path | None:
        """This node's torchrun log file of a global rank (latest attempt), if it exists."""
        meta = self.launch_info
        nproc = int(meta.get("nproc_per_node") or (self.plan.nproc_per_node if self.plan else 1))
        local = rank - int(meta.get("node_rank") or 0) * nproc
        if not 0 <= local < nproc:
            return None
        candidates = sorted((self.run_dir / "logs" / "torchrun").glob(f"*/attempt_*/{local}/{stream}.log"),
                            key=lambda p: p.stat().st_mtime)
        return candidates[-1] if candidates else None

    def log_tail(self, rank: int | None = None, lines: int = 40, stream: str = "stderr") -> str:
        """Last lines of a rank's log, or of the launcher log (torchrun's tee of every rank) when rank is None."""
        path = self.run_dir / "logs" / "launcher.log" if rank is None else self.rank_log(rank, stream)
        if path is None or not path.exists():
            return ""
        return _tail(path, lines)

    def stacks(self, wait: float = 2.0) -> dict[int, str]:
        """Every live rank's Python stacks, for a run that seems stuck: each rank prints them to its
        stderr log on SIGUSR1 (the backend registers it) and goes on running.  {global rank: text}."""
        import psutil

        ranks = {}
        for p in self.processes():
            try:
                cmd, env = " ".join(p.cmdline()), p.environ()
                if "workbench.backend" in cmd and "RANK" in env and "torch.distributed.run" not in cmd and "torchrun" not in cmd:
                    ranks[int(env["RANK"])] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        logs = {r: self.rank_log(r, "stderr") for r in ranks}
        sizes = {r: (path.stat().st_size if path and path.exists() else 0) for r, path in logs.items()}
        _signal_all(ranks.values(), signal.SIGUSR1)
        time.sleep(wait)
        out = {}
        for r, path in sorted(logs.items()):
            if path is not None and path.exists():
                with open(path, "rb") as fh:
                    fh.seek(sizes[r])
                    out[r] = fh.read().decode("utf-8", "replace")
        return out

    @property
    def failure(self) -> Failure | None:
        """The first failing rank and its traceback: from its ``error`` event, else its stderr log."""
        errors = self.events("error")
        if errors:
            e = min(errors, key=lambda r: r.get("time", 0))
            log = self.rank_log(e["rank"]) if isinstance(e.get("rank"), int) else None
            etype = e.get("type") or e.get("exception")
            msg = e.get("message") or etype or "error"
            if etype and etype not in msg:
                msg = f"{etype}: {msg}"
            return Failure(e.get("rank"), msg, e.get("traceback") or "", "event", str(log) if log else None)
        ex = self.exit_status
        if not ex or ex.get("status") != "failed":
            return None
        rank = ex.get("failed_rank")
        if rank is not None:
            log = self.rank_log(int(rank))
            if log is not None:
                text = log.read_text(errors="replace")
                tb = _last_traceback(text) or _tail(log, 30)
                last = [ln for ln in tb.strip().splitlines() if ln.strip()]
                return Failure(int(rank), last[-1] if last else f"exit code {ex.get('returncode')}", tb, "stderr", str(log))
        tail = self.log_tail(None, 40)
        return Failure(rank, f"torchrun exited with code {ex.get('returncode')}", tail, "launcher",
                       str(self.run_dir / "logs" / "launcher.log"))

    # ---- DataFrames
    def _frame(self, kind: str, columns: Sequence[str]):
        import pandas as pd

        rows = self.events(kind)
        df = pd.DataFrame(rows)
        for c in columns:
            if c not in df.columns:
                df[c] = pd.Series(dtype="float64")
        return df

    @property
    def steps(self):
        """One row per (rank, step event): loss, lr, grad_norm, step_time, tokens_per_s, mfu, memory."""
        cols = ["rank", "iteration", "time", "loss", "lr", "grad_norm", "skipped", "step_time", "tokens_per_s",
                "tflops_per_gpu", "mfu", "mem_allocated", "mem_reserved", "mem_peak"]
        df = self._frame("step", cols)
        return df.sort_values(["iteration", "rank"]).reset_index(drop=True) if len(df) else df

    @property
    def train_loss(self):
        """Loss per iteration (mean over the ranks that hold it: the last pipeline stage)."""
        df = self.steps
        df = df[df["loss"].notna()] if len(df) else df
        return df.groupby("iteration", as_index=False)[["loss"]].mean() if len(df) else df[["iteration", "loss"]]

    @property
    def memory(self):
        """Latest memory numbers of each rank (bytes)."""
        df = self.steps
        cols = ["rank", "iteration", "mem_allocated", "mem_reserved", "mem_peak"]
        if not len(df):
            return df[cols]
        return df.sort_values("iteration").groupby("rank", as_index=False).last()[cols]

    @property
    def microbatches(self):
        """One row per measured forward/backward op: rank, iteration, kind, microbatch, chunk, start_ms, end_ms."""
        import pandas as pd

        rows = []
        for e in self.events("microbatch"):
            for op in e.get("ops") or []:
                rows.append({"rank": e.get("rank"), "iteration": e.get("iteration"), **op})
        cols = ["rank", "iteration", "kind", "microbatch", "chunk", "start_ms", "end_ms"]
        return pd.DataFrame(rows, columns=cols) if rows else pd.DataFrame(columns=cols)

    @property
    def evals(self):
        df = self._frame("eval", ["rank", "iteration", "loss", "ppl"])
        if not len(df):
            return df
        return df.groupby("iteration", as_index=False)[["loss", "ppl"]].mean()

    @property
    def errors(self):
        return self._frame("error", ["rank", "time", "message", "type", "traceback"])

    @property
    def checkpoints(self):
        return self._frame("checkpoint", ["rank", "iteration", "path", "seconds"])

    def progress(self) -> tuple[int, int, float | None]:
        """(last iteration, train iterations, ETA seconds or None)."""
        total = self.config.train.train_iters if self.config else 0
        df = self.steps
        if not len(df):
            return 0, total, None
        last = int(df["iteration"].max())
        per_it = df.groupby("iteration")["step_time"].max().dropna().tail(10)
        eta = float(per_it.mean() * max(total - last, 0)) if len(per_it) else None
        return last, total, eta

    def stalled_for(self, factor: float = 20.0, floor: float = 120.0, *, status: str | None = None) -> float | None:
        """Seconds since the last event of a running run that has trained a step, when that is
        over ``factor`` times its recent step time and over ``floor`` seconds; else None.  A hint
        that it may be stuck (a checkpoint save or a long eval can be slow too): see :meth:`stacks`.
        ``status``: the run's status if the caller has just read it (reading it refreshes the events)."""
        if (status or self.status) != "running":
            return None
        with self._lock:
            recent = sorted(e["step_time"] for e in self._records.get("step", [])[-20:] if e.get("step_time"))
            last = self._last_event_time
        if not recent:
            return None  # compiling, loading: no step time to compare with yet
        idle = time.time() - last
        return idle if idle > max(floor, factor * recent[len(recent) // 2]) else None

    def final_metrics(self) -> dict:
        """Small summary for sweeps / metrics.json: last train loss, last eval loss, throughput."""
        out: dict[str, Any] = {"run_dir": str(self.run_dir), "status": self.status}
        tl = self.train_loss
        if len(tl):
            out["iteration"] = int(tl["iteration"].iloc[-1])
            out["train_loss"] = float(tl["loss"].iloc[-1])
        ev = self.evals
        if len(ev):
            out["eval_loss"] = float(ev["loss"].iloc[-1])
            out["eval_ppl"] = float(ev["ppl"].iloc[-1]) if "ppl" in ev and ev["ppl"].notna().any() else None
        st = self.steps
        if len(st):
            tail = st[st["iteration"] > st["iteration"].min()] if st["iteration"].nunique() > 1 else st
            for c in ("tokens_per_s", "mfu", "step_time"):
                if c in tail and tail[c].notna().any():
                    out[c] = float(tail.groupby("iteration")[c].max().mean())
        return out

    # ---- notebook conveniences
    def dashboard(self, **kwargs: Any):
        """A live ipywidgets dashboard for this run (see :mod:`workbench.widgets.dashboard`)."""
        from workbench.widgets.dashboard import Dashboard

        return Dashboard(self, **kwargs)

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r})"

    def _repr_html_(self) -> str:
        import html

        it, total, eta = self.progress()
        return (f"<b>Run</b> <code>{html.escape(str(self.run_dir))}</code>: <b>{self.status}</b>, "
                f"iteration {it}/{total}" + (f", ETA {eta:.0f}s" if eta else ""))


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


def _tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 64 * 1024, 0))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _last_traceback(text: str) -> str:
    i = text.rfind("Traceback (most recent call last)")
    return text[i:].strip() if i >= 0 else ""


# --------------------------------------------------------------------------- notebook helpers


def quickstart_config(preset_name: str = "demo-small", *, tp: int = 1, pp: int = 1, steps: int | None = None,
                      nproc: int | None = None, device: str = "auto", ci: bool = False) -> tuple[RunConfig, str]:
    """The quickstart notebook's config from its parameters, fitted to this machine; returns (config, note).

    device "auto": CUDA when GPUs are visible (asked of nvidia-smi; the kernel never touches
    CUDA), else the backend's CPU mode (gloo) with the tiny preset.  ``ci``: the tiny preset
    on CPU with a few steps.  The global batch is rounded to a multiple of micro-batch x dp.
    """
    from workbench.config import preset as make_preset

    notes = []
    gpus = detect_gpus()
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError([Problem("device", f"unknown device {device!r}", "use auto, cuda or cpu")])
    device_requested = device
    if ci:
        preset_name, device = "tiny", "cpu"
        steps = min(steps or 6, 6)
        notes.append("CI mode: the tiny preset in the backend's CPU mode (gloo), a few steps")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
        if not gpus:
            notes.append("no GPU visible: running in the backend's CPU mode (gloo) with the tiny preset")
    if device == "cpu" and preset_name != "tiny":
        if gpus or device_requested == "cpu":
            notes.append(f"preset {preset_name!r} is too large for CPU emulation: using 'tiny'")
        preset_name = "tiny"
    cfg = make_preset(preset_name)
    model_parallel = max(tp, 1) * max(pp, 1)
    if nproc is None:
        nproc = model_parallel * max(gpus // model_parallel, 1) if device == "cuda" else model_parallel
    over: dict[str, Any] = {"parallel.tensor_parallel": tp, "parallel.pipeline_parallel": pp,
                            "parallel.nproc_per_node": nproc, "parallel.device": device}
    if device == "cpu" and cfg.train.precision == "fp16":
        over["train.precision"] = "fp32"
    if steps:
        over["train.train_iters"] = int(steps)
        over["train.lr_warmup_iters"] = min(cfg.train.lr_warmup_iters, max(int(steps) // 5, 0))
        if cfg.train.eval_interval > int(steps) or cfg.train.eval_interval == 0:
            over["train.eval_interval"] = max(int(steps) // 2, 1)
    cfg = cfg.replace(**over)
    dp = cfg.derived().data_parallel if nproc % model_parallel == 0 else 1
    unit = cfg.train.micro_batch_size * dp
    if cfg.train.global_batch_size % unit:
        cfg = cfg.replace(**{"train.global_batch_size": unit * max(cfg.train.global_batch_size // unit, 1)})
        notes.append(f"global batch rounded to {cfg.train.global_batch_size} (micro-batch {cfg.train.micro_batch_size} x dp {dp})")
    if cfg.data.tokenizer == "demo":
        try:
            from workbench.data.tokenizer import load_tokenizer

            vocab = load_tokenizer("demo").vocab_size
            if vocab > cfg.model.vocab_size:
                cfg = cfg.replace(**{"model.vocab_size": vocab})
                notes.append(f"model.vocab_size raised to the demo tokenizer's {vocab}")
        except Exception:
            pass
    note = f"{cfg.name}: device {device}, tp {tp} x pp {pp}, {nproc} process(es), {cfg.train.train_iters} steps"
    return cfg, "; ".join([note, *notes])


def generate_from_run(run: "Run", prompts: Sequence[str] | str, **options: Any) -> list:
    """Generate text from a finished run's latest checkpoint (``workbench.generation``), or say why not.

    Returns the generation results, or an empty list with the reason printed (generation
    module missing from this checkout, or the run saved no checkpoint).
    """
    try:
        from workbench import generation
    except ImportError:
        print("text generation is not available in this checkout (workbench.generation missing): skipped")
        return []
    cfg = run.config
    root = Path(cfg.checkpoint.save_dir) if cfg and cfg.checkpoint.save_dir else run.run_dir / "checkpoints"
    if not (root / "latest_checkpointed_iteration.txt").exists() and not list(root.glob("iter_*")):
        print(f"no checkpoint under {root} (status {run.status}): generation skipped")
        return []
    device = cfg.parallel.device if cfg else None
    return generation.generate(root, prompts, device=device, **options)


# --------------------------------------------------------------------------- papermill


@dataclass
class NotebookResult:
    out_dir: Path
    notebook: Path  # the executed .ipynb
    html: Path | None
    error: str | None = None  # papermill's error (the failing cell) or None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def _notebook_parameters(path: Path) -> dict:
    import papermill

    try:
        return papermill.inspect_notebook(str(path))
    except Exception:
        return {}


def run_notebook(notebook: str | Path, parameters: dict | None = None, out_dir: str | Path | None = None, *,
                 runs_root: str | Path | None = None, html: bool = True, progress: bool = False,
                 kernel_name: str | None = None, timeout: float | None = None) -> NotebookResult:
    """Execute a notebook through papermill into ``out_dir`` (default ``runs/<name>-<timestamp>``).

    Writes ``<out_dir>/<name>.ipynb`` (executed) and ``<out_dir>/<name>.html``.  When the
    notebook declares an ``out_dir`` parameter it receives the output directory, so it can
    put its training runs and ``metrics.json`` next to the executed notebook.
    """
    import papermill as pm

    nb = Path(notebook)
    if not nb.exists():
        raise FileNotFoundError(f"notebook {nb} not found")
    out = Path(out_dir).absolute() if out_dir else new_run_dir(nb.stem, runs_root)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(parameters or {})
    declared = _notebook_parameters(nb)
    if "out_dir" in declared and "out_dir" not in params:
        params["out_dir"] = str(out)
    executed = out / f"{nb.stem}.ipynb"
    t0 = time.time()
    error = None
    previous = os.environ.get("WORKBENCH_HEADLESS")
    os.environ["WORKBENCH_HEADLESS"] = "1"  # inherited by the kernel: watch() renders static plots
    try:
        pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=kernel_name,
                            progress_bar=progress, log_output=False, execution_timeout=timeout,
                            cwd=os.getcwd())
    except pm.PapermillExecutionError as e:
        error = f"cell {e.exec_count}: {e.ename}: {e.evalue}"
    finally:
        if previous is None:
            os.environ.pop("WORKBENCH_HEADLESS", None)
        else:
            os.environ["WORKBENCH_HEADLESS"] = previous
    html_path = None
    if html and executed.exists():
        html_path = _export_html(executed)
    return NotebookResult(out, executed, html_path, error, time.time() - t0)


def _export_html(executed: Path) -> Path | None:
    try:
        import nbformat
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(executed), as_version=4))
        path = executed.with_suffix(".html")
        path.write_text(body, encoding="utf-8")
        return path
    except Exception as e:  # the executed notebook is the primary artefact; HTML is a convenience
        print(f"warning: HTML export of {executed} failed: {e}", file=sys.stderr)
        return None


def record_metrics(metrics: dict, out_dir: str | Path | None) -> Path | None:
    """Write a notebook's final metrics to ``<out_dir>/metrics.json`` (what ``workbench sweep`` collects)."""
    if not out_dir:
        return None
    path = Path(out_dir) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(path, {k: v for k, v in metrics.items()})
    return path


def _parse_value(text: str) -> Any:
    """A CLI value as Python: int, float (``1e-3`` too, which YAML 1.1 leaves a string), YAML scalar, else text."""
    import yaml

    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except Exception:
        return text


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """``["steps=5,10", "lr=1e-3"]`` -> ``{"steps": [5, 10], "lr": [0.001]}`` (values parsed as YAML scalars)."""
    grid: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--grid {item!r}: expected NAME=V1,V2,...")
        name, values = item.split("=", 1)
        name = name.strip()
        if not name.isidentifier():
            raise ValueError(f"--grid {item!r}: {name!r} is not a parameter name")
        vals = [_parse_value(v.strip()) for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--grid {item!r}: no values")
        grid[name] = vals
    return grid


def sweep(notebook: str | Path, grid: dict[str, list], out_dir: str | Path, *, parameters: dict | None = None,
          html: bool = False, progress: bool = True):
    """Run ``notebook`` once per grid point into ``out_dir/<i>-k=v...``; collect metrics into ``out_dir/sweep.csv``.

    Each point's metrics come from the ``metrics.json`` the notebook wrote into its ``out_dir``
    (see :func:`record_metrics`).  Returns the table as a pandas DataFrame.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    names = list(grid)
    points = [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]
    rows = []
    for i, point in enumerate(tqdm(points, desc="sweep", disable=not progress)):
        label = "-".join(f"{k}={v}" for k, v in point.items())
        sub = out / re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{i:03d}-{label}")
        res = run_notebook(notebook, {**(parameters or {}), **point}, sub, html=html)
        metrics = _read_json(sub / "metrics.json") or {}
        rows.append({**(parameters or {}), **point, "ok": res.ok, "error": res.error, **metrics, "notebook": str(res.notebook)})
    df = pd.DataFrame(rows)
    df.to_csv(out / "sweep.csv", index=False)
    return df


# --------------------------------------------------------------------------- CLI


def _load_for_cli(path: str) -> RunConfig:
    cfg = load_config(path)
    return cfg


def _cmd_launch(args: argparse.Namespace) -> int:
    try:
        cfg = _load_for_cli(args.file)
        overrides = {}
        if args.nproc_per_node is not None:
            overrides["parallel.nproc_per_node"] = args.nproc_per_node
        if args.nnodes is not None:
            overrides["parallel.nnodes"] = args.nnodes
        if overrides:
            cfg = cfg.replace(**overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    local = not (args.dry_run or args.slurm)
    problems = launch_problems(cfg, local=local)
    if cfg.parallel.nnodes > 1 and not args.rdzv_endpoint and not args.slurm:
        problems.append(Problem("--rdzv-endpoint", f"{cfg.parallel.nnodes} nodes need a rendezvous endpoint", "pass --rdzv-endpoint HOST:PORT of node 0, or use --slurm"))
    if problems:
        print(ConfigError(problems, args.file), file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).absolute() if args.run_dir else new_run_dir(cfg.name, args.run_root)
    plan = LaunchPlan(run_dir, cfg.parallel.nproc_per_node, cfg.parallel.nnodes, args.node_rank, args.rdzv_endpoint,
                      args.rdzv_id or f"workbench-{cfg.name}")
    if args.dry_run:
        print(f"# run directory: {run_dir}")
        print(f"# config (written to {plan.config_path} at launch): {args.file}")
        if args.slurm:
            print(f"# SLURM batch script ({run_dir / 'slurm.sbatch'}):")
            print(plan.slurm_script(gpus=cfg.parallel.device == "cuda"), end="")
        else:
            print(plan.shell())
        return 0
    if args.slurm:
        if run_dir.exists() and any(run_dir.iterdir()):
            print(f"error: run_dir {run_dir} exists and is not empty -> pass a new --run-dir", file=sys.stderr)
            return 2
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cfg.save(plan.config_path)
        script = run_dir / "slurm.sbatch"
        script.write_text(plan.slurm_script(gpus=cfg.parallel.device == "cuda"))
        print(f"wrote {script}")
        sbatch = shutil.which("sbatch")
        if not sbatch:
            print(f"sbatch not found on this machine; submit with: sbatch {script}")
            return 0
        return subprocess.call([sbatch, str(script)])
    try:
        run = Run.launch(cfg, run_dir, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=args.rdzv_id, watch_parent=not args.detach)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"run directory: {run.run_dir}")
    print(f"command: {run.plan.shell()}")
    if args.detach:
        print(f"detached; follow it in a notebook with: Run.attach({str(run.run_dir)!r}).dashboard()")
        print(f"stop it with: Run.attach({str(run.run_dir)!r}).stop()")
        return 0
    return _follow_cli(run)


def _follow_cli(run: Run) -> int:
    seen = 0
    try:
        while True:
            st = run.status
            df = run.train_loss
            if len(df) > seen:
                for _, row in df.iloc[seen:].iterrows():
                    print(f"iteration {int(row['iteration'])}: loss {row['loss']:.4f}", flush=True)
                seen = len(df)
            if st in ("finished", "failed", "stopped") and not run.is_alive():
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("interrupted: stopping the run", file=sys.stderr)
        run.stop()
    st = run.wait(timeout=30)
    f = run.failure
    if f is not None:
        print(str(f), file=sys.stderr)
    print(f"run {st}: {run.run_dir}")
    return 0 if st == "finished" else 1


def _cmd_notebook_run(args: argparse.Namespace) -> int:
    params = {name: _parse_value(value) for name, value in (args.parameters or [])}
    nb = Path(args.notebook)
    if not nb.exists():
        print(f"error: notebook {nb} not found -> pass a path such as notebooks/01_quickstart.ipynb", file=sys.stderr)
        return 2
    declared = _notebook_parameters(nb)
    unknown = [p for p in params if declared and p not in declared]
    if unknown:
        print(f"error: {nb} has no parameter(s) {', '.join(unknown)} -> known: {', '.join(sorted(declared))}", file=sys.stderr)
        return 2
    res = run_notebook(nb, params, args.out, runs_root=args.run_root, progress=not args.quiet, timeout=args.timeout)
    print(f"executed notebook: {res.notebook}")
    if res.html:
        print(f"HTML export:       {res.html}")
    print(f"output directory:  {res.out_dir}  ({res.seconds:.0f}s)")
    if res.error:
        print(f"error: the notebook failed at {res.error}; see the executed notebook above", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    try:
        grid = parse_grid(args.grid)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nb = Path(args.notebook)
    if not nb.exists():
        print(f"error: notebook {nb} not found", file=sys.stderr)
        return 2
    declared = _notebook_parameters(nb)
    params = {name: _parse_value(value) for name, value in (args.parameters or [])}
    unknown = [p for p in list(grid) + list(params) if declared and p not in declared]
    if unknown:
        print(f"error: {nb} has no parameter(s) {', '.join(unknown)} -> known: {', '.join(sorted(declared))}", file=sys.stderr)
        return 2
    df = sweep(nb, grid, args.out, parameters=params, html=args.html)
    print(df.drop(columns=["notebook"], errors="ignore").to_string(index=False))
    print(f"wrote {Path(args.out).absolute() / 'sweep.csv'}")
    return 0 if bool(df["ok"].all()) else 1


def add_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``launch``, ``sweep`` and ``notebook run``."""
    p = sub.add_parser("launch", help="launch a training run (torchrun) from a config file")
    p.add_argument("file", help="run config (JSON or YAML)")
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: the config's parallel.nproc_per_node)")
    p.add_argument("--nnodes", type=int, help="number of nodes (default: the config's parallel.nnodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (multi-node, static rendezvous)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 (multi-node)")
    p.add_argument("--rdzv-id", help="rendezvous id, identical on every node (default: workbench-<config name>)")
    p.add_argument("--run-dir", help="run directory (default: a fresh runs/<name>-<timestamp>)")
    p.add_argument("--run-root", help="parent of fresh run directories (default: runs/ or $WORKBENCH_RUNS)")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands, start nothing")
    p.add_argument("--slurm", action="store_true", help="write a SLURM batch script (srun torchrun ...) and submit it if sbatch exists")
    p.add_argument("--detach", action="store_true", help="return at once; the run keeps going")
    p.set_defaults(func=_cmd_launch)

    s = sub.add_parser("sweep", help="run a notebook over a parameter grid; collect final metrics into a CSV")
    s.add_argument("notebook")
    s.add_argument("--grid", action="append", required=True, metavar="NAME=V1,V2", help="repeatable; the grid is the product")
    s.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", metavar=("NAME", "VALUE"), help="fixed parameter")
    s.add_argument("--out", required=True, help="output directory (one subdirectory per point + sweep.csv)")
    s.add_argument("--html", action="store_true", help="also export each executed notebook to HTML")
    s.set_defaults(func=_cmd_sweep)

    n = sub.add_parser("notebook", help="run notebooks headless (papermill)")
    nsub = n.add_subparsers(dest="notebook_cmd", required=True)
    r = nsub.add_parser("run", help="execute a notebook into runs/<name>-<timestamp>/ (executed .ipynb + HTML)")
    r.add_argument("notebook")
    r.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="papermill parameter (value parsed as YAML: 2, true, 3e-4, text)")
    r.add_argument("--out", help="output directory (default: runs/<name>-<timestamp>)")
    r.add_argument("--run-root", help="parent of the default output directory")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--timeout", type=float, default=None, help="seconds a single cell may run before the notebook fails (default: no limit)")
    r.set_defaults(func=_cmd_notebook_run)


# --------------------------------------------------------------------------- process entry


def _main(argv: list[str] | None = None) -> int:
    """``python -m workbench.bridge supervise|exit-status ...`` (internal entry points)."""
    ap = argparse.ArgumentParser(prog="python -m workbench.bridge")
    sp = ap.add_subparsers(dest="cmd", required=True)
    s = sp.add_parser("supervise")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--watch-pid", type=int, default=0)
    s.add_argument("--grace", type=float, default=10.0)
    s.add_argument("--error-grace", type=float, default=10.0)
    s.add_argument("command", nargs=argparse.REMAINDER)
    e = sp.add_parser("exit-status")
    e.add_argument("--run-dir", required=True)
    e.add_argument("--returncode", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "supervise":
        cmd = list(a.command)
        if cmd and cmd[0] == "--":
            cmd = cmd[1:]
        return _supervise(Path(a.run_dir), cmd, a.watch_pid, a.grace, a.error_grace)
    info = write_exit_status(a.run_dir, a.returncode)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
