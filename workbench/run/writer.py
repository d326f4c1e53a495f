"""One writer per checkpoint folder: a run that saves into a ``checkpoint.save_dir`` owns it while it lives.

Two runs saving into one folder interleave their iterations (one run's ``iter_5`` beside the other's ``iter_10``,
the tracker naming whichever wrote last): neither run's checkpoints can be trusted.  So the folder holds a claim,
:data:`OWNER_FILE`: the run directory (the run's identity), the host and the process that made it, and whether a
launch or a rank made it.  The same code claims for both ways a run starts:

- ``workbench launch`` / ``Run.launch`` (:func:`workbench.launch.start.start_run`) claim before any process starts
  (:func:`claim`, after the pre-check :func:`owner_problem`); the supervisor gives the folder back when the run ends;
- the backend's global rank 0 (:func:`rank_claim`, ``python -m workbench.rank``, however it was started: a
  ``torchrun`` line in a SLURM script needs no launch) claims before its first step; a claim naming its own run
  directory (its launch's, or another node's) is its own.  It gives back only its own claim (:func:`release` with
  its pid) when it leaves its training loop.

A second run is refused (:class:`~workbench.config.ConfigError` on ``checkpoint.save_dir``: the owner and the fix)
while the owner lives; an owner that has ended (its ``exit_status.json`` written, its supervisor or rank 0 gone, on
this host) is taken over with a note.  A claim made on another host counts as live: this machine cannot see its
processes (the message says which file to remove).  The claim is made atomically (``O_EXCL``), so of two runs
starting at once only one wins.  A run's default folder (``<run_dir>/checkpoints``) is its own and needs none.

Torch-free and psutil-free: a process is judged by its ``/proc`` start time (a PID given anew is not the owner).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, Problem, RunConfig
from workbench.run import nodes
from workbench.run.files import read_json, write_json_atomic
from workbench.run.nodes import host_name

__all__ = ["OWNER_FILE", "LAUNCH", "RANK0", "save_root", "owner_problem", "claim", "rank_claim", "release",
           "process_started"]

#: the claim a live run holds on its checkpoint folder
OWNER_FILE = ".workbench-writer.json"
#: who made a claim (its ``by``): the launching process, or the backend's global rank 0
LAUNCH, RANK0 = "launch", "rank 0"
#: seconds a claim made by a launching process counts as live before its supervisor is recorded
_STARTING_S = 120.0
#: a recorded start time above this is a wall-clock time (seconds since 1970: an earlier record), not since boot
_WALL_CLOCK = 1e8


def save_root(cfg: RunConfig) -> Path | None:
    """The checkpoint folder ``cfg`` names (``checkpoint.save_dir``, absolute); None for the run's own default."""
    d = cfg.checkpoint.save_dir
    return Path(d).expanduser().absolute() if d else None


