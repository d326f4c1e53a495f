"""The notebook-side handle of one training run: :class:`Run`.

:meth:`Run.launch` starts a run through the one launch path (:func:`workbench.launch.start.start_run`:
checks, run directory, supervisor); :meth:`Run.attach` re-opens a run directory, finished or
still running.  A ``Run`` follows the event stream through its :class:`workbench.run.RunReader`
(incremental, partial lines tolerated), exposes the records as pandas DataFrames and a status,
surfaces a failing rank with its traceback, prints a stuck run's stacks, and stops the run:
SIGTERM to the supervisor, which SIGTERMs torchrun, which SIGTERMs each rank once (the backend
finishes its step and saves); SIGKILL for anything left after the grace period, and this side
kills the process group and every process it saw if even that fails
(:mod:`workbench.launch.node_processes`).

A multi-node run (one ``workbench launch --node-rank K`` per node, one run directory they all
share: :mod:`workbench.run.nodes`) is followed as one job from any node: the events of every
rank, each node's state (:meth:`Run.nodes`), one status, and the failure that started it
(a rank's error, a rank that died without one, or a node that went silent), with its node
(:mod:`workbench.launch.failure`).  The DataFrames come from :mod:`workbench.launch.frames`.

The live dashboard is :class:`workbench.widgets.dashboard.Dashboard` (``Dashboard(run)``), or
:func:`workbench.notebook.dashboard`.  No megatron-core here; pandas and psutil load lazily.
"""

from __future__ import annotations

import atexit
import re
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

from workbench.config import ConfigError, RunConfig, load_config
from workbench.launch import frames
from workbench.launch.exit_status import STATUSES, lost_peer, write_exit_status
from workbench.launch.failure import Failure, diagnose, tail
from workbench.launch.nodes import DEFAULT_NODE_TIMEOUT, HeartbeatClock, read_heartbeat
from workbench.launch.node_processes import NodeProcesses
from workbench.launch.ownership import Refusal
from workbench.launch.plan import BACKEND_ENTRY, LaunchPlan, apply_overrides
from workbench.launch.processes import collect_stacks, rank_processes
from workbench.launch.processes import rank_log as local_rank_log
from workbench.launch.slurm import JobWatch
from workbench.launch.start import start_run
from workbench.run.events import Event
from workbench.run.nodes import host_name, node_dir, node_of_rank, node_ranks
from workbench.run.reader import RunReader

