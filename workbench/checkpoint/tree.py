"""A checkpoint root on disk: which iteration a path means, and what an interrupted save left behind.  Torch-free.

:func:`find_checkpoint` resolves a checkpoint ROOT (or a run directory, or an ``iter_XXXXXXX`` directory) to a
complete iteration: the tracker's, else the newest complete one, and never silently an older one when a newer
iteration is damaged.  :func:`partial_dir_name` names a save under way (``iter_N.tmp-<host>-<pid>``) and the copy a
re-save moves aside (``iter_N.old-...``); :func:`remove_stale_partials` tidies those a killed save left.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from workbench.checkpoint.names import ITER_RE, METADATA_FILE, TRACKER_FILE, CheckpointError, is_complete, iter_dir_name, list_checkpoints
from workbench.run.nodes import host_name

__all__ = ["find_checkpoint", "partial_dir_name", "remove_stale_partials"]


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint ROOT or an ``iter_XXXXXXX`` dir to a complete iteration directory.

    From a root: the iteration named by ``latest_checkpointed_iteration.txt`` if complete,
    else the newest complete ``iter_*`` (an interrupted save never wins).  A newer iteration whose
    ``workbench.json`` is missing or unreadable, or whose folder the tracker names but is gone, raises
    :class:`CheckpointError` naming it: never a silent fall-back to the one before.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist -> check the path (a checkpoint root or an iter_XXXXXXX directory)")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is a file, not a directory -> pass the checkpoint root or an iter_XXXXXXX directory")
    if (p / METADATA_FILE).exists() or ITER_RE.match(p.name) or ".tmp-" in p.name:
        if is_complete(p):
            return p
        raise CheckpointError(
            f"{p} is not a complete workbench checkpoint ({METADATA_FILE} missing or not marked complete: "
            "the save was interrupted or this is not a workbench checkpoint) -> use an earlier iteration, "
            "or import foreign checkpoints with `workbench convert`")
    tracked = _tracked_iteration(p)
    if tracked is not None and is_complete(d := p / iter_dir_name(tracked)):
        _refuse_newer_damaged(p, d)
        return d
    complete = list_checkpoints(p)
    if complete:
        _refuse_newer_damaged(p, complete[-1])
        return complete[-1]
    _refuse_newer_damaged(p, None)  # the tracker names an iteration whose folder is gone, and none is older
    inner = _run_dir_checkpoints(p)
    if inner is not None:
        return find_checkpoint(inner)
    partial = sorted(x.name for x in p.iterdir() if x.name.startswith("iter_"))
    legacy = any(x.name.startswith("mp_rank_") for x in p.iterdir()) or any(
        x.is_dir() and any(y.name.startswith("mp_rank_") for y in x.iterdir()) for x in p.iterdir() if x.is_dir())
    run_dir = (p / "config.json").is_file() and ((p / "events").is_dir() or (p / "launch.json").is_file())
    hint = ("this looks like a legacy Megatron-LM checkpoint -> import it with `workbench convert legacy`" if legacy
            else f"this run directory has no checkpoints/ (the run saved none: it saves at the end and every "
                 f"checkpoint.save_interval steps unless checkpoint.save_on_exit is false) -> pass a run that saved one"
            if run_dir else "train with a save_dir, or convert a model with `workbench convert hf-to-megatron`")
    raise CheckpointError(
        f"no complete checkpoint under {p}" + (f" (incomplete: {', '.join(partial)})" if partial else "") + f" -> {hint}")


def _tracked_iteration(root: Path) -> int | None:
    """The iteration ``root``'s tracker (``latest_checkpointed_iteration.txt``, megatron's name) says is the latest;
    None without one, or for one that names no iteration (megatron's ``release``)."""
    try:
        text = (root / TRACKER_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if re.fullmatch(r"[0-9]+", text) else None  # (str.isdigit takes '²')


def _unreadable_metadata(d: Path) -> str | None:
    """What is wrong with ``d``'s ``workbench.json`` ("is missing (...)", "is damaged (...)"), None when it reads as a
    JSON object.  A save writes that file before it renames ``iter_N.tmp-*`` to ``iter_N``, and the tracker after,
    so an ``iter_N`` without one, or with one that does not read, or the tracker's ``iter_N`` that is not there at
    all, was damaged, altered or deleted afterwards, never interrupted."""
    f = d / METADATA_FILE
    if not d.exists():
        return (f"is missing ({d.name} is gone, yet {d.parent / TRACKER_FILE} names it the latest: it was deleted or "
                "moved after its save)")
    if not f.is_file():
        return ("is missing (a save renames an iteration into place only after writing it, so this one lost it "
                "afterwards)")
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is damaged ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return f"is damaged (a JSON {type(data).__name__}, not an object)"
    return None  # read (one marked incomplete says so itself: skipped, as its writer asked)


def _refuse_newer_damaged(root: Path, chosen: Path | None) -> None:
    """An ``iter_N`` newer than ``chosen`` (None: no complete one) whose ``workbench.json`` is missing or unreadable,
    or that the tracker names but is gone, is a damaged save (a save renames its directory into place only after
    writing that file, and writes the tracker last), never an interrupted one: loading the older iteration instead
    would lose training silently, so it is refused, naming both."""
    m = ITER_RE.match(chosen.name) if chosen is not None else None
    floor = int(m.group(1)) if m else -1
    newer = {} if chosen is None else {int(x.group(1)): d for d in root.iterdir()
                                       if (x := ITER_RE.match(d.name)) and d.is_dir() and int(x.group(1)) > floor}
    tracked = _tracked_iteration(root)
    if tracked is not None and tracked > floor and not (root / iter_dir_name(tracked)).exists():
        newer[tracked] = root / iter_dir_name(tracked)
    for n in sorted(newer, reverse=True):
        d = newer[n]
        why = _unreadable_metadata(d)
        if why:
            raise CheckpointError(
                f"{'a newer' if chosen else 'the latest'} checkpoint {d} cannot be read: {d / METADATA_FILE} {why} -> "
                "copy the checkpoint again from its source"
                + (f", or load the older iteration explicitly: point at {chosen}" if chosen else ""))


def _run_dir_checkpoints(p: Path) -> Path | None:
    """The checkpoint root of run directory ``p``: its config's ``checkpoint.save_dir``, else
    ``p/checkpoints`` (where the backend saves by default); None when neither holds an iteration."""
    roots = []
    try:
        saved = json.loads((p / "config.json").read_text())
        save_dir = ((saved.get("checkpoint") or {}).get("save_dir")) if isinstance(saved, dict) else None
        if save_dir:
            roots.append(Path(save_dir).expanduser())
    except (OSError, ValueError, AttributeError):
        pass
    roots.append(p / "checkpoints")
    for root in roots:
        if root.is_dir() and root != p and ((root / TRACKER_FILE).is_file() or any(ITER_RE.match(x.name) for x in root.iterdir())):
            return root
    return None


_PARTIAL_RE = re.compile(r"^(iter_\d{7})\.(tmp|old)-(?:(.+)-)?(\d+)$")


def _this_host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", host_name())


def partial_dir_name(final_name: str, kind: str) -> str:
    """``iter_N.tmp-<host>-<pid>`` (a save under way) or ``iter_N.old-<host>-<pid>`` (the copy a re-save
    moves aside): the host, because a checkpoint root on a shared filesystem is written from several
    machines and a PID means something only on its own."""
    import os

    return f"{final_name}.{kind}-{_this_host()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _may_be_saving(pid: int, folder: Path) -> bool:
    """Whether live process ``pid`` may be the save that made ``folder``: a process that started after the folder was
    last written (its PID given anew, say after a restart) cannot have made it."""
    try:
        import psutil

        return psutil.Process(pid).create_time() <= folder.stat().st_mtime + 1.0
    except ImportError:
        return True
    except (psutil.NoSuchProcess, OSError):
        return False
    except psutil.AccessDenied:
        return True


def remove_stale_partials(root: str | Path) -> list[str]:
    """Tidy what a save killed half-way left in a checkpoint ROOT; returns what was done, a line each.

    Only this host's leftovers (named by :func:`partial_dir_name`) whose process is gone (or whose PID now belongs
    to a process started after the leftover was written) are touched; another host's (a shared filesystem), and
    one whose live process may still be saving, are only reported.
    ``iter_N.tmp-...`` (a save that never completed) is removed.  ``iter_N.old-...`` (the previous copy
    of an iteration being re-saved) is removed when ``iter_N`` is complete again, and moved back into
    place when the kill came between the two renames and ``iter_N`` is missing.  Called by rank 0
    before each save.
    """
    import os
    import shutil

    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    here = _this_host()
    for p in sorted(root.iterdir()):
        m = _PARTIAL_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        host, pid = m.group(3), int(m.group(4))
        if host is not None and host != here:
            done.append(f"left {p.name}: an unfinished save from host {host} (remove it once that job is gone)")
            continue
        if _pid_alive(pid) and _may_be_saving(pid, p):  # a save in progress here, perhaps: said, left alone
            done.append(f"left {p.name}: process {pid} is alive and may still be saving it (remove it once that process "
                        "is gone)")
            continue
        final = root / m.group(1)
        gone = "which is gone" if not _pid_alive(pid) else "which is gone: that PID is now a process started later"
        if m.group(2) == "tmp":
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name} (an unfinished save of process {pid}, {gone})")
        elif final.exists() and is_complete(final):
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name} ({final.name} is complete)")
        elif not final.exists():
            os.replace(p, final)
            done.append(f"restored {final.name} from {p.name} (its re-save was killed between the renames)")
    return done