def process_started(pid: int) -> float | None:
    """When live process ``pid`` started, in seconds since boot (``/proc/<pid>/stat``); None when it is gone or a
    zombie.  Fixed for the process's life, so a later process given the same PID reads differently."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            stat = fh.read()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the command name (field 2) may hold spaces and parentheses
    try:
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in clock ticks since boot
    except (IndexError, ValueError):
        return None


def _boot_time() -> float:
    with open("/proc/stat") as fh:
        return float(next(line.split()[1] for line in fh if line.startswith("btime ")))


def _same_process(pid: Any, started: Any) -> bool:
    """Whether ``pid`` is alive and is the process that started at ``started`` (a :func:`process_started`)."""
    try:
        now = process_started(int(pid))
        if now is None or started is None:
            return False
        if float(started) > _WALL_CLOCK:  # an earlier record's wall-clock time: within the second btime rounds to
            return abs(now + _boot_time() - float(started)) <= 1.05
        return abs(now - float(started)) < 0.5 / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, TypeError, ValueError):
        return False


def _same_dir(a: Any, b: Path) -> bool:
    try:
        return bool(a) and Path(str(a)).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):
        return False


def _owner_alive(rec: dict) -> tuple[bool, str]:
    """(whether the run ``rec`` names still writes, how that was judged)."""
    run_dir = Path(str(rec.get("run_dir") or ""))
    if not rec.get("run_dir"):
        return False, "the claim names no run"
    if (run_dir / nodes.EXIT_STATUS_FILE).exists():
        return False, f"it ended ({run_dir / nodes.EXIT_STATUS_FILE} is written)"
    if rec.get("host") != host_name():  # another machine's run: this one cannot see its processes
        return True, f"it runs on host {rec.get('host')}, where this machine cannot see whether it still lives"
    if rec.get("by") == RANK0:
        pid = rec.get("pid")
        return ((True, f"its rank 0 (pid {pid}) is running") if _same_process(pid, rec.get("create_time"))
                else (False, f"its rank 0, pid {pid}, is gone"))
    meta = read_json(run_dir / nodes.LAUNCH_FILE) or {}
    if meta.get("supervisor_pid"):
        sup = meta["supervisor_pid"]
        alive = _same_process(sup, meta.get("supervisor_create_time"))
        return (True, f"its supervisor (pid {sup}) is running") if alive else (False, "its supervisor is gone")
    starting = time.time() - float(rec.get("claimed") or 0) < _STARTING_S
    if starting and _same_process(rec.get("pid"), rec.get("create_time")):
        return True, f"it is being launched by pid {rec['pid']}"
    return False, "it never started"


def _read(f: Path) -> dict | None:
    if not f.exists():
        return None
    rec = read_json(f)
    return rec if isinstance(rec, dict) else {"run_dir": None, "unreadable": True}


def _refusal(root: Path, rec: dict, how: str) -> Problem:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(rec.get("claimed") or 0)))
    return Problem("checkpoint.save_dir",
                   f"{root} is the checkpoint folder of run {rec.get('run_dir')} (host {rec.get('host')}, pid "
                   f"{rec.get('pid')}, since {since}), which is still writing it: {how}; two runs saving into one "
                   "folder mix their iterations",
                   "give this run its own checkpoint.save_dir (or none: <run_dir>/checkpoints), or stop that run "
                   f"first; if it has ended without saying so, remove {root / OWNER_FILE}")


def owner_problem(cfg: RunConfig, run_dir: str | Path | None) -> Problem | None:
    """Why this run may not save into its ``checkpoint.save_dir`` (another live run owns it), or None: the launch's
    pre-check (``--dry-run`` included), which writes nothing."""
    root = save_root(cfg)
    if root is None:
        return None
    rec = _read(root / OWNER_FILE)
    if rec is None or (run_dir is not None and _same_dir(rec.get("run_dir"), Path(run_dir).absolute())):
        return None  # free, or a claim of this very run (another node of it)
    alive, how = _owner_alive(rec)
    return _refusal(root, rec, how) if alive else None


def claim(cfg: RunConfig, run_dir: str | Path, *, by: str = LAUNCH) -> list[str]:
    """Claim ``cfg``'s checkpoint folder for the run in ``run_dir``; notes to show (an ended owner's claim taken
    over).  A claim that names ``run_dir`` already is this run's own (its launch's, another node's): kept as it is,
    unless a rank 0 finds the claim of an earlier rank 0 of its run (a restart), which it makes its own.
    Raises :class:`ConfigError` when a live run owns the folder, or it cannot be written."""
    root = save_root(cfg)
    if root is None:
        return []
    try:
        return _claim(root, Path(run_dir).absolute(), by)
    except OSError as e:  # a read-only or full file system, a file where the folder should be
        raise ConfigError([Problem("checkpoint.save_dir", f"{root}: the run cannot write its claim {root / OWNER_FILE} "
                                   f"({type(e).__name__}: {e.strerror or e})",
                                   "give checkpoint.save_dir a folder this run can write")]) from None


def _claim(root: Path, run_dir: Path, by: str) -> list[str]:
    """:func:`claim` of folder ``root``: the claim file made at once (``O_EXCL``: one winner), else the one there
    judged (this run's own, a live owner's: refused, an ended owner's: taken over)."""
    root.mkdir(parents=True, exist_ok=True)
    f = root / OWNER_FILE
    me = os.getpid()
    mine = {"run_dir": str(run_dir), "host": host_name(), "pid": me, "create_time": process_started(me),
            "claimed": time.time(), "by": by}
    if _place(f, mine):
        return []
    rec = _read(f) or {}
    if _same_dir(rec.get("run_dir"), run_dir):
        if by == RANK0 and rec.get("by") == RANK0 and rec.get("pid") != me:  # an earlier rank 0 of this run dir
            if _same_process(rec.get("pid"), rec.get("create_time")):  # alive: a second job given the same run dir
                raise ConfigError([_refusal(root, rec, f"its rank 0 (pid {rec.get('pid')}) is running")]) from None
            write_json_atomic(f, mine)  # a restart
        return []
    alive, how = _owner_alive(rec)
    if alive:
        raise ConfigError([_refusal(root, rec, how)]) from None
    write_json_atomic(f, mine)
    return [f"took over checkpoint folder {root} from run {rec.get('run_dir')} ({how})"]


def _place(f: Path, rec: dict) -> bool:
    """Make claim file ``f`` holding ``rec`` if none exists (one winner among racing runs); False if one exists.
    The record is written whole before it appears (a hard link of a finished file), so a racing reader never sees
    an empty claim; where links are not supported, ``O_EXCL`` creation and a write."""
    tmp = f.with_name(f".{f.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(rec, indent=2))
        try:
            os.link(tmp, f)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            pass
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as fh:
        json.dump(rec, fh, indent=2)
    return True


def rank_claim(cfg: RunConfig, run_dir: str | Path, rank: int | None = None) -> list[str]:
    """The backend's claim, before its first step: global rank 0 only (``rank``, default ``$RANK``) claims, as
    :func:`claim` (``by`` :data:`RANK0`); every other rank, of every node, claims nothing."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
    return claim(cfg, run_dir, by=RANK0) if rank == 0 else []


def release(cfg: RunConfig | None, run_dir: str | Path, *, pid: int | None = None) -> None:
    """Give ``cfg``'s checkpoint folder back at the end of the run in ``run_dir``: only a claim naming that run
    (and, given ``pid``, made by that process: a rank 0 gives back its own claim, never its launch's)."""
    root = save_root(cfg) if cfg is not None else None
    if root is None:
        return
    f = root / OWNER_FILE
    rec = read_json(f) or {}
    if _same_dir(rec.get("run_dir"), Path(run_dir).absolute()) and (pid is None or rec.get("pid") == pid):
        try:
            f.unlink()
        except OSError:
            pass
