"""The event stream: the public contract between the backend and everything that watches it.

Every rank appends JSON lines to ``<run_dir>/events/rank-<r>.jsonl``, one object per line,
flushed per line so a notebook (or ``tail -f``) sees it at once.  Every record has

    {"event": KIND, "time": <unix seconds>, "rank": <global rank>, ...fields}

Kinds and their fields (all sizes in bytes, all times in seconds unless named *_ms):

- ``run_start``: config (dict), versions (dict), device, hostname, world_size, coords {tp, pp, dp},
  kernel_path (dict: attention, norm, optimizer, ...).
- ``step``: iteration, loss, lr, grad_norm, skipped, step_time, tokens_per_s, tflops_per_gpu, mfu,
  mem_allocated, mem_reserved, mem_peak.  Only ranks that hold the loss (last pipeline stage) fill loss.
- ``microbatch``: iteration, ops: list of {kind: "F"|"B", microbatch, chunk, start_ms, end_ms}
  (times relative to the step start, measured with CUDA events), sampled every K steps.
- ``eval``: iteration, loss, ppl.
- ``checkpoint``: iteration, path, seconds.
- ``error``: message, traceback, exception type.
- ``run_end``: status ("finished" | "stopped" | "failed"), iteration, seconds.

Readers must tolerate a partial last line (the writer may be mid-write): :class:`EventFollower`
only returns complete lines and resumes at the same byte offset next time.
This module must not import torch or megatron-core.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

KINDS = ("run_start", "step", "microbatch", "eval", "checkpoint", "error", "run_end")

__all__ = ["KINDS", "EventWriter", "EventFollower", "read_events", "events_dir", "event_file"]


def events_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "events"


def event_file(run_dir: str | Path, rank: int) -> Path:
    return events_dir(run_dir) / f"rank-{rank}.jsonl"


def _default(o: Any) -> Any:
    # numpy / torch scalars and paths end up here; keep the writer free of those imports.
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dict__"):
        return vars(o)
    return str(o)


class EventWriter:
    """Append-only JSON-lines writer for one rank. Cheap: one ``write`` + ``flush`` per event."""

    def __init__(self, run_dir: str | Path, rank: int):
        self.rank = rank
        self.path = event_file(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", buffering=1, encoding="utf-8")
        self.hostname = socket.gethostname()

    def emit(self, kind: str, **fields: Any) -> dict:
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; known: {KINDS}")
        record = {"event": kind, "time": time.time(), "rank": self.rank, **fields}
        self._fh.write(json.dumps(record, default=_default, allow_nan=True) + "\n")
        self._fh.flush()
        return record

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            try:
                os.fsync(self._fh.fileno())
            except OSError:
                pass
            self._fh.close()

    def __enter__(self) -> "EventWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class EventFollower:
    """Incrementally reads every rank's event file; returns only complete lines.

    Call :meth:`poll` as often as you like: each call returns the records written since the
    last one, across all ranks (files that appear later are picked up).  A line that is
    not yet terminated by a newline is left for the next poll; a corrupt complete line is
    skipped and counted in :attr:`bad_lines` rather than raised.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self.bad_lines = 0

    def poll(self) -> list[dict]:
        out: list[dict] = []
        d = events_dir(self.run_dir)
        if not d.is_dir():
            return out
        for path in sorted(d.glob("rank-*.jsonl"), key=_rank_of):
            off = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(off)
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self._offsets[path] = off + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for raw in lines[:-1]:
                if not raw.strip():
                    continue
                try:
                    out.append(json.loads(raw))
                except json.JSONDecodeError:
                    self.bad_lines += 1
        out.sort(key=lambda r: r.get("time", 0.0))
        return out

    def __iter__(self) -> Iterator[dict]:
        return iter(self.poll())


def _rank_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30


def read_events(run_dir: str | Path) -> list[dict]:
    """All complete events of a run directory, time-ordered."""
    return EventFollower(run_dir).poll()
