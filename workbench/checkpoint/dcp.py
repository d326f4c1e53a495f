"""torch's DCP (``torch_dist``) format, read and written by hand, one tensor chunk at a time.

A workbench checkpoint is a megatron-core ``torch_dist`` save: ``.metadata`` (torch's ``Metadata``: every
stored tensor's global shape and the chunks it was written in, each chunk's byte range), the data files
(``__0_0.distcp``, ``__0_1.distcp``: each chunk a ``torch.save`` of its own, each object a pickled list), megatron's
``metadata.json`` and the workbench's ``workbench.json``.

- :class:`DcpWriter` appends tensor chunks and objects to the data files as they come and writes ``.metadata`` when
  it closes; ``metadata.json``, ``workbench.json`` (checksums, ``complete``) and the rename into place are the
  caller's (:func:`workbench.checkpoint.dist.finish_save`, the save's own last step).  megatron-core's
  ``dist_checkpointing.load`` (training, generation, verification) reads the result as it reads its own saves.
  Chunks are saved without ``torch.save``'s zip CRC-32 (the data files' SHA-256 in the checksum list covers every
  byte; ``torch.load`` reads such a file, as ``torch.serialization.set_crc32_options`` documents); the data files
  are written past the page cache where the file system allows, hashed from the writers' own buffers
  (:class:`workbench.checkpoint.direct_io.DirectWriter`).
- :class:`DcpReader` reads a region of a stored tensor from the stored chunks that overlap it, each chunk through
  :func:`workbench.checkpoint.safe_load.safe_torch_load` and ``.metadata`` through the allow-list unpickler; every
  stored object and the common state are read the same way when it opens, so whatever a megatron-core load would
  refuse is refused here too.  When it opens, every byte range ``.metadata`` indexes is checked to lie in a file
  inside the checkpoint directory and within that file's size (:func:`workbench.checkpoint.integrity.storage_needs`),
  before any byte is read.  The caller checks the files first (:func:`workbench.checkpoint.checkpoint_info`, with
  ``hashes=False``); the reader checks the checksums as it reads
  (:class:`workbench.checkpoint.checksum_reads.ChecksummedReads`: the small files when it opens, the data files as
  their bytes go by), so each byte is read once, and :meth:`DcpReader.finish` compares them after the last read.
  :meth:`DcpReader.position` gives the order that reads the data files front to back.

Which stored chunk holds which state-dict tensor of a model is the conversion's
(:mod:`workbench.conversion.megatron_files`).  Peak memory of a read or a write: about two copies of the largest
chunk it touches, whatever the model size.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
import uuid
from pathlib import Path
from typing import Any

from workbench.checkpoint.direct_io import abandon, close_synced, open_for_writing
from workbench.checkpoint.names import CheckpointError

__all__ = ["DcpWriter", "DcpReader", "DATA_FILES", "NOWHERE", "common_unique_key", "pickled_list"]

#: the data files a conversion writes (as megatron-core's save with two writer threads names them): chunks go to the
#: one with fewer bytes so far, so each holds about half and a reader hashes both at once, each on its own thread
DATA_FILES = ("__0_0.distcp", "__0_1.distcp")
_COMMON_KEY = "common_state"


def common_unique_key() -> str:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(_COMMON_KEY, None, (1,), (0,)).unique_key


def pickled_list(value: Any) -> bytes:
    """A stored object as megatron-core writes it: ``torch.save`` of the list of its values."""
    import torch

    buf = io.BytesIO()
    torch.save([value], buf)
    return buf.getvalue()


# --------------------------------------------------------------------------- torch_dist files


class _HashingFile:
    """A binary file written front to back whose SHA-256 is taken as the bytes go out (no second read).  A file
    written past the page cache (:class:`workbench.checkpoint.direct_io.DirectWriter`) hashes its own staging buffers on a
    helper thread; otherwise a large write is hashed on a helper thread while the system call writes it (both
    without the GIL), and returns when both are done, so the caller's buffer is free again and the hash stays in
    write order."""

    _PARALLEL = 4 << 20  # smaller writes are hashed in line

    def __init__(self, fh: Any) -> None:
        self._fh, self._sha, self._size = fh, hashlib.sha256(), 0
        self._pool: Any = None
        self._inner = getattr(fh, "sha", None) is not None  # a DirectWriter that hashes its own buffers
        #: the first error a write raised (``torch.save`` reports one only as "unexpected pos")
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def _write(self, data: Any) -> int:
        if self._inner:
            n = self._fh.write(data)
        elif memoryview(data).nbytes < self._PARALLEL:
            self._sha.update(data)
            n = self._fh.write(data)
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-convert-hash")
            hashed = self._pool.submit(self._sha.update, data)
            try:
                n = self._fh.write(data)
            finally:
                hashed.result()
        self._size += n
        return n

    def tell(self) -> int:
        return self._fh.tell()

    def flush(self) -> None:
        self._fh.flush()

    def abort(self) -> None:
        """Close without flushing to disk (a write that failed: its directory is removed)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        abandon(self._fh)

    def close(self) -> tuple[int, str]:
        """Flush to disk, close; (size, sha256)."""
        if self._pool is not None:
            self._pool.shutdown()
        close_synced(self._fh)
        return self._size, (self._fh.sha if self._inner else self._sha).hexdigest()


