"""One writer per checkpoint folder: a run that saves into a ``checkpoint.save_dir`` owns it while it lives.

Two runs saving into one folder interleave their iterations (one run's ``iter_5`` beside the other's ``iter_10``,
the tracker naming whichever wrote last): neither run's checkpoints can be trusted.  So a launch claims the folder
(:data:`OWNER_FILE` in it: the run directory, host, launching process) before any process starts, and a second
run is refused (exit 2, naming the owner) while the first lives:

- :func:`owner_problem`: the launch pre-check (``launch_checks``, ``--dry-run`` included);
- :func:`claim`: :func:`~workbench.launch.start.start_run`'s claim, made atomically (``O_EXCL``) so two launches
  at once cannot both win; an owner that has ended (its supervisor gone, its ``exit_status.json`` written) is
  taken over with a note;
- :func:`release`: the supervisor gives the folder back when its run ends.

A run's own nodes share its run directory, so they share the claim.  A run's default folder
(``<run_dir>/checkpoints``) is its own and needs none.  Torch-free.
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

__all__ = ["OWNER_FILE", "save_root", "owner_problem", "claim", "release"]

#: the claim a live run holds on its checkpoint folder
OWNER_FILE = ".workbench-writer.json"
#: seconds a claim made by a launching process counts as live before its supervisor is recorded
_STARTING_S = 120.0


def save_root(cfg: RunConfig) -> Path | None:
    """The checkpoint folder ``cfg`` names (``checkpoint.save_dir``, absolute); None for the run's own default."""
    d = cfg.checkpoint.save_dir
    return Path(d).expanduser().absolute() if d else None


def _same_dir(a: Any, b: Path) -> bool:
    try:
        return Path(str(a)).resolve() == b.resolve()
    except (OSError, RuntimeError):
        return False


def _owner_alive(rec: dict) -> tuple[bool, str]:
    """(whether the run ``rec`` names still writes, how that was judged)."""
    from workbench.launch.ownership import verified_supervisor
    from workbench.launch.processes import same_start

    run_dir = Path(str(rec.get("run_dir") or ""))
    if not rec.get("run_dir"):
        return False, "the claim names no run"
    if (run_dir / nodes.EXIT_STATUS_FILE).exists():
        return False, f"it ended ({run_dir / nodes.EXIT_STATUS_FILE} is written)"
    if rec.get("host") != host_name():  # another machine's run: this one cannot see its processes
        return True, f"it runs on host {rec.get('host')}, where this machine cannot see whether it still lives"
    meta = read_json(run_dir / nodes.LAUNCH_FILE) or {}
    if meta.get("supervisor_pid"):
        sup, _ = verified_supervisor(meta, run_dir)
        return (True, f"its supervisor (pid {sup.pid}) is running") if sup else (False, "its supervisor is gone")
    starting = time.time() - float(rec.get("claimed") or 0) < _STARTING_S
    if starting and rec.get("pid") and same_start(int(rec["pid"]), rec.get("create_time")):
        return True, f"it is being launched by pid {rec['pid']}"
    return False, "it never started"


def _read(f: Path) -> dict | None:
    if not f.exists():
        return None
    rec = read_json(f)
    return rec if rec is not None else {"run_dir": None, "unreadable": True}


def _refusal(root: Path, rec: dict, how: str) -> Problem:
    return Problem("checkpoint.save_dir",
                   f"{root} is the checkpoint folder of run {rec.get('run_dir')} (host {rec.get('host')}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(rec.get('claimed') or 0)))}), which is still "
                   f"writing it: {how}; two runs saving into one folder mix their iterations",
                   f"give this run its own checkpoint.save_dir (or none: <run_dir>/checkpoints), or stop that run first; "
                   f"if it has ended without saying so, remove {root / OWNER_FILE}")


def owner_problem(cfg: RunConfig, run_dir: str | Path | None) -> Problem | None:
    """Why this run may not save into its ``checkpoint.save_dir`` (another live run owns it), or None."""
    root = save_root(cfg)
    if root is None:
        return None
    rec = _read(root / OWNER_FILE)
    if rec is None or (run_dir is not None and _same_dir(rec.get("run_dir"), Path(run_dir).absolute())):
        return None  # free, or a claim of this very run (another node of it)
    alive, how = _owner_alive(rec)
    return _refusal(root, rec, how) if alive else None


def claim(cfg: RunConfig, run_dir: Path) -> list[str]:
    """Claim ``cfg``'s checkpoint folder for the run in ``run_dir`` before it starts; notes to show (an ended
    owner's claim taken over).  Raises :class:`ConfigError` when a live run owns it."""
    from workbench.launch.processes import create_time

    root = save_root(cfg)
    if root is None:
        return []
    root.mkdir(parents=True, exist_ok=True)
    f = root / OWNER_FILE
    mine = {"run_dir": str(run_dir), "host": host_name(), "pid": os.getpid(), "create_time": create_time(os.getpid()),
            "claimed": time.time()}
    try:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        rec = _read(f) or {}
        if _same_dir(rec.get("run_dir"), run_dir):
            return []
        alive, how = _owner_alive(rec)
        if alive:
            raise ConfigError([_refusal(root, rec, how)]) from None
        write_json_atomic(f, mine)
        return [f"took over checkpoint folder {root} from run {rec.get('run_dir')} ({how})"]
    with os.fdopen(fd, "w") as fh:
        json.dump(mine, fh, indent=2)
    return []


def release(cfg: RunConfig | None, run_dir: Path) -> None:
    """Give ``cfg``'s checkpoint folder back at the end of the run in ``run_dir`` (only a claim that names it)."""
    root = save_root(cfg) if cfg is not None else None
    if root is None:
        return
    f = root / OWNER_FILE
    if _same_dir((read_json(f) or {}).get("run_dir"), run_dir):
        try:
            f.unlink()
        except OSError:
            pass
