"""Checkpoint integrity and safe reading: the one place that decides what a checkpoint may contain.

Two threats, one module:

- **Code in a checkpoint.**  megatron-core's dist checkpoints are read by torch's
  ``FileSystemReader.read_metadata``, a plain ``pickle.load`` of ``.metadata``, and torch's
  load planner unpickles the stored objects (``_extra_state``, the common state) with
  ``torch.load(weights_only=False)``: opening a checkpoint from someone else could run any
  code.  :class:`MetadataUnpickler` admits only the classes a dist checkpoint's ``.metadata``
  holds (:data:`ALLOWED_GLOBALS`: ``torch.distributed.checkpoint``'s metadata / planner /
  storage-info classes, ``torch.Size``, the dtypes, the layout helper, a few containers) and
  refuses anything else with :class:`CheckpointError` naming the file.  :func:`safe_dist_reading`
  puts it under every torch reader for the duration of a workbench load, and :func:`safe_torch_load`
  (``torch.load`` with an explicit ``weights_only=True``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
  cannot turn off) under the stored objects and a legacy ``common.pt``, which megatron-core would
  otherwise unpickle with whatever the environment says.  Every other pickled file the workbench
  opens (HF ``pytorch_model.bin``, legacy Megatron-LM files, its own tensors files) goes through
  :func:`safe_torch_load` too.
- **Damaged or altered files.**  :func:`file_manifest` records every file's size and SHA-256 in
  ``workbench.json`` (``"files"``) at save time; :func:`verify_checkpoint` checks them, checks that
  ``.metadata`` is there and parses under the allow-list, and that every byte range its index
  names lies inside its file.  Every file name either index holds must stay inside the checkpoint
  directory once resolved (:func:`checkpoint_member`: no ``..``, absolute path or symlink that leads
  out), else the checkpoint is refused before any file it names is opened.  The manifest is the
  checkpoint's closed list of files: a file it does not name (say a ``common.pt`` dropped in, which
  megatron-core would read) is refused, and so is a checkpoint without the list (its files cannot
  be checked: a damaged one would load unnoticed), until someone who trusts that copy records it
  with :func:`record_checksums` (``workbench convert trust``).  Each problem names the file; the error says how to fix it.
  A reader that goes through every byte anyway (a conversion) checks the checksums as it reads
  (:class:`ChecksummedReads`, after ``verify_checkpoint(hashes=False)``) and refuses at the end of its pass, before
  its output is renamed into place, so the data is read once.

Torch-free at import, and :func:`verify_checkpoint` stays torch-free (it parses ``.metadata``
with inert stand-ins for the admitted classes, so launch checks can run it without torch);
:func:`read_dist_metadata` with real classes and :func:`safe_dist_reading` import torch when called.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import json
import os
import pickle
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import re

from workbench.run.ckpt_files import METADATA_FILE, CheckpointError, list_checkpoints
from workbench.run.ckpt_layout import config_mismatch
from workbench.run.direct_io import DirectReads

__all__ = ["ALLOWED_GLOBALS", "DIST_METADATA_FILE", "MetadataUnpickler", "read_dist_metadata", "file_manifest",
           "checkpoint_member", "storage_needs", "checkpoint_damage", "unlisted_files", "verify_checkpoint",
           "record_checksums", "ChecksummedReads", "safe_dist_reading", "safe_torch_load"]

DIST_METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"

#: torch dtypes a stored tensor can have (pickled as globals ``torch.<name>``)
_DTYPES = frozenset({
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex32", "chalf", "complex64", "cfloat",
    "complex128", "cdouble", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "short", "int32", "int", "int64",
    "long", "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2", "quint2x4",
})

#: every global a megatron-core 0.19 torch_dist ``.metadata`` refers to (found by saving real
#: checkpoints, with and without optimizer state, and listing what their pickles name), plus
#: containers and paths that torch may put into ``StorageMeta``; nothing that can run code.
ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                                   "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    f"{_DCP}.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}) | _DTYPES,
    "torch.serialization": frozenset({"_get_layout"}),  # "torch.strided" -> torch.strided (a table look-up)
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath"}),
}

_UNTRUSTED_FIX = ("it was not loaded: unpickling it could run code -> load only checkpoints from a source you trust; "
                  "a genuine megatron-core checkpoint's metadata names only torch.distributed.checkpoint classes, "
                  "so re-save the weights with workbench (or `workbench convert`) from a trusted copy")


class _StandIn:
    """An inert object for an admitted class when parsing without torch: it records what it was given."""

    _wb_global: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
            self.__dict__.update(slots or {})
        if isinstance(state, dict):
            self.__dict__.update(state)


_STAND_INS: dict[tuple[str, str], type] = {}


def _stand_in(module: str, name: str) -> type:
    key = (module, name)
    if key not in _STAND_INS:
        _STAND_INS[key] = type(name, (_StandIn,), {"_wb_global": key, "__module__": "workbench.run.integrity.standin"})
    return _STAND_INS[key]


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`ALLOWED_GLOBALS`.

    ``real=False`` gives inert stand-ins instead of the classes (no torch import), enough to
    prove what the file refers to and to read its storage index.
    """

    def __init__(self, file: BinaryIO, *, source: str, real: bool = True) -> None:
        super().__init__(file)
        self.source = source
        self.real = real

    def find_class(self, module: str, name: str) -> Any:
        if name not in ALLOWED_GLOBALS.get(module, ()):
            raise CheckpointError(f"{self.source} refers to {module}.{name}, which checkpoint metadata never holds; {_UNTRUSTED_FIX}")
        if not self.real:
            return _stand_in(module, name)
        obj = getattr(importlib.import_module(module), name)
        if module == "torch" and name != "Size":
            import torch

            if not isinstance(obj, torch.dtype):
                raise CheckpointError(f"{self.source} refers to torch.{name}, which is not a dtype; {_UNTRUSTED_FIX}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference, which checkpoint metadata never holds; {_UNTRUSTED_FIX}")


