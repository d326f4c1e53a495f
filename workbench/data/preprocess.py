"""Text -> Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``), written by megatron-core itself.

Documents are read in order, tokenized (in ``workers`` processes when > 1: workers tokenize
batches, the parent writes them in input order) and appended with megatron-core's
``IndexedDatasetBuilder``, one sequence per document, so megatron-core's ``IndexedDataset``
reads the result unchanged.  With ``split_sentences`` (Megatron-LM's ``--split-sentences``, what
BERT's datasets read) each document is cut into sentences by :func:`workbench.data.sentences.split_sentences`
and stored as one sequence per sentence inside its document.

Crash safety: everything is written under temporary names; at the end the old ``.idx`` is
removed first, then the ``.bin``, the sidecar and finally the ``.idx`` are renamed into place.
An interrupted run therefore leaves either the previous complete pair, or a ``.bin`` without
``.idx`` (which megatron-core and :func:`check_indexed` refuse) - never an ``.idx`` that looks valid.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from workbench.data.errors import DataError
from workbench.data.sources import InvalidPolicy, ReadStats, SplitDocs, iter_documents, resolve_inputs, uncompressed_size
from workbench.data.tokenizer import Tokenizer, load_tokenizer
from workbench.writable import dir_write_problem

__all__ = ["PreprocessSummary", "preprocess", "token_dtype", "SIDECAR_FORMAT"]

SIDECAR_FORMAT = "workbench-indexed-v1"
_BATCH_DOCS = 64
_BATCH_BYTES = 1 << 20


@dataclass
class PreprocessSummary:
    prefix: str
    files: int
    documents: int
    tokens: int
    bytes: int
    seconds: float
    workers: int
    dtype: str
    max_token_id: int
    invalid_utf8: int = 0
    invalid_utf8_where: list[str] = field(default_factory=list)
    empty_skipped: int = 0
    tokenizer: dict = field(default_factory=dict)
    #: sequences written: sentences with split_sentences, else one per document
    sequences: int = 0
    split_sentences: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        return d

    def __str__(self) -> str:
        lines = [f"wrote {self.prefix}.bin / .idx ({self.dtype})",
                 f"  files {self.files}  documents {self.documents:,}  tokens {self.tokens:,}  bytes {self.bytes:,}"
                 + (f"  sentences {self.sequences:,}" if self.split_sentences else ""),
                 f"  {self.seconds:.2f} s  ({self.tokens_per_s:,.0f} tokens/s, {self.workers} worker{'s' if self.workers != 1 else ''})"]
        if self.empty_skipped:
            lines.append(f"  skipped {self.empty_skipped} empty JSON record(s)")
        if self.invalid_utf8:
            lines.append(f"  WARNING: {self.invalid_utf8} line(s) with invalid UTF-8 (first at {', '.join(self.invalid_utf8_where)})")
        return "\n".join(lines)


def token_dtype(vocab_size: int):
    """megatron-core's choice: uint16 when the vocabulary fits, else int32."""
    import warnings

    with warnings.catch_warnings():  # megatron-core's import warns about missing TE / apex
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


# ---- worker side (kept at module level so 'spawn' workers can import it cheaply)

_WORKER: dict = {}


def _worker_init(tokenizer: Tokenizer, append_eod: bool, dtype_name: str, split_sentences: bool = False) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tokenizer=tokenizer, append_eod=append_eod, dtype=dtype_name, split=split_sentences)


def _encode_batch(texts: list[str]) -> list:
    """Per document: (token array, sequence lengths): one sequence, or one per sentence."""
    import numpy as np

    tok: Tokenizer = _WORKER["tokenizer"]
    eod = tok.eod if _WORKER["append_eod"] else None
    out = []
    for text in texts:
        if _WORKER.get("split"):
            from workbench.data.sentences import split_sentences

            pieces = [ids for ids in tok.encode_batch(split_sentences(text)) if ids]
        else:
            pieces = [tok.encode(text)]
        if eod is not None and pieces:
            pieces[-1] = pieces[-1] + [eod]
        lengths = [len(p) for p in pieces if p]
        ids = [i for p in pieces for i in p]
        out.append((np.asarray(ids, dtype=_WORKER["dtype"]), lengths))
    return out


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for d in docs:
        batch.append(d)
        size += len(d)
        if len(batch) >= _BATCH_DOCS or size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# ---- parent side


