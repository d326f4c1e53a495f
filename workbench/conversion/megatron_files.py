"""The megatron side of streaming conversion: a workbench checkpoint's state-dict tensors read and written one at a
time, through the checkpoint package's DCP reader and writer (:mod:`workbench.checkpoint.dcp`).

Global tensors are keyed by megatron's sharded keys (layers stacked on a leading axis, TE-style norm names, SwiGLU's
``fc1`` as two halves), so a checkpoint written at one TP/PP loads at any other: TP split/merge and PP layer
placement happen when megatron-core loads it, never on disk.

Which stored chunk holds which state-dict tensor is megatron's own answer: :func:`model_layout` builds the
TP=1/PP=1 model of a config on the meta device (no memory) and reads its ``sharded_state_dict()`` (factories
applied), so the conversion never re-implements megatron's key naming.  Then

- :class:`CheckpointWriter` writes each state-dict tensor's chunks as it comes (:class:`~workbench.checkpoint.DcpWriter`),
  then the objects and the common state as megatron writes them, ``.metadata`` and ``metadata.json``;
  ``workbench.json`` (checksums, ``complete``) and the rename into place are :func:`workbench.checkpoint.finish_save`,
  the save's own last step.
- :class:`CheckpointReader` reads one state-dict tensor at a time from the stored chunks that overlap it
  (:class:`~workbench.checkpoint.DcpReader`: checked, and its checksums taken, as it reads), a vocabulary-sized
  tensor stored with other padding re-padded as a load does.

Peak memory of a read or a write: about two copies of the largest chunk it touches, whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.checkpoint import (DcpReader, DcpWriter, NOWHERE, common_unique_key, finish_save, iter_dir_name,
                                  partial_dir_name, pickled_list, remove_stale_partials, vocab_keys)
from workbench.config import RunConfig
from workbench.models.common.conversion_rules import TensorInfo
from workbench.models.common.one_process import cpu_build_config, model_overrides

__all__ = ["Piece", "Layout", "meta_model", "model_layout", "CheckpointWriter", "CheckpointReader"]


# --------------------------------------------------------------------------- the layout of a model's tensors


def _meta_mode() -> Any:
    """A torch function mode that puts every tensor a factory makes on the meta device (device arguments too:
    the CPU mode's patched factories hand torch a wrapped function, which ``torch.device('meta')`` misses)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._device import _device_constructors

    names = {f.__name__ for f in _device_constructors()}

    class MetaMode(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = dict(kwargs or {})
            if getattr(func, "__name__", None) in names:
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    return MetaMode()


def meta_model(cfg: RunConfig, dtype: str | None = None) -> Any:
    """The TP=1/PP=1 CPU-mode model of ``cfg`` with every parameter on the meta device (shapes, no memory); call
    inside :func:`workbench.models.common.one_process.single_process_group`."""
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    c = cpu_build_config(cfg, dtype)
    config = transformer_config(c, perform_initialization=False, **model_overrides(c))
    with _meta_mode():
        return build_model(c, config=config)


@dataclass(frozen=True)
class Piece:
    """One stored chunk of a state-dict tensor: stored tensor ``fqn`` of ``global_shape``, the chunk at ``offsets``
    of ``sizes`` (megatron's prepended layer axis included); ``view`` = (shape, stride, storage offset) of the
    chunk inside the state-dict tensor, None when it is the whole tensor."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    view: tuple | None


@dataclass
class Layout:
    """Where each state-dict tensor of a model lives in its checkpoint: ``infos`` (shape, dtype of each TP=1
    state-dict tensor, in the model's order), ``pieces`` (its chunks), ``objects`` (the model's stored objects:
    unique key -> value)."""

    infos: dict[str, TensorInfo]
    pieces: dict[str, list[Piece]]
    objects: dict[str, Any]


def _piece(sh: Any, base: Any) -> Piece:
    prepend = (1,) * sh.prepend_axis_num
    view = None
    if sh.data is not base:
        if not base.is_contiguous():
            raise ValueError(f"{sh.key}: a factory over a non-contiguous tensor")
        view = (tuple(sh.data.shape), tuple(sh.data.stride()), sh.data.storage_offset() - base.storage_offset())
    elif tuple(sh.local_shape) != tuple(base.shape):
        raise ValueError(f"{sh.key}: local shape {sh.local_shape} of a tensor of shape {tuple(base.shape)}")
    return Piece(sh.key, tuple(sh.global_shape), tuple(sh.global_offset), prepend + tuple(sh.local_shape), view)


def model_layout(cfg: RunConfig, dtype: str | None = None) -> Layout:
    """The :class:`Layout` of ``cfg``'s model as megatron-core's ``sharded_state_dict`` describes it at TP=1/PP=1
    (factories applied; every chunk checked to cover its stored tensor exactly once).  Needs a process group."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, is_main_replica
    from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity

    model = meta_model(cfg, dtype)
    infos: dict[str, TensorInfo] = {}
    pieces: dict[str, list[Piece]] = {}
    objects: dict[str, Any] = {}
    leaves: list[Any] = []
    for key, x in model.sharded_state_dict().items():
        if isinstance(x, ShardedObject):
            if is_main_replica(x.replica_id):
                objects[x.unique_key] = x.data
                leaves.append(x)
            continue
        if isinstance(x, ShardedTensorFactory):
            base, built = x.data, x.build()
            shs = list(built.values()) if isinstance(built, dict) else list(built) if isinstance(built, (list, tuple)) else [built]
        elif isinstance(x, ShardedTensor):
            base, shs = x.data, [x]
        else:
            raise ValueError(f"{key}: {type(x).__name__} in the model's sharded state dict")
        if any(not isinstance(s, ShardedTensor) or s.flattened_range is not None for s in shs):
            raise ValueError(f"{key}: not a plain sharded tensor")
        infos[key] = TensorInfo(tuple(base.shape), base.dtype)
        pieces[key] = [_piece(s, base) for s in shs if is_main_replica(s.replica_id)]
        leaves += shs
    validate_sharding_integrity(determine_global_metadata({"model": leaves})[1])
    return Layout(infos, pieces, objects)


# --------------------------------------------------------------------------- state-dict tensors of a checkpoint


class CheckpointWriter:
    """A workbench checkpoint iteration written tensor by tensor: :meth:`write` each TP=1 state-dict tensor of
    ``layout`` (any order), then :meth:`finish`.  Until then it lives in ``root/iter_XXXXXXX.tmp-...``."""

    def __init__(self, root: str | Path, iteration: int, layout: Layout) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for line in remove_stale_partials(self.root):  # what an earlier, killed save left behind
            print(f"[workbench] checkpoint {self.root}: {line}", flush=True)
        self.iteration = int(iteration)
        self.final = self.root / iter_dir_name(self.iteration)
        self.tmp = self.root / partial_dir_name(self.final.name, "tmp")
        self.tmp.mkdir()
        self.layout = layout
        self._dcp = DcpWriter(self.tmp)
        self._written: set[str] = set()

    @property
    def bytes_written(self) -> int:
        return self._dcp.bytes_written

    def abort(self) -> None:
        """Let go of the data file (a conversion that failed: the caller removes the directory it wrote into)."""
        self._dcp.abort()

    def write(self, key: str, t: Any) -> None:
        info = self.layout.infos.get(key)
        if info is None:
            raise ValueError(f"state dict does not match the model: unexpected {key!r}")
        if tuple(t.shape) != tuple(info.shape):
            raise ValueError(f"{key}: shape {tuple(t.shape)} but the model wants {tuple(info.shape)}")
        if key in self._written:
            raise ValueError(f"{key} written twice")
        t = t.to(info.dtype).contiguous()
        for p in self.layout.pieces[key]:
            chunk = t if p.view is None else t.as_strided(*p.view)
            self._dcp.tensor(p.fqn, p.global_shape, p.offsets, chunk.reshape(p.sizes))
        self._written.add(key)

    def finish(self, cfg: RunConfig, extra: dict | None = None, tokenizer: Any = None) -> Path:
        """The objects, the common state, ``.metadata``, ``metadata.json``, then ``workbench.json`` and the rename
        into place (the save's own last step); the final iteration directory."""
        from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        missing = [k for k in self.layout.infos if k not in self._written]
        if missing:
            raise ValueError(f"state dict does not match the model: missing {missing[:5]}")
        for key, value in self.layout.objects.items():
            self._dcp.object(key, pickled_list(value))
        common = {"workbench_extra": dict(extra or {}), "iteration": self.iteration}  # what save_checkpoint stores
        self._dcp.object(common_unique_key(), pickled_list(common))
        self._dcp.close()
        strategy = TorchDistSaveShardedStrategy()
        save_config(CheckpointingConfig(strategy.backend, strategy.version), str(self.tmp))
        finish_save(self.root, self.tmp, self.final, self.iteration, [None], cfg, None, None, extra, tokenizer, False,
                    hashed=self._dcp.hashed)
        return self.final


class CheckpointReader:
    """The TP=1 state-dict tensors of a workbench checkpoint (an iteration directory, verified by the caller), one at
    a time, each in ``layout``'s dtype (as a model of that layout holds them).  A vocabulary-sized tensor stored with
    other padding is read whole, its rows cut or zero-filled to the model's (as a load does)."""

    def __init__(self, path: str | Path, layout: Layout) -> None:
        self.layout = layout
        self.dcp = DcpReader(Path(path))
        self._vocab = set(vocab_keys())

    def finish(self) -> None:
        """After the last read: :meth:`DcpReader.finish` (the data files' checksums)."""
        self.dcp.finish()

    def close(self) -> None:
        """:meth:`DcpReader.close`."""
        self.dcp.close()

    def position(self, key: str) -> tuple[int, str]:
        """Where state-dict tensor ``key``'s bytes start (:meth:`DcpReader.position`): read in this order, the data
        files are read front to back."""
        return min((self.dcp.position(p.fqn, p.offsets, p.sizes) for p in self.layout.pieces[key]), default=(NOWHERE, ""))

    @property
    def extra(self) -> dict[str, Any]:
        """The checkpoint's ``workbench_extra`` (its common state, read with the weights-only loader)."""
        return dict(self.dcp.common.get("workbench_extra") or {})

    def read(self, key: str) -> Any:
        import torch

        info, pieces = self.layout.infos[key], self.layout.pieces[key]
        if len(pieces) == 1 and pieces[0].view is None:
            p = pieces[0]
            stored = self.dcp.tensors.get(p.fqn)
            if p.fqn in self._vocab and stored is not None and tuple(stored.size) != p.global_shape:
                t = self.dcp.region(p.fqn, (0,) * len(stored.size), tuple(stored.size))
                out = torch.zeros(info.shape, dtype=info.dtype)
                n = min(out.shape[0], t.shape[0])
                out[:n] = t[:n]
                return out
            return self.dcp.region(p.fqn, p.offsets, p.sizes).reshape(info.shape).to(info.dtype)
        out = torch.empty(info.shape, dtype=info.dtype)
        for p in pieces:
            view = out.as_strided(*p.view) if p.view is not None else out
            view.copy_(self.dcp.region(p.fqn, p.offsets, p.sizes).reshape(view.shape))
        return out
