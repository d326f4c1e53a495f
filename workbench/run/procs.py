"""A run's processes: their records in ``launch.json`` and the rule that they die with the supervisor.

- **Records.**  The supervisor writes ``launch.json``'s ``processes``: torchrun and every process
  below it (the ranks), each as ``{pid, create_time, role}``, refreshed while the tree changes.
  :func:`live_recorded` turns the records back into live processes and refuses any PID whose
  create time differs from the recorded one, so a recycled PID is never signalled.
- **Parent death.**  torchrun starts with ``PR_SET_PDEATHSIG = SIGKILL`` (:func:`die_with_parent`,
  the supervisor's ``preexec_fn``), and each rank arms the same when it imports ``workbench``
  (:func:`guard_rank`, switched on by ``WORKBENCH_SUPERVISOR`` in the environment the supervisor
  gives torchrun).  So a SIGKILLed supervisor takes torchrun down at once, and torchrun's death
  takes the ranks (torchrun starts them in their own sessions: no process-group signal reaches
  them).  A process of the job that starts after its supervisor died leaves at once.

Linux only (elsewhere these are no-ops).  Torch-free; psutil is imported lazily.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Iterable

__all__ = ["SUPERVISOR_ENV", "supervisor_token", "die_with_parent", "guard_rank", "describe", "live_recorded"]

#: the environment variable the supervisor sets for torchrun and so for every rank: "<pid>:<start ticks>"
SUPERVISOR_ENV = "WORKBENCH_SUPERVISOR"
_PR_SET_PDEATHSIG = 1


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _start_ticks(pid: int) -> int | None:
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


def supervisor_token(pid: int | None = None) -> str:
    """``"<pid>:<start ticks>"`` of this process (the value of :data:`SUPERVISOR_ENV`)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_ticks(pid) or 0}"


def _token_alive(token: str) -> bool:
    try:
        pid_s, ticks_s = token.split(":", 1)
        pid, ticks = int(pid_s), int(ticks_s)
    except ValueError:
        return True  # not ours to judge
    now = _start_ticks(pid)
    return now is not None and (ticks == 0 or now == ticks)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``Popen``: the child gets ``sig`` when this process dies (None off Linux).

    Made in the parent (libc is loaded before the fork); if the parent is already gone when the
    child arms it, the child leaves at once.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = _libc()
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _parent_is_torchrun(ppid: int) -> bool:
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as fh:
            cmd = fh.read()
    except OSError:
        return False
    return b"torch.distributed.run" in cmd or b"torchrun" in cmd


def guard_rank() -> None:
    """In a process started under a workbench supervisor: die with torchrun, and never outlive the supervisor.

    Called when ``workbench`` is imported (a cheap environment lookup everywhere else).  A rank
    (its parent is torchrun) arms ``PR_SET_PDEATHSIG = SIGKILL``; any process of the job whose
    supervisor is already gone (e.g. a rank that started while torchrun was being killed) exits.
    """
    token = os.environ.get(SUPERVISOR_ENV)
    if not token or not sys.platform.startswith("linux"):
        return
    ppid = os.getppid()
    if _parent_is_torchrun(ppid):
        try:
            _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except Exception:
            pass
        if os.getppid() != ppid:  # torchrun died before the guard was armed
            _leave("torchrun is gone")
    if not _token_alive(token):
        _leave("its supervisor is gone")


def _leave(why: str) -> None:
    print(f"[workbench] pid {os.getpid()}: {why}; this process of the run exits", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- records


def describe(procs: Iterable[Any], torchrun_pid: int | None = None) -> list[dict]:
    """Records ``{pid, create_time, role}`` of psutil processes (role: torchrun | rank | child)."""
    import psutil

    out = []
    for p in procs:
        try:
            role = "torchrun" if p.pid == torchrun_pid else ("rank" if p.ppid() == torchrun_pid else "child")
            out.append({"pid": p.pid, "create_time": p.create_time(), "role": role})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def live_recorded(meta: dict) -> list:
    """The live processes ``launch.json`` (``meta``) records (torchrun, ranks), create times checked.

    A record without a create time is not trusted (its PID may belong to anyone by now)."""
    import psutil

    seen: dict[int, Any] = {}
    records = list(meta.get("processes") or [])
    if meta.get("torchrun_pid") and meta.get("torchrun_create_time"):
        records.append({"pid": meta["torchrun_pid"], "create_time": meta["torchrun_create_time"], "role": "torchrun"})
    for rec in records:
        try:
            pid, created = int(rec["pid"]), float(rec["create_time"])
        except (KeyError, TypeError, ValueError):
            continue
        if pid in seen or pid == os.getpid():
            continue
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - created) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        p.info = {"role": rec.get("role")}
        seen[pid] = p
    return list(seen.values())