def _ordered(pool, batches: Iterator[list[str]], window: int) -> Iterator[list]:
    """Results in input order with at most ``window`` batches in flight.

    (``Pool.imap`` would read the whole input into its task queue ahead of the workers: unbounded
    memory on a large corpus, and a progress bar that measures reading, not tokenizing.)
    """
    from collections import deque

    pending: deque = deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch, (batch,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _tmp(path: str) -> str:
    """Unique per process and host: several nodes may build the same prefix on a shared filesystem."""
    import socket

    return f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"


def _remove_stale_tmp(*finals: str) -> None:
    """Temporary files of a run on this host that was killed (SIGKILL, power loss: no ``finally``)."""
    import glob
    import socket

    host = socket.gethostname()
    for final in finals:
        for f in glob.glob(glob.escape(f"{final}.tmp-{host}-") + "*"):
            pid = f.rsplit("-", 1)[-1]
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                try:
                    os.remove(f)
                except OSError:
                    pass
            except PermissionError:
                pass  # alive, someone else's


def _make_output_dir(out_dir: Path, output_prefix: str | Path) -> None:
    """Make the output's directory; one that cannot be written is a DataError before any input is read (not a failed
    write at the end)."""
    why = dir_write_problem(out_dir)
    if why:
        raise DataError("--output-prefix", f"{output_prefix}: {why}", "choose an --output-prefix in a directory you can write")
    out_dir.mkdir(parents=True, exist_ok=True)


def _checked_tokenizer(tokenizer: "str | Tokenizer", append_eod: bool, workers: int,
                       model_vocab_size: int | None) -> Tokenizer:
    """Load the tokenizer; refuse one larger than the model's vocabulary, a missing EOD, or fewer than one worker."""
    tok = load_tokenizer(tokenizer)
    if model_vocab_size is not None and tok.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer {tok.name}", f"vocabulary of {tok.vocab_size} tokens exceeds the model's vocab_size {model_vocab_size}",
                        f"set model.vocab_size >= {tok.vocab_size}, or use a smaller tokenizer")
    if append_eod and not tok.has_eod:
        tok.eod  # raises the DataError that says what is missing
    if workers < 1:
        raise DataError("--workers", f"must be >= 1 (got {workers})", "use 1 for in-process tokenization")
    return tok


def _output_prefix(output_prefix: str | Path) -> str:
    """The prefix without a trailing ``.bin`` / ``.idx``, with its directory made (or a DataError if unwritable)."""
    prefix = str(output_prefix)
    for suf in (".bin", ".idx"):
        if prefix.endswith(suf):
            prefix = prefix[: -len(suf)]
    _make_output_dir(Path(prefix).parent, output_prefix)
    return prefix


def _encoded(docs: Iterator[str], tok: Tokenizer, append_eod: bool, dtype_name: str, split_sentences: bool,
             workers: int) -> tuple[Iterator[list], object]:
    """Encoded batches in input order, in-process or from ``workers`` spawned processes: (results, pool or None)."""
    if workers == 1:
        _worker_init(tok, append_eod, dtype_name, split_sentences)
        return map(_encode_batch, _batches(docs)), None
    import multiprocessing as mp

    pool = mp.get_context("spawn").Pool(workers, initializer=_worker_init,
                                        initargs=(tok, append_eod, dtype_name, split_sentences))
    return _ordered(pool, _batches(docs), window=4 * workers), pool


def _add_documents(builder, results: Iterator[list], bar) -> tuple[int, int, int, int]:
    """Append every non-empty document to ``builder``: (documents, sequences, tokens, max token id)."""
    documents = tokens = sequences = 0
    max_id = -1
    for arrays in results:
        for arr, lengths in arrays:
            if arr.size == 0:
                continue
            builder.add_document(arr, lengths)
            documents += 1
            sequences += len(lengths)
            tokens += int(arr.size)
            max_id = max(max_id, int(arr.max()))
        bar.set_postfix(docs=documents, tokens=tokens, refresh=False)
    return documents, sequences, tokens, max_id


