"""The processes of a run, seen through psutil: finding them, signalling them, and the one way they are stopped.

- :func:`live_process`, :func:`descendants`, :func:`is_alive`, :func:`create_time` (with :func:`same_start`),
  :func:`signal_all`:
  the psutil calls every part of the launch makes, each tolerant of a process that ends meanwhile.
- :func:`stop`: the one "SIGTERM, wait, SIGKILL" routine.  The supervisor stops its job with it
  (SIGTERM to torchrun only, which forwards one to each rank), :func:`workbench.launch.start.run_supervised`
  its supervisor (and that supervisor's process group), ``Run.stop`` a supervisor or the processes
  a killed supervisor left behind.
- :func:`describe`: ``launch.json``'s process records; :func:`rank_processes`, :func:`rank_log`,
  :func:`is_stopped`, :func:`collect_stacks`: the training ranks, their logs and their Python stacks.

Which recorded process is provably this run's (and the rule that the job dies with its supervisor):
:mod:`workbench.launch.ownership`.  Torch-free; psutil is imported lazily.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = ["live_process", "descendants", "signal_all", "is_alive", "create_time", "set_child_subreaper", "stop",
           "describe", "same_start", "start_ticks", "rank_processes", "rank_log", "is_stopped", "collect_stacks"]

#: seconds :func:`stop` waits for the SIGKILLed processes to go
KILL_WAIT = 5.0


def start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after the last ')'
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def _started(pid: int) -> float | None:
    ticks = start_ticks(pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


#: a recorded create time above this is a wall-clock time (seconds since 1970), as earlier versions recorded them
_WALL_CLOCK = 1e8


def same_start(pid: int, recorded: Any) -> bool:
    """Whether process ``pid`` started when ``recorded`` (a :func:`create_time`) says: not a later process that was
    given the same PID.  A wall-clock time (a record an earlier version wrote) is compared with psutil's, within the
    second by which the boot time it adds can move."""
    try:
        now = _started(pid)
        if now is None or recorded is None:
            return False
        if float(recorded) > _WALL_CLOCK:
            import psutil

            return abs(now + psutil.boot_time() - float(recorded)) <= 1.05
        return abs(now - float(recorded)) < 0.5 / os.sysconf("SC_CLK_TCK")
    except (TypeError, ValueError):
        return False


def live_process(pid: int, create_time: float | None = None):
    """psutil.Process for ``pid`` if it is alive (and, given its :func:`create_time`, is the same process), else None."""
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and not same_start(pid, create_time):
            return None  # PID reused
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def descendants(root) -> list:
    """Every process below ``root`` (children, grandchildren, ...); [] once it has ended."""
    import psutil

    try:
        return root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def signal_all(procs: Iterable, sig: int) -> None:
    """Send ``sig`` to each of ``procs``, passing over those that have ended."""
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            pass


def is_alive(p) -> bool:
    """Whether ``p`` is running (a zombie is not)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def create_time(pid: int) -> float | None:
    """When live process ``pid`` started, in seconds since boot (its start ticks over the clock's ticks per second),
    None if it is gone: what ``launch.json`` records and :func:`same_start` compares.  Fixed for the process's life,
    whoever reads it; psutil's ``create_time()`` adds the boot time ``/proc/stat`` reports at the moment of the call,
    which moves by a whole second when the wall clock is adjusted, so two readings of one process could disagree."""
    return _started(pid) if live_process(pid) is not None else None


