"""Hugging Face weight files read and written one tensor at a time.

:class:`HFReader` lists a model directory's tensors (names, shapes, dtypes) from the safetensors headers (checked
by safetensors' ``safe_open``) and reads one tensor per call: its byte range goes from the disk straight into the
tensor's memory past the page cache (``O_DIRECT``, :func:`workbench.checkpoint.open_direct`);
where the file system refuses that, the file is opened with ``safe_open`` and closed again, so the memory map (whose
touched pages count as the process's resident memory while it is open) never holds more than that tensor.  ``pytorch_model*.bin`` files are pickles, loaded through :func:`workbench.checkpoint.safe_torch_load`
(tensors only, whatever the environment says); the reader holds one of them at a time, the one it read last.  A
file in torch's zip format (every ``torch.save`` since torch 1.6) is memory-mapped: opening it reads its pickled
index only and a tensor's bytes are read when that tensor is, so moving between files costs their indexes, not their
tensors, whatever order the tensors are asked for in.  An older (non-zip) file can only be loaded whole.

:class:`SafetensorsWriter` writes ``save_pretrained``'s layout (``model.safetensors``, or
``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``) from a plan of names, shapes
and dtypes known up front: each shard's header is written when the shard is opened, then its tensors as they
come, so no shard is ever held in memory.  Shards are written past the page cache where the file system allows
(:func:`workbench.checkpoint.open_for_writing`), each on disk when it is closed; otherwise through the cache, and
:meth:`SafetensorsWriter.close` waits until every shard is on disk (the shards before it go to disk in the
background while the next is written).
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from workbench.checkpoint import ALIGN, abandon, open_direct, open_for_writing, read_blocks
from workbench.models.common.conversion_rules import ConversionError, TensorInfo, strip_module_prefix

__all__ = ["weight_files", "HFReader", "SafetensorsWriter", "SAFETENSORS_DTYPES"]

#: safetensors dtype names -> torch dtype attribute names
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

_BIN_FIX = ("it was not loaded: unpickling it could run code -> use the model's safetensors weights, or re-save it "
            "as safetensors from a copy you trust")


def weight_files(hf_dir: str | Path) -> list[Path]:
    """The weight files of a local HF checkpoint: the files its index names, else its (sharded) safetensors, else
    its ``pytorch_model*.bin``; a ConversionError when there are none, or the index names a missing one or one
    outside the directory (an absolute path or one through ``..``; symlinks are followed, as a hub cache's
    snapshot is made of them)."""
    p = Path(hf_dir)
    files: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        idx = p / index_name
        if idx.is_file():
            wm = json.loads(idx.read_text()).get("weight_map", {})
            if not isinstance(wm, dict):
                raise ConversionError(f"{idx}: 'weight_map' is not a mapping of tensor names to files; it was not read "
                                      "-> use a model directory from a source you trust, or download it again")
            for f in wm.values():
                if not isinstance(f, str) or not f or "\x00" in f or Path(f).is_absolute() or ".." in Path(f).parts:
                    raise ConversionError(f"{idx} names weight file {f!r}, which is not a file of {p}; it was not read "
                                          "-> use a model directory from a source you trust, or download it again")
            files = [p / f for f in sorted(set(wm.values()))]
            break
    if not files:
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
    if not files:
        raise ConversionError(f"{p}: no model weights (*.safetensors or pytorch_model*.bin) -> save with model.save_pretrained(DIR)")
    for f in files:
        if not f.is_file():
            raise ConversionError(f"{f}: listed in the index but missing -> the download/copy is incomplete")
    return files


def load_bin(f: Path, *, mmap: bool = False) -> dict[str, Any]:
    """One ``pytorch_model*.bin``: tensors only (a pickle that names anything else is refused, naming the file);
    ``mmap``: its tensors memory-mapped, read when touched (a file in torch's zip format only)."""
    from workbench.checkpoint import safe_torch_load

    sd = safe_torch_load(str(f), source=str(f), error=ConversionError, fix=_BIN_FIX, mmap=mmap)
    if not isinstance(sd, dict):
        raise ConversionError(f"{f}: holds a {type(sd).__name__}, not a state dict -> save the model with save_pretrained")
    return sd


def _torch_dtype(name: str, f: Path, key: str) -> Any:
    import torch

    if name not in SAFETENSORS_DTYPES:
        raise ConversionError(f"{f}: tensor {key!r} has dtype {name}, which a model's weights never have -> "
                              "copy the model again from its source")
    return getattr(torch, SAFETENSORS_DTYPES[name])


class HFReader:
    """The tensors of a local HF model directory, by name (``module.`` prefixes stripped), read one at a time."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.files = weight_files(self.dir)
        self.infos: dict[str, TensorInfo] = {}
        self._where: dict[str, tuple[Path, str]] = {}
        self._bin: tuple[Path | None, dict[str, Any], bool] = (None, {}, False)
        self._spans: dict[tuple[Path, str], tuple[int, int]] = {}  # (file, key) -> (byte offset, length)
        for f in self.files:
            if f.suffix == ".safetensors":
                for key, info in self._safetensors_header(f).items():
                    self.infos[strip_module_prefix(key)] = info
                    self._where[strip_module_prefix(key)] = (f, key)
            else:
                for key, t in self._open_bin(f).items():
                    if hasattr(t, "shape"):
                        self.infos[strip_module_prefix(key)] = TensorInfo(tuple(t.shape), t.dtype)
                        self._where[strip_module_prefix(key)] = (f, key)

    def _open_bin(self, f: Path) -> dict[str, Any]:
        """The state dict of ``.bin`` file ``f``, now the one the reader holds (the one it held before let go first):
        memory-mapped when ``f`` is in torch's zip format, else loaded whole."""
        if self._bin[0] != f:
            self._bin = (None, {}, False)
            mapped = zipfile.is_zipfile(f)
            try:
                sd = load_bin(f, mmap=mapped)
            except ConversionError:
                if not mapped:
                    raise
                mapped, sd = False, load_bin(f)  # a zip torch cannot map: whole (a damaged file is refused here)
            self._bin = (f, sd, mapped)
        return self._bin[1]

    def _safetensors_header(self, f: Path) -> dict[str, TensorInfo]:
        """The tensors of safetensors file ``f`` (safetensors checks its header: offsets inside the file, sizes that
        fit the shapes); where each one's bytes lie in the file is kept for :meth:`_read_direct`."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(f), "pt") as fh:
                out = {}
                for key in fh.keys():
                    sl = fh.get_slice(key)
                    out[key] = TensorInfo(tuple(sl.get_shape()), _torch_dtype(sl.get_dtype(), f, key))
        except SafetensorError as e:
            raise ConversionError(f"{f}: not a readable safetensors file ({e}) -> copy the model again from its source") from None
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for key, info in out.items():
            begin, end = header[key]["data_offsets"]
            if end - begin == info.nbytes:
                self._spans[(f, key)] = (8 + n + begin, end - begin)
        return out

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def read(self, name: str) -> Any:
        """Tensor ``name`` (a fresh CPU tensor)."""
        f, key = self._where[name]
        if f.suffix == ".safetensors":
            t = self._read_direct(f, key, self.infos[name])
            if t is not None:
                return t
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(f), "pt") as fh:  # closed again at once: its mapped pages leave this process
                    return fh.get_tensor(key)
            except SafetensorError as e:
                raise ConversionError(f"{f}: tensor {key!r} cannot be read ({e}) -> copy the model again from its source") from None
        t = self._open_bin(f)[key]
        return t.clone() if self._bin[2] else t  # a copy: the mapped file is let go with the reader's next file

    def _read_direct(self, f: Path, key: str, info: TensorInfo) -> Any:
        """Tensor ``key`` of safetensors file ``f`` read past the page cache straight into the tensor's own memory (the
        blocks around its bytes, into a fresh allocation aligned for ``O_DIRECT``; the tensor is a view of its bytes
        there): no copy, no buffer kept.  None where the file system refuses that."""
        import torch

        span = self._spans.get((f, key))
        fd = open_direct(str(f)) if span is not None else None
        if fd is None:
            return None
        offset, nbytes = span
        start = offset - offset % ALIGN
        stop = -(-(offset + nbytes) // ALIGN) * ALIGN
        base = torch.empty(stop - start + ALIGN, dtype=torch.uint8)
        pad = -base.data_ptr() % ALIGN
        dst = base[pad:pad + stop - start].numpy()
        try:
            got = read_blocks(fd, dst, start)
        except OSError:
            return None
        finally:
            os.close(fd)
        lo = offset - start
        if got < lo + nbytes:
            raise ConversionError(f"{f} is truncated: tensor {key!r} needs bytes up to {offset + nbytes} -> copy the "
                                  "model again from its source")
        raw = base[pad + lo:pad + lo + nbytes]
        if (pad + lo) % torch.empty(0, dtype=info.dtype).element_size():  # bytes not at an element boundary: copy
            raw = raw.clone()
        return raw.view(info.dtype).reshape(info.shape)

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """(name, tensor) of every tensor, one at a time, file by file (the file the reader holds first)."""
        held = self._bin[0]
        for name in sorted(self.infos, key=lambda n: (self._where[n][0] != held, str(self._where[n][0]), n)):
            yield name, self.read(name)

    def check(self) -> int:
        """Read every tensor once (each file loads as tensors only, else the ConversionError naming it); how many."""
        n = 0
        for _ in self.tensors():
            n += 1
        return n


# --------------------------------------------------------------------------- writing


def _safetensors_dtype(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    for k, v in SAFETENSORS_DTYPES.items():
        if v == name:
            return k
    raise ValueError(f"dtype {dtype} has no safetensors name")


class SafetensorsWriter:
    """Write the tensors of ``plan`` (name -> info, in the order they will come) into ``out_dir`` as
    ``save_pretrained`` does: shards of at most ``max_shard_size`` bytes (a tensor larger than that gets a shard of
    its own) and an index when there is more than one.  :meth:`write` takes them one at a time in plan order."""

    def __init__(self, out_dir: Path, plan: Mapping[str, TensorInfo], max_shard_size: int) -> None:
        self.out_dir = Path(out_dir)
        shards: list[list[str]] = [[]]
        size = 0
        for name, info in plan.items():
            if shards[-1] and size + info.nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += info.nbytes
        self.plan = dict(plan)
        self.shards = shards
        self.names = (["model.safetensors"] if len(shards) == 1 else
                      [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        self._order = [(s, name) for s, names in enumerate(shards) for name in names]
        self._next = 0
        self._shard = -1
        self._fh: Any = None

    def _close_file(self, abort: bool = False) -> None:
        if self._fh is not None:
            fh, self._fh = self._fh, None
            if abort:
                abandon(fh)
            else:
                fh.close()  # a cached file goes to the disk in the background; close() waits for every shard

    def _open(self, s: int) -> None:
        self._close_file()
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in self.shards[s]:
            info = self.plan[name]
            header[name] = {"dtype": _safetensors_dtype(info.dtype), "shape": list(info.shape),
                            "data_offsets": [offset, offset + info.nbytes]}
            offset += info.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._fh = open_for_writing(str(self.out_dir / self.names[s]))
        self._fh.write(struct.pack("<Q", len(text)))
        self._fh.write(text)
        self._shard = s

    def write(self, name: str, t: Any) -> None:
        if self._next >= len(self._order) or self._order[self._next][1] != name:
            want = self._order[self._next][1] if self._next < len(self._order) else "nothing"
            raise ValueError(f"tensor {name!r} written out of plan order (expected {want!r})")
        info = self.plan[name]
        if tuple(t.shape) != tuple(info.shape) or t.dtype != info.dtype:
            raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, planned {info.shape} {info.dtype}")
        s = self._order[self._next][0]
        if s != self._shard:
            self._open(s)
        import torch

        flat = t.contiguous().reshape(-1)
        self._fh.write(memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b"")
        self._next += 1

    def abort(self) -> None:
        """Let go of the open shard (a conversion that failed: its staging directory is removed)."""
        self._close_file(abort=True)

    def close(self) -> list[str]:
        """Finish the last shard and write the index; the shard file names."""
        if self._next != len(self._order):
            raise ValueError(f"{len(self._order) - self._next} planned tensors were never written "
                             f"(next: {self._order[self._next][1]!r})")
        self._close_file()
        if len(self.shards) == 1 and not self.shards[0]:  # an empty plan: an empty (valid) file
            self._open(0)
            self._close_file()
        for name in self.names:  # on disk before the output is renamed into place (no wait between shards)
            fd = os.open(self.out_dir / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if len(self.shards) > 1:
            weight_map = {name: self.names[s] for s, name in self._order}
            total = sum(self.plan[n].nbytes for n in weight_map)
            (self.out_dir / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        return list(self.names)
