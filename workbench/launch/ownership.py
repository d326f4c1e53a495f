"""Which processes are a run's: their records in ``launch.json``, and the rule that they die with the supervisor.

- **Records.**  The supervisor writes ``launch.json``'s ``processes``: torchrun and every process
  below it (the ranks), each as ``{pid, create_time, role}``, refreshed while the tree changes.
  :func:`live_recorded` turns the records back into live processes and refuses any PID whose
  create time differs from the recorded one, so a recycled PID is never signalled.
- **Ownership.**  ``launch.json`` is a file anyone who can write the run directory can forge, so
  a record alone never gets a process signalled: :func:`verified_supervisor` and
  :func:`live_recorded` accept a process only when its create time is the recorded one AND its
  command line runs this run directory (the supervisor: ``workbench.launch supervise --run-dir
  <dir>``; torchrun and the ranks: ``--run-dir <dir>`` in their arguments), or, for a helper a
  rank started, when it carries the supervisor token of such a process in its environment.  What
  is refused is said (:class:`Refusal`), never signalled.  A process still inside its ``execve``
  (no command line yet, see :func:`_argv`) is waited for, not taken for one that is exiting.
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
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from workbench.launch.processes import same_start, start_ticks

__all__ = ["SUPERVISOR_ENV", "SUPERVISOR_MODULE", "supervisor_token", "die_with_parent", "guard_rank",
           "names_run_dir", "verified_supervisor", "live_recorded", "Refusal"]

#: the environment variable the supervisor sets for torchrun and so for every rank: "<pid>:<start ticks>"
SUPERVISOR_ENV = "WORKBENCH_SUPERVISOR"
#: the supervisor's module (``python -m workbench.launch supervise --run-dir DIR ...``)
SUPERVISOR_MODULE = "workbench.launch"
_PR_SET_PDEATHSIG = 1


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def supervisor_token(pid: int | None = None) -> str:
    """``"<pid>:<start ticks>"`` of this process (the value of :data:`SUPERVISOR_ENV`)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{start_ticks(pid) or 0}"


def _token_alive(token: str) -> bool:
    try:
        pid_s, ticks_s = token.split(":", 1)
        pid, ticks = int(pid_s), int(ticks_s)
    except ValueError:
        return True  # not ours to judge
    now = start_ticks(pid)
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


class Refusal(str):
    """Why a process that ``launch.json`` names was not taken as this run's (it is never signalled)."""


#: seconds a process that is still inside its ``execve`` (its new program's arguments not in place yet) is waited for
EXEC_WAIT = 2.0
_PF_EXITING, _PF_KTHREAD = 0x4, 0x200000  # task flags (/proc/<pid>/stat field 9)


def _in_exec(pid: int) -> bool:
    """Whether ``pid`` lives, is not exiting and is no kernel thread: with an empty command line, it is inside an
    ``execve`` (the new memory is in place, its arguments not yet).  False off Linux or when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        state, flags = fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return False
    return state not in (b"Z", b"X", b"x") and not flags & (_PF_EXITING | _PF_KTHREAD)


def _argv(p: Any) -> list[str]:
    """Process ``p``'s command line (psutil's ``cmdline()``; raises as it does).

    ``/proc/<pid>/cmdline`` is empty both for a process that is exiting and, for a moment, for one inside its
    ``execve``: the new program's memory is in place before its arguments are.  ``Popen`` returns in that window
    (the close-on-exec pipe it waits on closes first), so a process started a moment ago, a record forged from it
    included, can read as having no command line.  Such a process is waited for (up to :data:`EXEC_WAIT`, it is
    only a moment unless the machine is busy) rather than taken for one that is gone: else its refusal is never said
    and a run's own process is passed over.  An exiting process (``PF_EXITING``) gives ``[]`` at once."""
    deadline = None
    while True:
        args = p.cmdline()
        if args or not _in_exec(p.pid):
            return args
        now = time.monotonic()
        if deadline is None:
            deadline = now + EXEC_WAIT
        elif now >= deadline:
            return args
        time.sleep(0.002)