__all__ = ["Run"]


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

    def __init__(self, run_dir: str | Path, *, popen: subprocess.Popen | None = None, plan: LaunchPlan | None = None,
                 node_rank: int | None = None):
        self.run_dir = Path(run_dir).absolute()
        self.plan = plan
        #: the node this handle launched or attached to (its launch files); every node's events are followed
        self.node_rank = int(node_rank if node_rank is not None else (plan.node_rank if plan is not None else 0))
        self.node_dir = node_dir(self.run_dir, self.node_rank)
        self._beats = HeartbeatClock(trust_clock=True)
        self._popen = popen
        self._owned = popen is not None
        self.reader = RunReader(self.run_dir)  # the run directory's one reader: events, launch.json, exit status
        self._lock = threading.RLock()
        self._stop_requested = False
        self._slurm = JobWatch(self.run_dir)
        self._procs = NodeProcesses(self.run_dir, self.node_rank, self.reader, popen)
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
        node_timeout: float | None = None,
        stall_floor: float | None = None,
        startup_timeout: float | None = None,
        ignore_memory_plan: bool = False,
    ) -> "Run":
        """Validate, create a fresh run dir (config.json saved), start torchrun under a supervisor.

        ``nproc_per_node`` / ``nnodes`` default to the config's ``parallel`` section; when given
        they are written into the saved config so the backend sees the same world size.  One node
        of a multi-node run: ``node_rank``, ``rdzv_endpoint`` and the ``run_dir`` every node shares;
        ``node_timeout``: seconds another node may go silent before this node stops its job.
        ``stall_floor`` (default 300 s; 0: off) / ``startup_timeout`` (default: derived from the config's size, :func:`workbench.launch.stall.startup_limit`): a rank that
        makes no progress for longer than the bound they set ends the run as ``failed`` (reason
        ``stalled``, naming the rank; its stacks in ``stall_stacks.txt``): :mod:`workbench.launch.stall`.
        Raises :class:`ConfigError` (nothing started) when the config or this machine cannot run it: a memory plan
        over the GPUs' memory too, unless ``ignore_memory_plan``; a ``checkpoint.save_dir`` another live run saves into.
        """
        cfg = apply_overrides(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes)
        plan, popen = start_run(cfg, run_dir, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                                run_root=run_root, entry=entry, env=env, grace=grace, error_grace=error_grace,
                                watch_parent=watch_parent, check_devices=check_devices, node_timeout=node_timeout,
                                stall_floor=stall_floor, startup_timeout=startup_timeout,
                                ignore_memory_plan=ignore_memory_plan)
        return cls(plan.run_dir, popen=popen, plan=plan)

    @classmethod
    def attach(cls, run_dir: str | Path, node_rank: int = 0) -> "Run":
        """Re-open an existing run directory (finished or still running); a multi-node run from
        any node (``node_rank``: whose launch files this handle holds; every node is followed)."""
        run_dir = Path(run_dir).absolute()
        if not (run_dir / "config.json").exists() and not (run_dir / "events").is_dir():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json or events/); pass the directory Run.launch created")
        meta = RunReader(run_dir).launch_info(node_rank)
        plan = None
        if meta.get("command"):
            plan = LaunchPlan(run_dir, int(meta.get("nproc_per_node") or 1), int(meta.get("nnodes") or 1),
                              int(meta.get("node_rank") or 0), meta.get("rdzv_endpoint"))
        run = cls(run_dir, plan=plan, node_rank=node_rank)
        return run

    # ---- process state
    @property
    def launch_info(self) -> dict:
        """This node's ``launch.json``."""
        return self.reader.launch_info(self.node_rank)

    @property
    def exit_status(self) -> dict | None:
        """This node's ``exit_status.json`` (a multi-node run's other nodes: :meth:`nodes`)."""
        return self.reader.exit_status(self.node_rank)

    @property
    def nnodes(self) -> int:
        if self.config is not None:
            return max(int(self.config.parallel.nnodes), 1)
        return max(int(self.launch_info.get("nnodes") or 1), 1)

    def _per_node(self) -> bool:
        """A multi-node run launched node by node (``workbench launch --node-rank``): launch files per node."""
        return self.nnodes > 1 and any(self.reader.launch_info(k) for k in range(self.nnodes))

    def _nproc(self) -> int:
        meta = self.launch_info
        if meta.get("nproc_per_node"):
            return int(meta["nproc_per_node"])
        if self.plan is not None:
            return self.plan.nproc_per_node
        return int(self.config.parallel.nproc_per_node) if self.config is not None else 1

    @property
    def refusals(self) -> list[Refusal]:
        """Processes ``launch.json`` names and SLURM jobs ``slurm.json`` names that are not this run's (never signalled
        or cancelled), each with why."""
        return self._procs.refusals + self._slurm.refusals

    def nodes(self) -> list[dict]:
        """Every node of the run: ``{node, host, ranks, status, alive, local, why, exit_status, heartbeat_age}``.

        ``status``: its exit status's (finished / failed / stopped), else ``running`` while it is
        alive (its processes, on this machine; its heartbeat, on another), ``lost`` when it was
        launched and went away without an exit status, ``not started``.  One-node runs: one entry.
        """
        me = host_name()
        nproc = self._nproc()
        first_error: dict = {}
        for e in self.reader.records("error", refresh=False):
            first_error.setdefault(e.rank, e)
        out = []
        for k in (range(self.nnodes) if self._per_node() else [self.node_rank]):
            meta, ex = self.reader.launch_info(k), self.reader.exit_status(k)
            beat = read_heartbeat(node_dir(self.run_dir, k))
            age = self._beats.age(k, beat)
            host = meta.get("host") or (beat or {}).get("host")
            local = host == me
            if k == self.node_rank and (local or self._popen is not None):
                alive = self._procs.alive()
            elif local:
                alive = bool(self._procs.of_node(meta))
            else:
                alive = ex is None and age is not None and age <= float(meta.get("node_timeout") or DEFAULT_NODE_TIMEOUT)
            why = None
            if ex:
                status = ex.get("status")
                peer = ex.get("peer") or {}
                if peer.get("why"):
                    why = peer["why"]
                elif status == "failed" and ex.get("failed_rank") is not None:
                    r, e = ex["failed_rank"], first_error.get(ex["failed_rank"])
                    if e is not None and lost_peer(e.get("message"), e.get("exception") or e.get("type")):
                        msg = re.sub(r"^\[[^\]]*\]\s*", "", e.get("message") or "").split(". ")[0]
                        why = f"rank {r} lost its peers: {msg[:120]}"
                    else:
                        why = f"rank {r} failed" + (f" (exit code {ex['failed_exitcode']})" if ex.get("failed_exitcode") is not None else "")
            elif alive:
                status = "running"
            elif meta or beat:
                status = "lost"
                why = ("its processes are gone and it wrote no exit status" if local or age is None
                       else f"no heartbeat for {age:.0f} s and no exit status")
            else:
                status = "not started"
            out.append({"node": k, "host": host, "ranks": node_ranks(k, int(meta.get("nproc_per_node") or nproc)),
                        "status": status, "alive": alive, "local": local, "why": why, "exit_status": ex,
                        "heartbeat_age": age})
        return out

    def is_alive(self) -> bool:
        """True while the run's supervisor, or any process ``launch.json`` records for it, is running;
        a run submitted to SLURM: while ``squeue`` lists its job; a multi-node run: while any node
        runs (see :meth:`nodes`)."""
        if self._procs.alive():
            return True
        if self._slurm.state():  # a SLURM job in the queue: pending, running, completing
            return True
        return self._per_node() and any(n["alive"] for n in self.nodes())

    def processes(self) -> list:
        """psutil.Process objects of the run that are alive now (supervisor, torchrun, ranks), of
        every node of a multi-node run that runs on this machine."""
        found = self._procs.processes()
        if self._per_node():
            me = host_name()
            for k in range(self.nnodes):
                meta = self.reader.launch_info(k)
                if k != self.node_rank and meta.get("host") == me:
                    pids = {p.pid for p in found}
                    found += [p for p in self._procs.of_node(meta) if p.pid not in pids]
        return found

    # ---- events
    def refresh(self) -> int:
        """Read events written since the last call; returns how many arrived."""
        return self.reader.refresh()

    def events(self, kind: str | None = None) -> list[Event]:
        """The typed records read so far (of ``kind``), after reading what is new."""
        return self.reader.records(kind)

    @property
    def event_count(self) -> int:
        """How many records have been read (without reading more)."""
        return self.reader.count

    @property
    def status(self) -> str:
        """starting / running / finished / failed / stopped, from events, exit_status.json and the processes
        (a multi-node run: of the whole job, from every node's files)."""
        self.refresh()
        if self._per_node():
            return self._job_status()
        ex = self.exit_status
        if ex and ex.get("status") in STATUSES:
            return ex["status"]
        errors = self.reader.has("error", refresh=False)
        ends = self.reader.records("run_end", refresh=False)
        begun = self.reader.has("run_start", refresh=False) or self.reader.has("step", refresh=False)
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
        if self._popen is None and not self.launch_info and self._slurm.state() is None:
            return "running" if begun else "starting"  # events only (e.g. SLURM, no squeue here): cannot tell
        return "failed"

    def _job_status(self) -> str:
        """A multi-node run's status: failed when any node failed or was lost; finished / stopped when all ended.

        Nodes that never wrote into this directory are left out (not started yet: the rendezvous
        waits for them; or launched with run directories of their own, without a shared filesystem)."""
        views = [v for v in self.nodes() if v["status"] != "not started"]
        states = [v["status"] for v in views]
        if any(st in ("failed", "lost") for st in states):
            return "failed"
        if states and all(st in ("finished", "stopped") for st in states):
            return "stopped" if "stopped" in states else "finished"
        if self.reader.has("error", refresh=False):
            return "failed"  # being torn down; the supervisors finish the job
        if self._stop_requested and not any(v["alive"] for v in views):
            return "stopped"
        begun = self.reader.has("run_start", refresh=False) or self.reader.has("step", refresh=False)
        return "running" if begun else "starting"

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
        self._procs.reap()

    # ---- stop
    def stop(self, grace: float = 10.0) -> str:
        """SIGTERM the run's process group and tree; SIGKILL what is left after ``grace`` seconds.

        Returns the final status.  Leaves no process of the run behind.  A multi-node run: this
        node and every other node of the run on this machine; nodes on other machines stop with
        it (their ranks agree on the step to stop at, their supervisors see this node's exit status).
        """
        self._stop_requested = True
        if self._procs.supervisor() is None and self._slurm.job is not None:
            return self._stop_slurm(grace)
        self._procs.stop(grace)
        if self._per_node():
            for v in self.nodes():
                if v["node"] != self.node_rank and v["local"] and v["alive"]:
                    NodeProcesses(self.run_dir, v["node"], RunReader(self.run_dir)).stop(grace)
        return self.status

    # ---- SLURM (workbench.launch.slurm)
    def _stop_slurm(self, grace: float) -> str:
        """``scancel`` the job and wait until it has left the queue (:meth:`JobWatch.cancel`: only a job SLURM reports
        as running this run directory's ``slurm.sbatch``; a job ``slurm.json`` names that is not is refused, said)."""
        if self._slurm.cancel(grace) and not self.exit_status and self._slurm.state(max_age=0.0) == "":
            # cancelled before its script could record it
            write_exit_status(self.run_dir, None, reason="stopped", status="stopped")
        return self.status

    # ---- failures and logs
    def rank_log(self, rank: int, stream: str = "stderr") -> Path | None:
        """The torchrun log file of a global rank (latest attempt), if it exists: this node's, or in a
        multi-node run the log its node keeps in the shared run directory."""
        meta = self.launch_info
        nproc = self._nproc()
        base = self.node_dir
        if self._per_node():
            node = node_of_rank(rank, nproc)
            base = node_dir(self.run_dir, node)
            local = rank - node * nproc
        else:
            local = rank - int(meta.get("node_rank") or 0) * nproc
        if not 0 <= local < nproc:
            return None
        return local_rank_log(base, local, stream)

    def log_tail(self, rank: int | None = None, lines: int = 40, stream: str = "stderr") -> str:
        """Last lines of a rank's log, or of the launcher log (torchrun's tee of every rank) when rank is None."""
        path = self.node_dir / "logs" / "launcher.log" if rank is None else self.rank_log(rank, stream)
        if path is None or not path.exists():
            return ""
        return tail(path, lines)

    def stacks(self, wait: float = 2.0) -> dict[int, str]:
        """Every live rank's Python stacks, for a run that seems stuck: each rank prints them to its
        stderr log on SIGUSR1 (the backend registers it) and goes on running; a stopped rank (SIGSTOP)
        cannot, and its entry says so.  {global rank: text}.  Once no rank is alive: the last stacks
        gathered, those the stall watch wrote into ``stall_stacks.txt`` before ending the run ({} if none)."""
        ranks = rank_processes(self.processes())
        if not ranks:
            return self._stall_stacks()
        return collect_stacks(ranks, {r: self.rank_log(r, "stderr") for r in ranks}, wait)

    def _stall_stacks(self) -> dict[int, str]:
        """``stall_stacks.txt`` of every node (:func:`workbench.launch.supervisor.end_stalled`) read back by rank."""
        out: dict[int, str] = {}
        for k in range(max(self.nnodes, 1)):
            try:
                text = (node_dir(self.run_dir, k) / "stall_stacks.txt").read_text(errors="replace")
            except OSError:
                continue
            for part in re.split(r"^=== rank (?=\d+ \(pid \d+\)$)", text, flags=re.M)[1:]:
                head, _, body = part.partition("\n")
                out[int(head.split()[0])] = body.rstrip("\n") + "\n"
        return out

    @property
    def failure(self) -> Failure | None:
        """The rank that caused the failure and its traceback: from its ``error`` event, else its stderr log.

        Once the job has ended, the rank its exit status names (:mod:`workbench.launch.exit_status`: a rank
        that died by a signal or an exit code of its own comes before the first that raised); while it is
        being torn down, the first rank that raised.  An error that only says a peer went away (gloo's
        "connection reset by peer" on the survivors) is passed over for a rank's own error.  A multi-node
        run: the failure that started it, with its node (a rank's death, its own error, or a lost node).
        """
        errors = self.events("error")
        return diagnose(errors, self.exit_status, rank_log=self.rank_log, launcher_log=self.node_dir / "logs" / "launcher.log",
                        node_of=self._node_of, node_views=self.nodes if self._per_node() else None)

    def _node_of(self, rank) -> int | None:
        return node_of_rank(rank, self._nproc()) if self._per_node() and isinstance(rank, int) else None

    # ---- DataFrames (workbench.launch.frames)
    @property
    def steps(self):
        """One row per (rank, step event): loss, lr, grad_norm, step_time, tokens_per_s, mfu, memory."""
        return frames.steps(self.events("step"))

    @property
    def train_loss(self):
        """Loss per iteration (mean over the ranks that hold it: the last pipeline stage)."""
        return frames.train_loss(self.steps)

    @property
    def memory(self):
        """Latest memory numbers of each rank (bytes)."""
        return frames.memory(self.steps)

    @property
    def microbatches(self):
        """One row per measured forward/backward op: rank, iteration, kind, microbatch, chunk, start_ms, end_ms."""
        return frames.microbatches(self.events("microbatch"))

    @property
    def evals(self):
        return frames.evals(self.events("eval"))

    @property
    def errors(self):
        return frames.frame(self.events("error"), frames.ERROR_COLUMNS)

    @property
    def checkpoints(self):
        return frames.frame(self.events("checkpoint"), frames.CHECKPOINT_COLUMNS)

    def progress(self) -> tuple[int, int, float | None]:
        """(last iteration, train iterations, ETA seconds or None)."""
        return frames.progress(self.steps, self.config.train.train_iters if self.config else 0)

    def stalled_for(self, factor: float = 20.0, floor: float = 120.0, *, status: str | None = None) -> float | None:
        """Seconds since the last event of a running run that has trained a step, when that is
        over ``factor`` times its recent step time and over ``floor`` seconds; else None.  A hint
        that it may be stuck (a checkpoint save or a long eval can be slow too): see :meth:`stacks`.
        ``status``: the run's status if the caller has just read it (reading it refreshes the events)."""
        if (status or self.status) != "running":
            return None
        recent = sorted(e.step_time for e in self.reader.records("step", refresh=False)[-20:] if e.step_time)
        last = self.reader.last_event_time
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
            out.update(frames.throughput(st))
        return out

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r})"

    def _repr_html_(self) -> str:
        import html

        it, total, eta = self.progress()
        return (f"<b>Run</b> <code>{html.escape(str(self.run_dir))}</code>: <b>{self.status}</b>, "
                f"iteration {it}/{total}" + (f", ETA {eta:.0f}s" if eta else ""))