def _load_metadata(fh: BinaryIO, source: str, real: bool) -> Any:
    try:
        return MetadataUnpickler(fh, source=source, real=real).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            MemoryError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{source} is damaged: it does not parse as checkpoint metadata ({type(e).__name__}: {e}) -> "
            "copy the checkpoint again from its source, or load an earlier iteration") from None


def read_dist_metadata(path: str | Path, *, real: bool = True) -> Any:
    """The ``.metadata`` of a dist checkpoint (``path``: the file or its directory), read with the allow-list."""
    p = Path(path)
    if p.is_dir():
        p = p / DIST_METADATA_FILE
    try:
        with open(p, "rb") as fh:
            return _load_metadata(fh, str(p), real)
    except FileNotFoundError:
        raise CheckpointError(f"{p} is missing: the checkpoint's index of its tensors is gone -> "
                              "copy the checkpoint again from its source, or load an earlier iteration") from None


def safe_torch_load(f: Any, *, source: str, allow: tuple = (), error: type[Exception] = CheckpointError,
                    fix: str = _UNTRUSTED_FIX, mmap: bool = False, map_location: str = "cpu") -> Any:
    """``torch.load`` of a file or buffer with an explicit ``weights_only=True`` (tensors, numbers, strings and
    containers; the environment's ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn it off), plus the classes
    in ``allow``.  ``error`` (default :class:`CheckpointError`) names ``source``: a file holding anything else
    is refused as untrusted (``fix`` says what to do), one that does not parse as damaged.  ``mmap``: the
    tensors are memory-mapped from the file (a path to a file in torch's zip format), read as they are touched.
    ``map_location="meta"``: the tensors' layouts only, no data read (each storage's ``_checkpoint_offset`` says
    where its data record starts in the file)."""
    import torch

    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise error(f"{source} holds more than tensors and plain data, which torch.load(weights_only=True) refuses "
                    f"({str(e).splitlines()[0]}); {fix}") from None
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, IndexError, KeyError, UnicodeDecodeError) as e:
        if isinstance(e, FileNotFoundError):
            raise error(f"{source} is missing -> check the path") from None
        first = str(e).splitlines()[0] if str(e) else ""
        raise error(f"{source} is damaged: it does not load as a torch file ({type(e).__name__}: {first}) "
                    "-> copy it again from its source") from None


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
    (:func:`~workbench.run.ckpt_layout.config_mismatch`).
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


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class HeldRange:
    """Bytes :meth:`ChecksummedReads.hold` read: :attr:`view` until :meth:`done` (thread-safe, once); the bytes'
    buffer is reused once :meth:`done` is called and their hash is taken.  ``writable``: the bytes are in memory of
    this process (not a read-only mapping of the file), so an array over them may be written."""

    def __init__(self, view: memoryview, let_go: Any, writable: bool = False, hashed: Any = None) -> None:
        self.view, self.writable = view, writable
        self._let_go, self._parts, self._lock, self._done = let_go, 2 if hashed is not None else 1, threading.Lock(), False
        if hashed is not None:
            hashed.add_done_callback(lambda _: self._part_done())

    def _part_done(self) -> None:
        with self._lock:
            self._parts -= 1
            last = self._parts == 0
        if last and self._let_go is not None:
            self._let_go()

    def done(self) -> None:
        """The caller no longer uses the bytes (a second call does nothing)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._part_done()


class ChecksummedReads:
    """Byte ranges of the files of checkpoint directory ``d``, read while their SHA-256 is taken: a conversion reads
    each byte once, where a verification followed by the conversion's own reads would read it twice.

    For a directory :func:`verify_checkpoint` has passed with ``hashes=False`` (names, sizes, byte ranges, the
    closed list of files).  The files of the checksum list not in ``streamed`` are hashed when it opens; each file
    of ``streamed`` as it is read: :meth:`read` hashes the bytes that continue the file from where its hash stands
    (a gap of up to :attr:`GAP` bytes is read and hashed first), and :meth:`finish` hashes whatever was not read in
    that order and compares every checksum.  A file that differs is the :class:`CheckpointError`
    :func:`verify_checkpoint` raises for it, when it opens or from :meth:`finish`; until :meth:`finish` returns,
    what was read is known only to have loaded as weights-only data, so the caller writes into a staging directory
    it removes when :meth:`finish` raises.  One thread reads at a time (a conversion's read thread): the hashes
    follow the order of the reads."""

    #: the largest stretch of a streamed file read (and hashed) only to keep its hash going
    GAP = 4 << 20
    #: a range at least this long is hashed on a helper thread while the caller uses it
    PARALLEL = 4 << 20
    #: how many ranges may still be hashing once the caller is done with them: the next ranges are read from the
    #: disk while the last are hashed, one per file of a checkpoint written in two (each keeps its buffer until hashed)
    BEHIND = 2

    def __init__(self, d: str | Path, streamed: Any) -> None:
        self.dir = Path(d)
        manifest = _manifest(self.dir)
        if manifest is None:
            raise CheckpointError(_unverifiable(self.dir))
        want: dict[str, str] = {}
        problems: list[str] = []
        for name, rec in sorted(manifest.items()):
            f = checkpoint_member(self.dir, name, source=str(self.dir / METADATA_FILE), what="the file", entry='its "files" list')
            sha = rec.get("sha256") if isinstance(rec, dict) else None
            if not sha:
                continue
            if name in streamed:
                want[name] = sha
            elif not f.is_file():
                problems.append(f"{f} is missing")
            elif _sha256(f) != sha:
                problems.append(_mismatch(f))
        if problems:
            raise _damaged(self.dir, problems)
        self._want = want
        self._sha = {n: hashlib.sha256() for n in want}
        self._pos = {n: 0 for n in want}
        self._fds: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pools: dict[str, Any] = {}
        self._behind: collections.deque = collections.deque()  # the hash futures of ranges not yet settled, oldest first
        self._direct: DirectReads | None = DirectReads(keep=self.BEHIND + 1)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = checkpoint_member(self.dir, name, source=f"checkpoint {self.dir}", what="the file")
            self._fds[name], self._paths[name] = os.open(path, os.O_RDONLY), str(path)
        return self._fds[name]

    def _pread(self, name: str, length: int, offset: int) -> bytes:
        fd = self._fd(name)
        data = os.pread(fd, length, offset)
        if 0 < len(data) < length:  # a read of more than the kernel hands out at once
            parts = [data]
            got = len(data)
            while got < length:
                more = os.pread(fd, length - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def _hash(self, name: str, offset: int, data: Any) -> None:
        """Take the bytes ``data`` at ``offset`` of ``name`` into its hash where they continue it (after a short gap)."""
        if name not in self._sha:
            return
        sha, pos = self._sha[name], self._pos[name]
        if pos < offset <= pos + self.GAP:
            sha.update(self._pread(name, offset - pos, pos))
            pos = offset
        if offset <= pos < offset + len(data):
            sha.update(data[pos - offset:])
            self._pos[name] = offset + len(data)

    @contextlib.contextmanager
    def view(self, name: str, offset: int, length: int) -> Iterator[memoryview]:
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed (a large range on a helper
        thread while the block runs); valid inside the block only (:meth:`hold`)."""
        held = self.hold(name, offset, length)
        try:
            yield held.view
        finally:
            held.done()

    def hold(self, name: str, offset: int, length: int) -> "HeldRange":
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed: a large range on a helper
        thread while the caller uses it (the reads go on meanwhile; at most :attr:`BEHIND` ranges still hashing).
        Read past the page cache into a reused buffer (:class:`workbench.run.direct_io.DirectReads`) where the file
        system allows (``writable``), else memory-mapped read-only (the kernel copies nothing; unmapped once let go,
        so the pages leave the process).  The caller calls :meth:`HeldRange.done` when it no longer uses the bytes;
        the buffer is reused once that is called and the hash is taken."""
        import mmap

        with self._lock:
            fd = self._fd(name)
            end = min(offset + length, os.fstat(fd).st_size)
        if end <= offset:
            return HeldRange(memoryview(b""), None)
        direct, pooled = self._direct, False
        dfd = direct.open(self._paths[name]) if direct is not None else None
        if dfd is not None and not _same_file(dfd, fd):  # the path names another file now: read the one opened
            dfd = None
        if dfd is not None:
            try:
                buf, mv = direct.read(dfd, offset, end - offset)
                pooled = True
            except OSError:  # refused after all: cached reads from now on
                self._direct = None
                direct.close()
        if not pooled:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            buf = mmap.mmap(fd, end - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ, offset=start)
            mv = memoryview(buf)[offset - start:]

        def let_go() -> None:
            try:
                mv.release()
            except BufferError:  # a caller's array of these bytes is being freed: it lets go of them itself
                pass
            if pooled:
                direct.release(buf)
            else:
                try:
                    buf.close()
                except BufferError:  # (as above: unmapped once the last view goes)
                    pass

        if len(mv) < self.PARALLEL and not self._behind:
            try:
                self._hash(name, offset, mv)
            except BaseException:
                let_go()
                raise
            return HeldRange(mv, let_go, writable=pooled)
        if name not in self._pools:  # a thread per file: files read side by side are hashed side by side
            self._pools[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-checksum")
        hashed = self._pools[name].submit(self._hash, name, offset, mv)  # one thread: in the order of the reads
        held = HeldRange(mv, let_go, writable=pooled, hashed=hashed)
        self._behind.append(hashed)
        self._settle(self.BEHIND)
        return held

    def _settle(self, keep: int) -> None:
        """Wait for the hashes still running until at most ``keep`` are (an error of one is raised here)."""
        while len(self._behind) > keep:
            self._behind.popleft().result()

    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed (:meth:`view`, copied out)."""
        with self.view(name, offset, length) as mv:
            return bytes(mv)

    def finish(self) -> None:
        """Hash the rest of every streamed file and compare; the :class:`CheckpointError` naming each that differs."""
        problems = []
        self._settle(0)
        with self._lock:
            for name, want in sorted(self._want.items()):
                sha, pos = self._sha[name], self._pos[name]
                while True:
                    block = self._pread(name, 16 << 20, pos)
                    if not block:
                        break
                    sha.update(block)
                    pos += len(block)
                self._pos[name] = pos
                if sha.hexdigest() != want:
                    problems.append(_mismatch(self.dir / name))
            self.close()
        if problems:
            raise _damaged(self.dir, problems)

    def close(self) -> None:
        while getattr(self, "_behind", None):  # after a failed read too: no buffer goes while its hash reads it
            try:
                self._settle(0)
            except Exception:  # noqa: BLE001  (closing after a failure: the failure is what is reported)
                pass
        for pool in getattr(self, "_pools", {}).values():
            pool.shutdown(wait=False)  # idle: every hash it ran was waited for (and this may run on its thread)
        self._pools = {}
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}
        if getattr(self, "_direct", None) is not None:
            self._direct.close()

    def __del__(self) -> None:
        self.close()