def _run_dir_args(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith("--run-dir="):
            out.append(a.split("=", 1)[1])
    return out


def names_run_dir(p: Any, run_dir: str | Path) -> bool:
    """Whether process ``p``'s command line passes ``--run-dir`` = ``run_dir`` (relative paths read
    from the process's working directory)."""
    import psutil

    want = Path(run_dir).resolve()
    try:
        args, cwd = _argv(p), None
        for arg in _run_dir_args(args):
            if not os.path.isabs(arg):
                cwd = cwd or p.cwd()
                arg = os.path.join(cwd, arg)
            if Path(arg).resolve() == want:
                return True
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return False
    return False


def _same_start(p: Any, created: Any) -> bool:
    import psutil

    try:
        return same_start(p.pid, created) and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _shown(p: Any) -> str:
    try:
        return shlex.join(_argv(p))[:160] or p.name()
    except Exception:  # noqa: BLE001  (gone, or not ours to read)
        return "?"


def verified_supervisor(meta: dict, run_dir: str | Path) -> tuple[Any | None, Refusal | None]:
    """(the live supervisor ``meta`` names, None) when its create time is the recorded one and its
    command line is ``workbench.launch supervise --run-dir <run_dir>``; else (None, why it was
    refused) — (None, None) when ``meta`` names none or it has ended."""
    import psutil

    pid = meta.get("supervisor_pid")
    if not pid:
        return None, None
    try:
        p = psutil.Process(int(pid))
    except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError, ValueError):
        return None, None
    if not _same_start(p, meta.get("supervisor_create_time")):
        return None, None  # ended (its PID reused, or a zombie), or a record without a create time
    try:
        args = _argv(p)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None, None
    if not _exists(p):
        return None, None
    if SUPERVISOR_MODULE in args and "supervise" in args and names_run_dir(p, run_dir):
        return p, None
    return None, Refusal(f"launch.json names pid {p.pid} as the supervisor of {run_dir}, but that process runs "
                         f"{_shown(p)!r}, not this run directory: it is not signalled")


def live_recorded(meta: dict, run_dir: str | Path, refused: list[Refusal] | None = None) -> list:
    """The live processes ``launch.json`` (``meta``) records (torchrun, ranks, their helpers) that
    provably belong to ``run_dir`` (see the module docstring); why any other was refused is
    appended to ``refused``.  A record without a create time is not trusted (its PID may belong
    to anyone by now)."""
    import psutil

    seen: dict[int, Any] = {}
    records = list(meta.get("processes") or [])
    if meta.get("torchrun_pid") and meta.get("torchrun_create_time"):
        records.append({"pid": meta["torchrun_pid"], "create_time": meta["torchrun_create_time"], "role": "torchrun"})
    candidates: list[tuple[Any, dict]] = []
    for rec in records:
        try:
            pid = int(rec["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        if pid in seen or pid == os.getpid() or any(c.pid == pid for c, _ in candidates):
            continue
        try:
            p = psutil.Process(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if _same_start(p, rec.get("create_time")):
            candidates.append((p, rec))
    tokens = set()
    for p, rec in candidates:  # torchrun and the ranks: their own command line names the run directory
        if names_run_dir(p, run_dir):
            p.info = {"role": rec.get("role")}
            seen[p.pid] = p
            tokens.add(_environ(p).get(SUPERVISOR_ENV))
    tokens.discard(None)
    for p, rec in candidates:  # a helper a rank started: it carries the job's supervisor token
        if p.pid in seen:
            continue
        if tokens and _environ(p).get(SUPERVISOR_ENV) in tokens:
            p.info = {"role": rec.get("role")}
            seen[p.pid] = p
        elif refused is not None and _exists(p):
            refused.append(Refusal(f"launch.json records pid {p.pid} ({rec.get('role')}) for {run_dir}, but that process "
                                   f"runs {_shown(p)!r}, which is not this run's: it is not signalled"))
    return list(seen.values())


def _exists(p: Any) -> bool:
    """Whether ``p`` still runs a program: a process that is exiting has no command line left (and is no one's);
    one inside its ``execve`` is waited for (:func:`_argv`)."""
    import psutil

    try:
        return bool(_argv(p)) and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _environ(p: Any) -> dict:
    import psutil

    try:
        return p.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
        return {}
