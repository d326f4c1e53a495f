"""Safe reading of checkpoint files: nothing in a checkpoint can run code.

megatron-core's dist checkpoints are read by torch's ``FileSystemReader.read_metadata``, a plain ``pickle.load`` of
``.metadata``, and torch's load planner unpickles the stored objects (``_extra_state``, the common state) with
``torch.load(weights_only=False)``: opening a checkpoint from someone else could run any code.
:class:`MetadataUnpickler` admits only the classes a dist checkpoint's ``.metadata`` holds (:data:`ALLOWED_GLOBALS`:
``torch.distributed.checkpoint``'s metadata / planner / storage-info classes, ``torch.Size``, the dtypes, the layout
helper, a few containers) and refuses anything else with :class:`CheckpointError` naming the file.
:func:`safe_dist_reading` puts it under every torch reader for the duration of a workbench load (it patches torch's
and megatron-core's readers while the block runs), and :func:`safe_torch_load` (``torch.load`` with an explicit
``weights_only=True``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` cannot turn off) under the stored objects and a
legacy ``common.pt``, which megatron-core would otherwise unpickle with whatever the environment says.  Every other
pickled file the workbench opens (HF ``pytorch_model.bin``, legacy Megatron-LM files, its own tensors files) goes
through :func:`safe_torch_load` too.

Torch-free at import: ``real=False`` parses ``.metadata`` with inert stand-ins for the admitted classes (so
:func:`workbench.checkpoint.integrity.verify_checkpoint` runs without torch); :func:`read_dist_metadata` with real
classes, :func:`safe_torch_load` and :func:`safe_dist_reading` import torch when called.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import threading
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from workbench.checkpoint.names import CheckpointError

__all__ = ["ALLOWED_GLOBALS", "DIST_METADATA_FILE", "MetadataUnpickler", "read_dist_metadata", "safe_dist_reading",
           "safe_torch_load"]

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
        _STAND_INS[key] = type(name, (_StandIn,), {"_wb_global": key, "__module__": "workbench.checkpoint.safe_load.standin"})
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