def _commit(summary: PreprocessSummary, extra: dict, tmps: tuple[str, str, str], finals: tuple[str, str, str]) -> None:
    """Write the sidecar, then move ``.bin``, sidecar and finally ``.idx`` into place (old ``.idx`` removed first)."""
    bin_tmp, idx_tmp, side_tmp = tmps
    bin_final, idx_final, side_final = finals
    meta = {"format": SIDECAR_FORMAT, **summary.to_dict(), **extra, "created": time.time()}
    Path(side_tmp).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    # Commit: the .idx goes last, so a half-finished commit never looks like a valid dataset.
    if os.path.exists(idx_final):
        os.remove(idx_final)
    os.replace(bin_tmp, bin_final)
    os.replace(side_tmp, side_final)
    os.replace(idx_tmp, idx_final)


def _clean_up(bar, pool, builder, tmps: tuple[str, ...]) -> None:
    """Close the progress bar, stop a pool still running, close an unfinished builder and remove temporary files."""
    bar.close()
    if pool is not None:
        pool.terminate()
        pool.join()
    if builder is not None:
        try:
            builder.data_file.close()
        except Exception:
            pass
    for f in tmps:
        if os.path.exists(f):
            os.remove(f)


def preprocess(inputs: "list[str | Path] | str | Path", output_prefix: str | Path, tokenizer: "str | Tokenizer" = "demo",
               json_key: str = "text", append_eod: bool = True, workers: int = 1, split_docs: SplitDocs = "blank-line",
               invalid_utf8: InvalidPolicy = "replace", model_vocab_size: int | None = None,
               progress: bool = True, split_sentences: bool = False) -> PreprocessSummary:
    """Tokenize ``inputs`` into ``output_prefix``.bin/.idx; returns the summary (also stored as a sidecar)."""
    import numpy as np

    from workbench.noise import progress_bar  # a text bar in a notebook kernel, no widget

    paths = resolve_inputs(inputs)
    tok = _checked_tokenizer(tokenizer, append_eod, workers, model_vocab_size)
    prefix = _output_prefix(output_prefix)

    dtype = token_dtype(tok.vocab_size)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    finals = (prefix + ".bin", prefix + ".idx", str(Path(prefix + ".workbench.json")))
    tmps = tuple(_tmp(f) for f in finals)
    _remove_stale_tmp(*finals)
    stats = ReadStats()
    total_bytes = sum(uncompressed_size(p) for p in paths)
    bar = progress_bar(total=total_bytes, unit="B", unit_scale=True, desc=f"preprocess {Path(prefix).name}",
                       disable=not progress)
    t0 = time.perf_counter()
    pool = None
    builder = None
    try:
        builder = IndexedDatasetBuilder(tmps[0], dtype=dtype)
        docs = iter_documents(paths, json_key=json_key, split_docs=split_docs, stats=stats, invalid_utf8=invalid_utf8, progress=bar)
        results, pool = _encoded(docs, tok, append_eod, np.dtype(dtype).name, split_sentences, workers)
        documents, sequences, tokens, max_id = _add_documents(builder, results, bar)
        if pool is not None:
            pool.close()
            pool.join()
            pool = None
        builder.finalize(tmps[1])
        builder = None
        seconds = time.perf_counter() - t0
        if documents == 0:
            raise DataError(", ".join(map(str, paths)), "no tokens produced (every document tokenized to nothing)", "check the inputs and --json-key")
        summary = PreprocessSummary(prefix=prefix, files=stats.files, documents=documents, tokens=tokens, bytes=stats.bytes,
                                    seconds=seconds, workers=workers, dtype=np.dtype(dtype).name, max_token_id=max_id,
                                    invalid_utf8=stats.invalid_utf8, invalid_utf8_where=list(stats.invalid_utf8_where),
                                    empty_skipped=stats.empty_skipped, tokenizer=tok.spec(), sequences=sequences,
                                    split_sentences=split_sentences)
        _commit(summary, {"append_eod": append_eod, "json_key": json_key, "split_docs": split_docs,
                          "inputs": [str(p) for p in paths]}, tmps, finals)
        return summary
    finally:
        _clean_up(bar, pool, builder, tmps)