def record_checksums(d: str | Path) -> dict[str, dict[str, Any]]:
    """Record the checksum list of checkpoint directory ``d`` that has none (one saved without it): the files as
    they are now, for a copy the caller trusts.  Refused (:class:`CheckpointError`) when ``d`` already has a list,
    when its ``.metadata`` names a class outside the allow-list or any byte range it indexes is missing, and when
    it holds a file that a megatron-core save does not write.  Returns the list written into ``workbench.json``."""
    from workbench.run.files import write_json_atomic

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


# --------------------------------------------------------------------------- under torch's readers


_PATCH_LOCK = threading.RLock()
_patch_depth = 0
_saved: tuple = ()


def _safe_read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's ``FileSystemReader.read_metadata`` with :class:`MetadataUnpickler` instead of ``pickle.load``."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as fh:
        metadata = _load_metadata(fh, str(path), real=True)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _safe_load_bytes(self: Any, read_item: Any, value: Any) -> None:
    """torch's ``DefaultLoadPlanner.load_bytes`` with :func:`safe_torch_load` (torch passes ``weights_only=False``)."""
    from torch.distributed.checkpoint._traverse import set_element

    obj = safe_torch_load(value, source=f"checkpoint object {read_item.dest_index.fqn!r}")
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def _safe_load_common(checkpoint_dir: Any) -> Any:
    """megatron-core's ``load_common`` (a legacy ``common.pt``, which it loads with the environment's ``weights_only``)
    through :func:`safe_torch_load`."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException

    path = Path(str(checkpoint_dir)) / "common.pt"
    if not path.is_file():
        raise CheckpointingException(f"Common file {path} does not exist")
    return safe_torch_load(str(path), source=str(path))


def _megatron_common_loaders() -> list[tuple[Any, str]]:
    """(module, attribute) of each name megatron-core reads ``common.pt`` through (none without megatron-core)."""
    try:
        from megatron.core.dist_checkpointing import serialization
        from megatron.core.dist_checkpointing.strategies import common
    except ImportError:
        return []
    return [(m, "load_common") for m in (serialization, common) if hasattr(m, "load_common")]


@contextlib.contextmanager
def safe_dist_reading() -> Iterator[None]:
    """Within the block, torch's dist-checkpoint readers unpickle nothing outside the allow-list.

    ``FileSystemReader.read_metadata`` (and so megatron's cached subclass) reads ``.metadata`` with
    :class:`MetadataUnpickler`; ``DefaultLoadPlanner.load_bytes`` (megatron's planner inherits it)
    and megatron-core's ``load_common`` (a legacy ``common.pt``) load through :func:`safe_torch_load`.
    A refusal inside torch's load (which wraps it in its ``CheckpointException``) comes out as the
    :class:`CheckpointError`.  Re-entrant; restored on exit.
    """
    global _patch_depth, _saved
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    with _PATCH_LOCK:
        if _patch_depth == 0:
            common = _megatron_common_loaders()
            _saved = (FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes, [(m, a, getattr(m, a)) for m, a in common])
            FileSystemReader.read_metadata = _safe_read_metadata
            DefaultLoadPlanner.load_bytes = _safe_load_bytes
            for m, a in common:
                setattr(m, a, _safe_load_common)
        _patch_depth += 1
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:  # torch wraps a reader's errors (a BaseException): surface ours as they are
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise
    finally:
        with _PATCH_LOCK:
            _patch_depth -= 1
            if _patch_depth == 0:
                FileSystemReader.read_metadata, DefaultLoadPlanner.load_bytes, common = _saved
                for m, a, orig in common:
                    setattr(m, a, orig)
                _saved = ()

