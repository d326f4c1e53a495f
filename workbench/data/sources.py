"""Reading raw documents: plain text and JSON lines, optionally gzip-compressed.

Inputs may be files, directories (searched recursively for .txt/.text/.md/.jsonl/.json and their
.gz forms) or glob patterns.  Plain text splits into documents at blank lines (default) or at
every line; JSON lines take one document per line from ``json_key``.

Every problem names the file (and line): a missing or empty file, a JSON line without the key,
invalid JSON.  Invalid UTF-8 is *counted* and reported with its first locations; the policy
decides whether the text is kept with replacement characters (default), skipped, or fatal.
"""

from __future__ import annotations

import glob
import gzip
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Literal

from workbench.data.errors import DataError

__all__ = ["TEXT_SUFFIXES", "JSON_SUFFIXES", "ReadStats", "resolve_inputs", "iter_documents", "uncompressed_size"]

TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
SplitDocs = Literal["blank-line", "line"]
InvalidPolicy = Literal["replace", "skip", "error"]


@dataclass
class ReadStats:
    """What the reader saw; the preprocess summary reports it."""

    files: int = 0
    documents: int = 0
    bytes: int = 0  # raw (uncompressed) bytes read
    invalid_utf8: int = 0  # lines with invalid UTF-8
    invalid_utf8_where: list[str] = field(default_factory=list)  # first few "file:line"
    empty_skipped: int = 0  # JSON records whose text is empty/whitespace

    def note_invalid(self, where: str) -> None:
        self.invalid_utf8 += 1
        if len(self.invalid_utf8_where) < 5:
            self.invalid_utf8_where.append(where)


def _base_suffix(p: Path) -> str:
    name = p.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    return Path(name).suffix


def _is_data_file(p: Path) -> bool:
    return _base_suffix(p) in TEXT_SUFFIXES + JSON_SUFFIXES


def resolve_inputs(inputs: "list[str | Path] | str | Path") -> list[Path]:
    """FILE | DIR | GLOB (one or several) -> sorted list of files. Errors name what was not found."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    if not inputs:
        raise DataError("--input", "no input given", "pass a file, a directory or a glob")
    out: list[Path] = []
    for item in inputs:
        s = str(item)
        p = Path(s).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and _is_data_file(f))
            if not found:
                raise DataError(s, "directory holds no .txt/.jsonl/.json (or .gz) files", "point --input at the data files")
            out.extend(found)
        elif any(ch in s for ch in "*?["):
            found = sorted(Path(f) for f in glob.glob(s, recursive=True) if Path(f).is_file())
            if not found:
                raise DataError(s, "glob matches no files", "check the pattern (quote it so the shell does not expand it)")
            out.extend(found)
        else:
            raise DataError(s, "input file not found", "check the path")
    seen: set[Path] = set()
    unique = []
    for f in out:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(f)
    for f in unique:
        if f.stat().st_size == 0:
            raise DataError(str(f), "empty file", "remove it from the inputs or fill it")
    return unique


def uncompressed_size(path: Path) -> int:
    """Size of the text inside (gzip's trailer for .gz; mod 4 GiB, good enough for a progress bar)."""
    if path.name.lower().endswith(".gz"):
        with open(path, "rb") as fh:
            fh.seek(-4, 2)
            return struct.unpack("<I", fh.read(4))[0]
    return path.stat().st_size


def _open(path: Path) -> IO[bytes]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decode(raw: bytes, where: str, stats: ReadStats, policy: InvalidPolicy) -> str | None:
    if raw.startswith(b"\xef\xbb\xbf") and where.endswith(":1"):
        raw = raw[3:]  # a UTF-8 byte-order mark is not part of the first document
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        stats.note_invalid(where)
        if policy == "error":
            raise DataError(where, f"invalid UTF-8 at byte {e.start} of the line ({e.reason})",
                            "fix the encoding (e.g. iconv -f latin1 -t utf-8), or use --invalid-utf8 replace|skip") from None
        if policy == "skip":
            return None
        return raw.decode("utf-8", errors="replace")


def _iter_text(path: Path, split_docs: SplitDocs, stats: ReadStats, policy: InvalidPolicy, progress=None) -> Iterator[str]:
    buf: list[str] = []
    with _open(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            stats.bytes += len(raw)
            if progress is not None:
                progress.update(len(raw))
            line = _decode(raw, f"{path}:{lineno}", stats, policy)
            if line is None:
                continue
            line = line.rstrip("\r\n")
            if split_docs == "line":
                if line.strip():
                    stats.documents += 1
                    yield line
                continue
            if line.strip():
                buf.append(line)
            elif buf:
                stats.documents += 1
                yield "\n".join(buf)
                buf = []
    if buf:
        stats.documents += 1
        yield "\n".join(buf)


def _iter_jsonl(path: Path, json_key: str, stats: ReadStats, policy: InvalidPolicy, progress=None) -> Iterator[str]:
    with _open(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            stats.bytes += len(raw)
            if progress is not None:
                progress.update(len(raw))
            where = f"{path}:{lineno}"
            line = _decode(raw, where, stats, policy)
            if line is None or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(where, f"not valid JSON ({e.msg} at column {e.colno})", "one JSON object per line") from None
            if not isinstance(record, dict):
                raise DataError(where, f"expected a JSON object, got {type(record).__name__}", "one JSON object per line")
            if json_key not in record:
                keys = ", ".join(sorted(record)) or "none"
                raise DataError(where, f"JSON line has no key '{json_key}' (keys: {keys})", "pass --json-key with the right field name")
            text = record[json_key]
            if not isinstance(text, str):
                raise DataError(where, f"'{json_key}' is a {type(text).__name__}, not a string", "store the document text as a string")
            if not text.strip():
                stats.empty_skipped += 1
                continue
            stats.documents += 1
            yield text


def iter_documents(paths: list[Path], json_key: str = "text", split_docs: SplitDocs = "blank-line",
                   stats: ReadStats | None = None, invalid_utf8: InvalidPolicy = "replace", progress=None) -> Iterator[str]:
    """Yield documents from every file in order; ``stats`` is filled as a side effect."""
    if split_docs not in ("blank-line", "line"):
        raise DataError("--split-docs", f"unknown mode {split_docs!r}", "use blank-line or line")
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        stats.files += 1
        before = stats.documents
        if _base_suffix(path) in JSON_SUFFIXES:
            yield from _iter_jsonl(path, json_key, stats, invalid_utf8, progress)
        else:
            yield from _iter_text(path, split_docs, stats, invalid_utf8, progress)
        if stats.documents == before:
            raise DataError(str(path), "no documents in this file (only blank lines or empty records)", "remove it from the inputs or fill it")