_CRC_LOCK = threading.Lock()


def _crc_config() -> Any:
    from torch.utils.serialization import config

    return config.save


def _own_storage(t: Any) -> Any:
    """``t`` as a tensor whose storage is exactly its own bytes (what ``torch.save`` writes whole): ``t`` itself when it
    is, a tensor over the same memory (no copy) when ``t`` is a contiguous part of a larger storage, else a copy."""
    import torch

    nbytes = t.numel() * t.element_size()
    if not t.storage_offset() and t.is_contiguous() and t.untyped_storage().nbytes() == nbytes:
        return t
    if not t.is_contiguous():
        return t.contiguous()  # a fresh tensor of exactly its bytes
    if not nbytes or t.device.type != "cpu":
        return t.clone()
    raw = t.detach().reshape(-1).view(torch.uint8).numpy()  # the chunk's bytes, shared with t
    return torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).reshape(t.shape)


#: each stored chunk's ``torch.save`` bytes start at a multiple of this in the data file, so its tensor data (64-byte
#: aligned within them) is aligned in the file and in a page-aligned read of it: a reader makes the tensor over the
#: bytes read instead of copying them out (:func:`_load_chunk`)
_BLOB_ALIGN = 64
#: the position of what no stored chunk holds (read last)
NOWHERE = 1 << 62


