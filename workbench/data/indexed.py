"""Checks for Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) before anything reads them.

megatron-core's ``IndexedDataset`` only ``assert``s on a bad header and happily memory-maps a
``.bin`` that does not match its ``.idx`` (garbage tokens, or a crash deep in a data loader).
:func:`check_indexed` reads the ``.idx`` layout written by megatron-core's ``_IndexWriter``
(header ``MMIDIDX\\x00\\x00``, version 1, dtype code, counts, lengths, pointers, document
indices) and verifies it against the ``.bin`` size, naming the file and the problem.

Also the sidecar ``PREFIX.workbench.json`` that ``workbench preprocess`` writes (tokenizer, counts,
max token id) so training can refuse data tokenized with a vocabulary larger than the model's.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from workbench.data.errors import DataError

__all__ = ["INDEX_HEADER", "DTYPE_CODES", "IndexInfo", "check_indexed", "sidecar_path", "read_sidecar", "strip_prefix"]

INDEX_HEADER = b"MMIDIDX\x00\x00"
#: megatron.core.datasets.indexed_dataset.DType codes -> numpy dtype names
DTYPE_CODES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8


@dataclass(frozen=True)
class IndexInfo:
    prefix: str
    dtype: str
    sequences: int
    documents: int  # number of documents (document_indices has documents + 1 entries)
    tokens: int
    bin_bytes: int


def strip_prefix(path: str | Path) -> str:
    """Accept PREFIX, PREFIX.bin or PREFIX.idx."""
    s = str(path)
    for suf in (".bin", ".idx"):
        if s.endswith(suf):
            return s[: -len(suf)]
    return s


def sidecar_path(prefix: str | Path) -> Path:
    return Path(f"{strip_prefix(prefix)}.workbench.json")


def read_sidecar(prefix: str | Path) -> dict | None:
    p = sidecar_path(prefix)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(str(p), f"not valid JSON ({e})", "delete it or re-run workbench preprocess") from None


def check_indexed(prefix: str | Path) -> IndexInfo:
    """Validate ``PREFIX.idx`` against ``PREFIX.bin``; :class:`DataError` naming the file otherwise."""
    import numpy as np

    prefix = strip_prefix(prefix)
    idx, binf = Path(prefix + ".idx"), Path(prefix + ".bin")
    missing = [str(p) for p in (idx, binf) if not p.is_file()]
    if missing:
        tmp = [str(p) for p in Path(prefix).parent.glob(Path(prefix).name + ".*.tmp*")] if Path(prefix).parent.is_dir() else []
        hint = "an interrupted `workbench preprocess` left only temporary files: re-run it" if tmp else "run `workbench preprocess ... --output-prefix PREFIX` first"
        raise DataError(", ".join(missing), "indexed dataset file not found", hint)
    size = idx.stat().st_size
    with open(idx, "rb") as fh:
        head = fh.read(_HEADER_BYTES)
    if len(head) < _HEADER_BYTES or head[:9] != INDEX_HEADER:
        raise DataError(str(idx), f"wrong header {head[:9]!r} (expected {INDEX_HEADER!r}): not a Megatron .idx file",
                        "re-create it with `workbench preprocess` (or megatron's preprocess_data.py)")
    version = struct.unpack("<Q", head[9:17])[0]
    if version != 1:
        raise DataError(str(idx), f"unsupported .idx version {version} (expected 1)", "re-create it with `workbench preprocess`")
    code = head[17]
    if code not in DTYPE_CODES:
        raise DataError(str(idx), f"unknown token dtype code {code}", "re-create it with `workbench preprocess`")
    dtype = np.dtype(DTYPE_CODES[code])
    seqs, docs = struct.unpack("<QQ", head[18:34])
    expected = _HEADER_BYTES + seqs * 4 + seqs * 8 + docs * 8
    if size not in (expected, expected + seqs):  # + seqs: multimodal mode bytes
        raise DataError(str(idx), f"truncated or corrupt: {size} bytes, but its counts ({seqs} sequences, {docs - 1 if docs else 0} documents) need {expected}",
                        "re-create it with `workbench preprocess`")
    mm = np.memmap(idx, mode="r", dtype=np.uint8)
    try:
        lengths = np.frombuffer(mm, dtype=np.int32, count=seqs, offset=_HEADER_BYTES)
        pointers = np.frombuffer(mm, dtype=np.int64, count=seqs, offset=_HEADER_BYTES + seqs * 4)
        doc_idx = np.frombuffer(mm, dtype=np.int64, count=docs, offset=_HEADER_BYTES + seqs * 12)
        tokens = int(lengths.sum(dtype=np.int64))
        bin_bytes = binf.stat().st_size
        if docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != seqs or (docs > 1 and np.any(np.diff(doc_idx) < 0)):
            raise DataError(str(idx), "document index is inconsistent with the sequence count", "re-create it with `workbench preprocess`")
        if np.any(lengths < 0):
            raise DataError(str(idx), "negative sequence lengths", "re-create it with `workbench preprocess`")
        if tokens * dtype.itemsize != bin_bytes:
            raise DataError(f"{idx} / {binf}", f".idx does not match .bin: the index describes {tokens} tokens x {dtype.itemsize} bytes = "
                            f"{tokens * dtype.itemsize} bytes, the .bin has {bin_bytes}",
                            "the pair comes from different runs or a copy was cut short: re-run `workbench preprocess`")
        if seqs:
            ends = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]]) * dtype.itemsize
            if not np.array_equal(ends, pointers):
                raise DataError(str(idx), "sequence pointers do not follow the sequence lengths", "re-create it with `workbench preprocess`")
    finally:
        del mm
    return IndexInfo(prefix=prefix, dtype=dtype.name, sequences=int(seqs), documents=int(docs) - 1, tokens=tokens, bin_bytes=bin_bytes)
