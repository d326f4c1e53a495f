"""The notebook-side handle of one training run: :class:`Run`.

:meth:`Run.launch` starts a run through the one launch path (:func:`workbench.launch.start_run`:
checks, run directory, supervisor); :meth:`Run.attach` re-opens a run directory, finished or
still running.  A ``Run`` follows the event stream through its :class:`workbench.run.RunReader`
(incremental, partial lines tolerated), exposes the records as pandas DataFrames and a status,
surfaces a failing rank with its traceback, prints a stuck run's stacks, and stops the run:
SIGTERM to the supervisor, which SIGTERMs torchrun, which SIGTERMs each rank once (the backend
finishes its step and saves); SIGKILL for anything left after the grace period, and this side
kills the process group and every process it saw if even that fails.

The live dashboard is :class:`workbench.widgets.dashboard.Dashboard` (``Dashboard(run)``), or
:func:`workbench.notebook.dashboard`.  No megatron-core here; pandas and psutil load lazily.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from workbench import slurm
from workbench.config import ConfigError, RunConfig, load_config
from workbench.launch import (
    BACKEND_ENTRY, STATUSES, LaunchPlan, _alive, _proc, _signal_all, _tree, apply_overrides, start_run, write_exit_status,
)
from workbench.run.events import Event
from workbench.run.procs import live_recorded
from workbench.run.reader import RunReader

__all__ = ["Run", "Failure"]


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
        self.reader = RunReader(self.run_dir)  # the run directory's one reader: events, launch.json, exit status
        self._lock = threading.RLock()
        self._stop_requested = False
        self._slurm_seen: tuple[float, str | None] | None = None  # (when, squeue's state)
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
        cfg = apply_overrides(cfg, nproc_per_node=nproc_per_node, nnodes=nnodes)
        plan, popen = start_run(cfg, run_dir, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                                run_root=run_root, entry=entry, env=env, grace=grace, error_grace=error_grace,
                                watch_parent=watch_parent, check_devices=check_devices)
        return cls(plan.run_dir, popen=popen, plan=plan)

    @classmethod
    def attach(cls, run_dir: str | Path) -> "Run":
        """Re-open an existing run directory (finished or still running)."""
        run_dir = Path(run_dir).absolute()
        if not (run_dir / "config.json").exists() and not (run_dir / "events").is_dir():
            raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json or events/); pass the directory Run.launch created")
        meta = RunReader(run_dir).launch_info()
        plan = None
        if meta.get("command"):
            plan = LaunchPlan(run_dir, int(meta.get("nproc_per_node") or 1), int(meta.get("nnodes") or 1),
                              int(meta.get("node_rank") or 0), meta.get("rdzv_endpoint"))
        run = cls(run_dir, plan=plan)
        return run

    # ---- process state
    @property
    def launch_info(self) -> dict:
        return self.reader.launch_info()

    @property
    def exit_status(self) -> dict | None:
        return self.reader.exit_status()

    def _supervisor(self):
        if self._popen is not None:
            if self._popen.poll() is not None:
                return None
            return _proc(self._popen.pid)
        meta = self.launch_info
        pid = meta.get("supervisor_pid")
        return _proc(int(pid), meta.get("supervisor_create_time")) if pid else None

    def _recorded(self) -> list:
        """Live processes that ``launch.json`` records for this run (torchrun, ranks; create times checked)."""
        if self._popen is not None and self._popen.poll() is None:
            return []  # our own supervisor is running: its tree is the truth
        return live_recorded(self.launch_info)

    def is_alive(self) -> bool:
        """True while the run's supervisor, or any process ``launch.json`` records for it, is running;
        a run submitted to SLURM: while ``squeue`` lists its job."""
        return self._supervisor() is not None or bool(self._recorded()) or bool(self._slurm_state())

    def processes(self) -> list:
        """psutil.Process objects of the run that are alive now (supervisor, torchrun, ranks)."""
        sup = self._supervisor()
        found = [sup, *_tree(sup)] if sup is not None else []
        pids = {p.pid for p in found}
        return found + [p for p in self._recorded() if p.pid not in pids]

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
        """starting / running / finished / failed / stopped, from events, exit_status.json and the processes."""
        self.refresh()
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
        if self._popen is None and not self.launch_info and self._slurm_state() is None:
            return "running" if begun else "starting"  # events only (e.g. SLURM, no squeue here): cannot tell
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
        if self._supervisor() is None and self._slurm_job() is not None:
            return self._stop_slurm(grace)
        sup = self._supervisor()
        if sup is None:
            orphans = self._recorded()  # the supervisor is gone (killed) but processes of the run live on
            if orphans:
                self._stop_orphans(orphans, grace)
            self._reap()
            if orphans and not self.exit_status:
                write_exit_status(self.run_dir, None, reason="stopped", status="stopped", started=self.launch_info.get("started"))
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
        orphans = live_recorded(self.launch_info)  # anything the supervisor recorded and did not take down
        if orphans:
            self._stop_orphans(orphans, 0.0)
        self._reap()
        if not self.exit_status:
            write_exit_status(self.run_dir, None, reason="stopped", status="stopped", started=self.launch_info.get("started"))
        return self.status

    @staticmethod
    def _stop_orphans(procs: list, grace: float) -> None:
        """Stop processes of a run whose supervisor is gone: SIGTERM torchrun (it forwards one SIGTERM
        to each rank) or, without it, the ranks; SIGKILL whatever is left after ``grace``."""
        import psutil

        torchrun = [p for p in procs if (getattr(p, "info", None) or {}).get("role") == "torchrun"]
        _signal_all(torchrun or procs, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=max(grace, 0.0))
        alive = [p for p in alive if _alive(p)]
        if alive:
            _signal_all(alive, signal.SIGKILL)
            psutil.wait_procs(alive, timeout=5)

    # ---- SLURM (workbench.slurm)
    def _slurm_job(self) -> str | None:
        """The SLURM job id of a run submitted with ``workbench launch --slurm`` (``slurm.json``), else None."""
        rec = slurm.job_record(self.run_dir)
        return str(rec["job_id"]) if rec else None

    def _slurm_state(self, max_age: float = 2.0) -> str | None:
        """The run's SLURM job state (``""``: it has left the queue); None: not a SLURM run, or squeue
        cannot tell.  squeue is asked at most every ``max_age`` seconds (the dashboard polls the status)."""
        job = self._slurm_job()
        if job is None:
            return None
        seen = self._slurm_seen
        if seen is None or time.time() - seen[0] > max_age:
            seen = self._slurm_seen = (time.time(), slurm.job_state(job))
        return seen[1]

    def _stop_slurm(self, grace: float) -> str:
        """``scancel`` the job and wait (``grace`` + 120 s at most) until it has left the queue: SLURM sends
        SIGTERM to every process of the job (the ranks stop at a step boundary, the batch script records
        ``stopped``) and SIGKILL to what is left after its KillWait."""
        slurm.cancel(self._slurm_job())
        end = time.time() + grace + 120.0
        while self._slurm_state(max_age=0.0) and time.time() < end:
            time.sleep(0.5)
        if not self.exit_status and self._slurm_state(max_age=0.0) == "":  # cancelled before its script could record it
            write_exit_status(self.run_dir, None, reason="stopped", status="stopped")
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

        rows = [r.to_dict() for r in self.events(kind)]
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
            out.update(_throughput(st))
        return out

    def __repr__(self) -> str:
        return f"Run({str(self.run_dir)!r}, status={self.status!r})"

    def _repr_html_(self) -> str:
        import html

        it, total, eta = self.progress()
        return (f"<b>Run</b> <code>{html.escape(str(self.run_dir))}</code>: <b>{self.status}</b>, "
                f"iteration {it}/{total}" + (f", ETA {eta:.0f}s" if eta else ""))


def _throughput(st) -> dict:
    """tokens/s as total tokens over total time (not a mean of per-step rates, which an uneven run
    inflates): the tokens of iterations 2..N over the wall time between the first and the last step
    event; mean step time; MFU weighted by step time. The first iteration (warm-up) is left out."""
    st = st.assign(tokens=st["tokens_per_s"] * st["step_time"])
    per_it = st.groupby("iteration").agg(step_time=("step_time", "max"), tokens=("tokens", "max"),
                                         mfu=("mfu", "max"), time=("time", "max")).sort_index()
    tail = per_it.iloc[1:] if len(per_it) > 1 else per_it
    out: dict[str, float] = {}
    if tail["step_time"].notna().any():
        out["step_time"] = float(tail["step_time"].mean())
    if tail["tokens"].notna().any():
        wall = float(per_it["time"].iloc[-1] - per_it["time"].iloc[0]) if len(per_it) > 1 else 0.0
        busy = float(tail["step_time"].sum())
        out["tokens_per_s"] = float(tail["tokens"].sum()) / max(wall, busy)  # never faster than the steps themselves
    if tail["mfu"].notna().any():
        ok = tail[tail["mfu"].notna()]
        out["mfu"] = float((ok["mfu"] * ok["step_time"]).sum() / ok["step_time"].sum())
    return out


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