class DcpWriter:
    """A torch_dist directory written item by item: tensor chunks and objects appended to its data files, the
    index (``.metadata``) written by :meth:`close`."""

    def __init__(self, d: Path) -> None:
        self.dir = Path(d)
        self._fhs: dict[str, _HashingFile] = {}
        try:
            for name in DATA_FILES:
                self._fhs[name] = _HashingFile(open_for_writing(str(self.dir / name), hashed=True))
        except BaseException:
            self.abort()
            raise
        #: {file name: (size, sha256)} of the files written, hashed as the bytes went out (the checksum list's)
        self.hashed: dict[str, tuple[int, str]] = {}
        self._md: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self.bytes_written = 0

    def _record(self, index: Any, name: str, start: int) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        end = self._fhs[name].tell()
        self._storage[index] = _StorageInfo(name, start, end - start)
        self.bytes_written += end - start

    def tensor(self, fqn: str, global_shape: tuple[int, ...], offsets: tuple[int, ...], chunk: Any) -> None:
        """Append ``chunk`` as the chunk of stored tensor ``fqn`` at ``offsets``."""
        import torch
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)

        md = self._md.get(fqn)
        if md is None:
            md = self._md[fqn] = TensorStorageMetadata(TensorProperties(dtype=chunk.dtype), torch.Size(global_shape), [])
        elif tuple(md.size) != tuple(global_shape) or md.properties.dtype != chunk.dtype:
            raise ValueError(f"{fqn}: chunks of different global shapes or dtypes")
        chunk = _own_storage(chunk)  # torch.save writes a tensor's whole storage: only the chunk's bytes
        md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(chunk.shape)))
        name = min(self._fhs, key=lambda n: self._fhs[n].tell())
        fh = self._fhs[name]
        gap = -fh.tell() % _BLOB_ALIGN
        if gap:  # unindexed zeros: the chunk's data (64-byte aligned in its torch.save bytes) lands aligned in the file
            fh.write(bytes(gap))
        start = fh.tell()
        crc = _crc_config()
        with _CRC_LOCK:  # torch's switch is the process's: one save at a time turns it off and back
            was, crc.compute_crc32 = crc.compute_crc32, False  # the file's SHA-256 covers these bytes
            try:
                torch.save(chunk, fh)
            except RuntimeError:
                if fh.error is not None:  # say what failed (a full disk, say), not torch's "unexpected pos"
                    raise fh.error from None
                raise
            finally:
                crc.compute_crc32 = was
        self._record(MetadataIndex(fqn, torch.Size(offsets)), name, start)

    def object(self, fqn: str, data: bytes) -> None:
        """Append a stored object's bytes (see :func:`pickled_list`)."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        if fqn in self._md:
            raise ValueError(f"object {fqn!r} written twice")
        self._md[fqn] = BytesStorageMetadata()
        name = DATA_FILES[0]
        start = self._fhs[name].tell()
        self._fhs[name].write(data)
        self._record(MetadataIndex(fqn), name, start)

    def abort(self) -> None:
        """Let go of the data files (a write that failed: its directory is removed)."""
        for fh in self._fhs.values():
            fh.abort()
        self._fhs = {}

    def close(self) -> None:
        """Flush the data files to disk and write ``.metadata`` (what torch's writer pickles)."""
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        for name, fh in self._fhs.items():
            self.hashed[name] = fh.close()
        md = Metadata(state_dict_metadata=self._md, planner_data=None, storage_data=self._storage,
                      storage_meta=StorageMeta(checkpoint_id=str(self.dir), save_id=str(uuid.uuid4()), load_id=None),
                      version=CURRENT_DCP_VERSION)
        with open(self.dir / ".metadata", "wb") as fh:
            pickle.dump(md, fh)
            fh.flush()
            os.fsync(fh.fileno())


def _overlap(a_off: tuple, a_size: tuple, b_off: tuple, b_size: tuple) -> list[tuple[int, int]] | None:
    """Per dimension [start, end) of the intersection of two boxes, None when they do not meet."""
    out = []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return out


class _BufferFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview that ``torch.load`` reads with ``readinto`` (straight into its
    tensors' memory); :meth:`close` lets go of the view."""

    def __init__(self, mv: memoryview) -> None:
        super().__init__()
        self._mv, self._pos = mv, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        import numpy as np

        dst = memoryview(b).cast("B")
        n = max(0, min(len(dst), len(self._mv) - self._pos))
        if n == 0:
            return 0
        # numpy's copy lets go of the GIL (a memoryview's slice assignment holds it): the other threads run meanwhile
        np.copyto(np.frombuffer(dst, np.uint8, n), np.frombuffer(self._mv, np.uint8, n, self._pos))
        self._pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, {0: pos, 1: self._pos + pos, 2: len(self._mv) + pos}[whence])
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        self._mv = memoryview(b"")
        super().close()


def _load_chunk(held: Any, source: str) -> Any:
    """The tensor a stored chunk (``torch.save`` bytes, :class:`workbench.checkpoint.checksum_reads.HeldRange`) holds.  Where the
    bytes are this process's memory, the tensor is made over them, not copied: its layout comes from a weights-only
    load onto the meta device (which reads no data and says where the data record starts); the buffer is let go
    when the tensor is freed.  Else (a read-only mapping of the file, or bytes the meta load cannot place) a
    weights-only load copies the data out and the bytes are let go at once."""
    import weakref

    import numpy as np
    import torch

    from workbench.checkpoint.safe_load import safe_torch_load

    def loaded(map_location: str) -> Any:
        f = _BufferFile(held.view)
        try:
            return safe_torch_load(f, source=source, map_location=map_location)
        finally:
            f.close()

    if held.writable:
        meta = loaded("meta")
        if not isinstance(meta, torch.Tensor):
            held.done()
            return meta
        storage = meta.untyped_storage()
        start, nbytes = getattr(storage, "_checkpoint_offset", None), storage.nbytes()
        if isinstance(start, int) and 0 <= start and start + nbytes <= len(held.view):
            arr = np.frombuffer(held.view, np.uint8, nbytes, start)
        else:
            arr = None
        if arr is not None and arr.ctypes.data % meta.element_size() == 0:  # else copied out: aligned elements
            weakref.finalize(arr, held.done)  # the buffer is reused once the last tensor over it is freed
            base = torch.from_numpy(arr) if nbytes else torch.empty(0, dtype=torch.uint8)
            try:
                return base.view(meta.dtype).as_strided(meta.size(), meta.stride(), meta.storage_offset())
            except RuntimeError as e:
                why = str(e).splitlines()[0]
            base = arr = None  # (let go of the bytes before the error travels)
            raise CheckpointError(f"{source} is damaged: its tensor does not fit its data ({why}) -> copy it again from "
                                  "its source")
        arr = None
    t = loaded("cpu")
    held.done()
    return t


class DcpReader:
    """The stored tensors of a torch_dist directory, read region by region: ``.metadata`` through the allow-list
    unpickler, each chunk through ``safe_torch_load``; every stored object (the common state included, or a
    legacy ``common.pt``) is read the same way when it opens."""

    def __init__(self, d: Path) -> None:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        from workbench.checkpoint.checksum_reads import ChecksummedReads
        from workbench.checkpoint.integrity import storage_needs
        from workbench.checkpoint.safe_load import read_dist_metadata

        self.dir = Path(d)
        # every small file hashed before it is parsed, the data files as they are read (finish() completes the check)
        self._reads = ChecksummedReads(self.dir, {p.name for p in self.dir.glob("*.distcp")})
        md = read_dist_metadata(self.dir)
        source = self.dir / ".metadata"
        try:
            need = storage_needs(self.dir, md, str(source))
        except TypeError as e:
            raise CheckpointError(f"{source} is damaged ({e}) -> copy the checkpoint again from its source") from None
        for rel, n in sorted(need.items()):
            path = self.dir / rel
            size = path.stat().st_size if path.is_file() else None
            if size is None or size < n:
                state = "missing" if size is None else f"truncated ({size} bytes)"
                raise CheckpointError(f"{path} is {state}: the byte ranges {source} indexes in it end at {n} -> copy the "
                                      "checkpoint again from its source")
        self.tensors: dict[str, Any] = {}
        self._chunks: dict[str, list[tuple[tuple, tuple, Any]]] = {}
        self._objects: dict[str, Any] = {}
        for fqn, smd in md.state_dict_metadata.items():
            if isinstance(smd, TensorStorageMetadata):
                self.tensors[fqn] = smd
                self._chunks[fqn] = []
            elif isinstance(smd, BytesStorageMetadata):
                self._objects[fqn] = None
        for index, info in md.storage_data.items():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{self.dir / info.relative_path}: stored with transforms "
                                      f"{info.transform_descriptors}, which the workbench does not read -> re-save it with megatron-core")
            if index.fqn in self._chunks:
                chunk = next(c for c in self.tensors[index.fqn].chunks if tuple(c.offsets) == tuple(index.offset))
                self._chunks[index.fqn].append((tuple(chunk.offsets), tuple(chunk.sizes), info))
            elif index.fqn in self._objects:
                self._objects[index.fqn] = info
        self.common = self._read_common()

    def _truncated(self, info: Any) -> CheckpointError:
        return CheckpointError(f"{self.dir / info.relative_path} is truncated: the checkpoint's index needs "
                               f"{info.offset + info.length} bytes -> copy the checkpoint again from its source")

    def _bytes(self, info: Any) -> bytes:
        data = self._reads.read(info.relative_path, info.offset, info.length)
        if len(data) != info.length:
            raise self._truncated(info)
        return data

    def _read_common(self) -> dict[str, Any]:
        from workbench.checkpoint.safe_load import safe_torch_load

        objects = {}
        for fqn, info in self._objects.items():
            if info is None:
                raise CheckpointError(f"{self.dir / '.metadata'} names object {fqn!r} but no bytes for it -> "
                                      "copy the checkpoint again from its source")
            objects[fqn] = safe_torch_load(io.BytesIO(self._bytes(info)), source=f"checkpoint object {fqn!r}")
        legacy = self.dir / "common.pt"
        if legacy.is_file():
            return safe_torch_load(str(legacy), source=str(legacy))
        common = objects.get(common_unique_key())
        return common[0] if isinstance(common, list) and common and isinstance(common[0], dict) else {}

    def _chunk(self, fqn: str, info: Any) -> Any:
        import torch

        source = f"{self.dir / info.relative_path} (tensor {fqn!r})"
        held = self._reads.hold(info.relative_path, info.offset, info.length)
        try:
            if len(held.view) != info.length:
                raise self._truncated(info)
            t = _load_chunk(held, source)
        except BaseException:
            held.done()
            raise
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{self.dir / info.relative_path}: the chunk of {fqn!r} holds a {type(t).__name__}, not a tensor "
                                  "-> copy the checkpoint again from its source")
        return t

    def finish(self) -> None:
        """After the last read: the checksums of the data files (hashed as they were read, the rest now) compared; the
        :class:`CheckpointError` naming a file that differs."""
        self._reads.finish()

    def close(self) -> None:
        """Let go of the data files' descriptors and the hashing thread (also after a failed read)."""
        self._reads.close()

    def position(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, str]:
        """(byte offset, file) of the first stored chunk of ``fqn`` that meets the box: reading in this order reads
        each file front to back, the files side by side (each hashed on its own thread meanwhile)."""
        hits = [(info.offset, info.relative_path) for o, s, info in self._chunks.get(fqn, ()) if _overlap(o, s, offsets, sizes)]
        return min(hits, default=(NOWHERE, ""))

    def region(self, fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Any:
        """The box at ``offsets`` of ``sizes`` of stored tensor ``fqn``, in its stored dtype."""
        import torch

        if fqn not in self.tensors:
            raise CheckpointError(f"checkpoint {self.dir} holds no tensor {fqn!r} -> is it a checkpoint of this model?")
        hits = [(o, s, info) for o, s, info in self._chunks[fqn] if _overlap(o, s, offsets, sizes)]
        if len(hits) == 1 and hits[0][0] == tuple(offsets) and hits[0][1] == tuple(sizes):
            return self._chunk(fqn, hits[0][2])
        out = torch.empty(sizes, dtype=self.tensors[fqn].properties.dtype)
        covered = 0
        for o, s, info in hits:
            box = _overlap(o, s, offsets, sizes)
            src = self._chunk(fqn, info)[tuple(slice(lo - co, hi - co) for (lo, hi), co in zip(box, o))]
            out[tuple(slice(lo - ro, hi - ro) for (lo, hi), ro in zip(box, offsets))] = src
            covered += src.numel()
            del src
        if covered != out.numel():
            raise CheckpointError(f"checkpoint {self.dir}: the stored chunks of {fqn!r} do not cover {tuple(offsets)} + "
                                  f"{tuple(sizes)} -> copy the checkpoint again from its source")
        return out
