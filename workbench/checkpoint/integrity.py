"""Checkpoint integrity: damaged, altered or foreign files are refused, each named, with the fix.

:func:`file_manifest` records every file's size and SHA-256 in ``workbench.json`` (``"files"``) at save time;
:func:`verify_checkpoint` checks them, checks that ``.metadata`` is there and parses under the allow-list
(:mod:`workbench.checkpoint.safe_load`), and that every byte range its index names lies inside its file.  Every file
name either index holds must stay inside the checkpoint directory once resolved (:func:`checkpoint_member`: no
``..``, absolute path or symlink that leads out), else the checkpoint is refused before any file it names is opened.
The manifest is the checkpoint's closed list of files: a file it does not name (say a ``common.pt`` dropped in, which
megatron-core would read) is refused, and so is a checkpoint without the list (its files cannot be checked: a damaged
one would load unnoticed), until someone who trusts that copy records it with :func:`record_checksums` (``workbench
convert trust``).  Each problem names the file; the error says how to fix it.  A reader that goes through every byte
anyway (a conversion) checks the checksums as it reads (:class:`workbench.checkpoint.checksum_reads.ChecksummedReads`,
after ``verify_checkpoint(hashes=False)``) and refuses at the end of its pass, before its output is renamed into
place, so the data is read once.

Torch-free: :func:`verify_checkpoint` parses ``.metadata`` with inert stand-ins for the admitted classes, so launch
checks can run it without torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench.checkpoint.config_check import config_mismatch
from workbench.checkpoint.names import METADATA_FILE, CheckpointError, list_checkpoints
from workbench.checkpoint.safe_load import DIST_METADATA_FILE, MetadataUnpickler
from workbench.run.files import write_json_atomic

__all__ = ["file_manifest", "checkpoint_member", "storage_needs", "checkpoint_damage", "unlisted_files",
           "verify_checkpoint", "record_checksums"]


# --------------------------------------------------------------------------- manifest (save) and verification (load)


def _sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.name != METADATA_FILE)


def file_manifest(d: str | Path, known: dict[str, tuple[int, str]] | None = None) -> dict[str, dict[str, Any]]:
    """{file name: {"size", "sha256"}} of every file in checkpoint directory ``d`` except ``workbench.json``.

    ``known``: {file name: (size, sha256)} hashed by its writer as it wrote the bytes (a streaming conversion);
    used for a file whose size on disk is that size, instead of reading it again."""
    files = _files(Path(d))
    known = known or {}
    todo = [p for p in files if known.get(p.name, (None,))[0] != p.stat().st_size]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(todo) or 1))) as pool:  # hashlib releases the GIL
        digests = dict(zip(todo, pool.map(_sha256, todo)))
    return {p.name: {"size": p.stat().st_size, "sha256": digests[p] if p in digests else known[p.name][1]}
            for p in files}


def _manifest(d: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((d / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else None


_OUTSIDE_FIX = ("it was not read: a checkpoint's files lie inside its own directory, so a name that leads out of it "
                "is crafted or foreign -> load only checkpoints from a source you trust, or copy this one again from its source")


def checkpoint_member(d: str | Path, name: Any, *, source: str, what: str, entry: str = "") -> Path:
    """``d / name`` for the file ``name`` that ``source`` (a file of checkpoint directory ``d``) names as ``what``
    (in ``entry``); a :class:`CheckpointError` naming ``source``, the name and the entry when ``name`` is not a
    relative path that stays inside ``d`` once resolved (``..``, an absolute path, a symlink that leads out of ``d``)."""
    d = Path(d)
    what = f"{what} {name!r}" + (f" ({entry})" if entry else "")
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(f"{source} names {what}, which is not a file name -> copy the checkpoint again "
                              "from its source")
    root = d.resolve()
    try:
        target = (d / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise CheckpointError(f"{source} names {what}, which does not resolve ({type(e).__name__}: {e}); "
                              f"{_OUTSIDE_FIX}") from None
    if target == root or not target.is_relative_to(root):
        raise CheckpointError(f"{source} names {what}, which lies outside checkpoint {d} (it resolves to "
                              f"{target}); {_OUTSIDE_FIX}")
    return d / name


def storage_needs(d: str | Path, md: Any, source: str) -> dict[str, int]:
    """{data file name: bytes its index needs} from ``md``, the parsed ``.metadata`` (``source``) of checkpoint
    directory ``d``: every storage entry checked to name a file inside ``d`` (:func:`checkpoint_member`) and a
    byte range of non-negative offset and length, else a :class:`CheckpointError` naming ``source`` and the entry.
    A ``TypeError`` for an index that is not one (damage: the caller reports it)."""
    need: dict[str, int] = {}
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise TypeError("no storage index")
    checked: set[str] = set()
    for index, info in storage.items():
        rel, off, length = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or type(off) is not int or type(length) is not int:
            raise TypeError("malformed storage entry")
        entry = f"storage entry of {getattr(index, 'fqn', index)!r}"
        if rel not in checked:
            checkpoint_member(d, rel, source=source, what="the data file", entry=entry)
            checked.add(rel)
        if off < 0 or length < 0:
            raise CheckpointError(f"{source}: the {entry} has offset {off} and length {length} in {Path(d) / rel}, a byte "
                                  "range no save writes; it was not read -> load only checkpoints from a source you trust, "
                                  "or copy this one again from its source")
        need[rel] = max(need.get(rel, 0), off + length)
    return need


_VERIFIED: dict[str, tuple] = {}  # dir -> the (name, size, mtime) signature it last passed with
_VERIFIED_LOCK = threading.Lock()


def _signature(d: Path) -> tuple:
    # lstat: a file swapped for a link (even to one of the same size and time) changes the signature
    return tuple((p.name, st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns) for p in sorted(d.iterdir())
                 for st in [p.lstat()] if not stat.S_ISDIR(st.st_mode))


def checkpoint_damage(d: str | Path, *, hashes: bool = True) -> list[str]:
    """What is wrong with the files of checkpoint iteration directory ``d`` (empty: nothing found).

    Checks ``.metadata`` (present, parses under the allow-list), every byte range its index names
    (file present and long enough), and the save-time manifest in ``workbench.json`` (sizes, and
    SHA-256 when ``hashes``).  Raises :class:`CheckpointError` for metadata that names a class
    outside the allow-list, and for a file name in either index that leads out of ``d`` or a negative
    byte range (:func:`storage_needs`): that is not damage, it is a hostile or foreign file, and no
    file it names is looked at; and for sound files whose recorded config does not describe the tensors they hold
    (:func:`~workbench.checkpoint.config_check.config_mismatch`).
    """
    d = Path(d)
    problems: list[str] = []
    meta_path = d / DIST_METADATA_FILE
    manifest = _manifest(d)
    index = None
    for name in manifest or ():  # every name checked before any file is read
        checkpoint_member(d, name, source=str(d / METADATA_FILE), what="the file", entry='its "files" list')
    if meta_path.is_symlink():
        checkpoint_member(d, DIST_METADATA_FILE, source=f"checkpoint {d}", what="the index file")
    if not meta_path.is_file():
        problems.append(f"{meta_path} is missing")
    else:
        try:
            with open(meta_path, "rb") as fh:
                md = MetadataUnpickler(fh, source=str(meta_path), real=False).load()
            need = storage_needs(d, md, str(meta_path))
            index = md
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (any parse failure of a damaged pickle)
            problems.append(f"{meta_path} is damaged (does not parse: {type(e).__name__})")
            need = {}
        for rel, n in sorted(need.items()):
            f = d / rel
            if not f.is_file():
                problems.append(f"{f} is missing")
            elif f.stat().st_size < n:
                problems.append(f"{f} is truncated ({f.stat().st_size} bytes; the checkpoint's index needs {n})")
    if manifest:
        for name, rec in sorted(manifest.items()):
            f = d / name
            if any(str(f) in p for p in problems):
                continue
            if not f.is_file():
                problems.append(f"{f} is missing")
            elif isinstance(rec, dict) and rec.get("size") is not None and f.stat().st_size != rec["size"]:
                problems.append(f"{f} has {f.stat().st_size} bytes, {rec['size']} when saved")
            elif hashes and isinstance(rec, dict) and rec.get("sha256") and _sha256(f) != rec["sha256"]:
                problems.append(_mismatch(f))
    if not problems and index is not None and (why := config_mismatch(d, index)):
        raise CheckpointError(why)  # sound files, but a config that does not describe them: no model would load them
    return problems


#: the files a megatron-core torch_dist save writes into an iteration directory (what :func:`record_checksums` admits)
_SAVED_FILE_RE = re.compile(r"^(\.metadata|metadata\.json|__\d+_\d+\.distcp)$")


def unlisted_files(d: str | Path) -> list[str]:
    """Files of checkpoint directory ``d`` that its checksum list (``files`` in ``workbench.json``) does not name
    (``workbench.json`` itself aside); empty when there is no list."""
    d = Path(d)
    manifest = _manifest(d)
    if manifest is None:
        return []
    return [p.name for p in _files(d) if p.name not in manifest]


def _unverifiable(d: Path) -> str:
    return (f"checkpoint {d} records no checksums ({METADATA_FILE} has no \"files\" list), so its files cannot be checked: "
            f"a damaged or altered file would load unnoticed -> copy the checkpoint again from its source; for a copy you "
            f"trust, record its checksums once with `workbench convert trust --ckpt {d}`")


def _damaged(d: Path, problems: list[str]) -> CheckpointError:
    """The error for checkpoint directory ``d`` with ``problems`` (each naming its file), with the fix."""
    earlier = [c.name for c in list_checkpoints(d.parent) if c.name < d.name] if d.parent.is_dir() else []
    alt = f", or load an earlier iteration ({d.parent / earlier[-1]})" if earlier else ""
    return CheckpointError(f"checkpoint {d} is damaged: " + "; ".join(problems) +
                           f" -> copy the checkpoint again from its source (an interrupted copy or a full disk cuts files short){alt}")


def _mismatch(f: Path) -> str:
    return f"{f} does not match its checksum from the save (its contents changed)"


def verify_checkpoint(d: str | Path, *, hashes: bool = True) -> None:
    """Raise :class:`CheckpointError` naming every damaged file of checkpoint directory ``d``, and the fix; also
    for a file its checksum list does not name, and for a checkpoint without that list.

    A directory that passed once is not re-hashed while its files keep their sizes and times.
    """
    d = Path(d)
    try:
        sig = _signature(d)
    except OSError as e:
        raise CheckpointError(f"checkpoint {d} cannot be read ({e}) -> check the path and its permissions") from None
    key = str(d.resolve())
    with _VERIFIED_LOCK:
        if _VERIFIED.get(key) == sig:
            return
    problems = checkpoint_damage(d, hashes=hashes)
    if problems:
        raise _damaged(d, problems)
    if _manifest(d) is None:
        raise CheckpointError(_unverifiable(d))
    extra = unlisted_files(d)
    if extra:
        raise CheckpointError(
            f"checkpoint {d} holds {', '.join(str(d / n) for n in extra)}, which its checksum list ({METADATA_FILE} "
            "\"files\") does not name: the save did not write it, and a loader could read it (megatron-core reads a "
            "common.pt and unpickles it) -> remove it, or copy the checkpoint again from its source")
    if hashes:
        with _VERIFIED_LOCK:
            _VERIFIED[key] = sig


def record_checksums(d: str | Path) -> dict[str, dict[str, Any]]:
    """Record the checksum list of checkpoint directory ``d`` that has none (one saved without it): the files as
    they are now, for a copy the caller trusts.  Refused (:class:`CheckpointError`) when ``d`` already has a list,
    when its ``.metadata`` names a class outside the allow-list or any byte range it indexes is missing, and when
    it holds a file that a megatron-core save does not write.  Returns the list written into ``workbench.json``."""
    d = Path(d)
    meta_file = d / METADATA_FILE
    try:
        data = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_file} cannot be read ({type(e).__name__}: {e}) -> point at an iter_XXXXXXX directory "
                              "of a workbench checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{meta_file} is not a JSON object -> point at an iter_XXXXXXX directory of a workbench checkpoint")
    if _manifest(d) is not None:
        raise CheckpointError(f"checkpoint {d} already records its checksums -> nothing to record; "
                              "a file that no longer matches them is damaged: copy the checkpoint again from its source")
    problems = checkpoint_damage(d, hashes=False)
    if problems:
        raise CheckpointError(f"checkpoint {d} is damaged: " + "; ".join(problems) + " -> copy the checkpoint again from its source")
    for p in _files(d):  # a symlink that leads out of the checkpoint is not hashed into its list
        checkpoint_member(d, p.name, source=f"checkpoint {d}", what="the file")
    foreign = [p.name for p in _files(d) if not _SAVED_FILE_RE.match(p.name)]
    if foreign:
        raise CheckpointError(f"checkpoint {d} holds {', '.join(str(d / n) for n in foreign)}, which a megatron-core save "
                              "never writes -> remove it, then record the checksums")
    data["files"] = file_manifest(d)
    write_json_atomic(meta_file, data)
    return data["files"]