def set_child_subreaper() -> None:
    """Linux: orphaned descendants (e.g. ranks whose torchrun died) re-parent to this process, not init."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


def stop(procs: Iterable, grace: float, *, term: Iterable | None = None, wait_for: Iterable | None = None,
         more: Callable[[], Iterable] | None = None, group: int | None = None,
         say: Callable[[str], None] | None = None) -> None:
    """SIGTERM, wait, SIGKILL: the one way processes of a run are stopped.

    SIGTERM goes to ``term`` (default: every process of ``procs``): a caller that signals only
    torchrun lets it forward ONE SIGTERM to each rank (a second one makes a rank leave mid-step).
    Then up to ``grace`` seconds for ``wait_for`` (default: ``procs``) to exit.  Whatever of
    ``procs``, and of the processes ``more()`` returns then (the tree as it is now), is still alive
    gets SIGKILL, and so does the process group ``group`` if given; ``say`` hears how many were
    killed.  Last, up to :data:`KILL_WAIT` seconds for the killed processes to go.
    """
    import psutil

    procs = [p for p in procs if p is not None]
    signal_all(procs if term is None else [p for p in term if p is not None], signal.SIGTERM)
    psutil.wait_procs(procs if wait_for is None else [p for p in wait_for if p is not None], timeout=max(grace, 0.0))
    pids = {p.pid for p in procs}
    left = [p for p in procs if is_alive(p)] + [p for p in (more() if more else []) if p.pid not in pids and is_alive(p)]
    if not left:
        return
    if say is not None:
        say(f"{len(left)} process(es) still alive after {grace:.0f}s: SIGKILL")
    if group is not None:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    signal_all(left, signal.SIGKILL)
    psutil.wait_procs(left, timeout=KILL_WAIT)


# --------------------------------------------------------------------------- records


def describe(procs: Iterable[Any], torchrun_pid: int | None = None) -> list[dict]:
    """Records ``{pid, create_time, role}`` of psutil processes (role: torchrun | rank | child)."""
    import psutil

    out = []
    for p in procs:
        try:
            role = "torchrun" if p.pid == torchrun_pid else ("rank" if p.ppid() == torchrun_pid else "child")
            started = _started(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if started is not None:
            out.append({"pid": p.pid, "create_time": started, "role": role})
    return out


# --------------------------------------------------------------------------- ranks and their stacks


#: what a rank's command line names: ``workbench.rank`` (``python -m workbench.rank``, the generation's
#: ``workbench.rank.inference``); ``workbench.backend``, the rank entry of runs started before it moved to
#: ``workbench.rank``, so that a run still going from then is still watched, stalled and stopped by rank
RANK_MODULES: tuple[str, ...] = ("workbench.rank", "workbench.backend")


def rank_processes(processes: Iterable[Any]) -> dict[int, Any]:
    """{global rank: process} of the training ranks among ``processes`` (their command line runs a module of
    :data:`RANK_MODULES` under torchrun, which gave them ``RANK``).  A rank's forked children (its data loader's
    workers, ``data.num_workers``) share its command line and environment: a candidate whose parent is a
    candidate too is such a child, never the rank."""
    import psutil

    found: dict[int, tuple[int, Any]] = {}
    for p in processes:
        try:
            cmd, env = " ".join(p.cmdline()), p.environ()
            if any(m in cmd for m in RANK_MODULES) and "RANK" in env and "torch.distributed.run" not in cmd and "torchrun" not in cmd:
                found[p.pid] = (int(env["RANK"]), p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    ranks: dict[int, Any] = {}
    for pid, (rank, p) in found.items():
        try:
            if p.ppid() in found:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        ranks[rank] = p
    return ranks


def rank_log(node_dir: str | Path, local_rank: int, stream: str = "stderr") -> Path | None:
    """A local rank's torchrun log file (``<node_dir>/logs/torchrun/<id>/attempt_<k>/<local>/<stream>.log``,
    the latest attempt), if it exists."""
    found = sorted((Path(node_dir) / "logs" / "torchrun").glob(f"*/attempt_*/{int(local_rank)}/{stream}.log"),
                   key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def is_stopped(p: Any) -> bool:
    """Whether ``p`` is stopped (SIGSTOP, SIGTSTP, a debugger: psutil status 'stopped')."""
    import psutil

    try:
        return p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def collect_stacks(ranks: dict[int, Any], logs: dict[int, Path | None], wait: float = 2.0) -> dict[int, str]:
    """Every rank's Python stacks: SIGUSR1 to each (the backend's faulthandler prints all its threads
    to its stderr log and the rank goes on), then what each log gained within ``wait`` seconds.

    A stopped process cannot print anything: it is not signalled and its entry says it is stopped."""
    sizes = {r: (path.stat().st_size if path and path.exists() else 0) for r, path in logs.items()}
    stopped = {r for r, p in ranks.items() if is_stopped(p)}
    live = [p for r, p in ranks.items() if r not in stopped]
    for p in live:
        try:
            p.send_signal(signal.SIGUSR1)
        except Exception:  # noqa: BLE001  (ended meanwhile)
            pass
    if live:
        import time

        time.sleep(wait)
    out: dict[int, str] = {}
    for r in sorted(ranks):
        if r in stopped:
            out[r] = (f"rank {r} (pid {ranks[r].pid}) is stopped (process status 'stopped': SIGSTOP, SIGTSTP or a "
                      "debugger); a stopped process cannot print its stack\n")
            continue
        path = logs.get(r)
        if path is not None and path.exists():
            with open(path, "rb") as fh:
                fh.seek(sizes[r])
                out[r] = fh.read().decode("utf-8", "replace")
    return out
