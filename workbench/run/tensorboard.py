"""TensorBoard event files from a run's event records: live (``train.tensorboard``) or after the fact (:func:`export`).

One adapter, :func:`scalars`, turns a ``step`` or ``eval`` record (:mod:`workbench.run.events`) into TensorBoard
scalars; nothing is measured twice.  The tags (:data:`TAGS`, stable across versions):

- ``step`` records: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``perf/step_time_s``, ``perf/tokens_per_s``,
  ``perf/tflops_per_gpu``, ``perf/mfu_percent``, ``memory/allocated_gib``, ``memory/reserved_gib``,
  ``memory/peak_gib``, and the family's other train metrics as ``train/<name>`` (BERT's ``sop loss``:
  ``train/sop_loss``; a fine-tuning run's ``train/accuracy``);
- ``eval`` records: ``eval/loss``, ``eval/ppl`` and the family's eval metrics as ``eval/<name>``.

A field the record leaves empty (MFU and memory in CPU mode) writes nothing.  Each scalar's step is the record's
``iteration`` and its wall time the record's ``time``, so a live log and an export of the same run hold the same
points.  The values are the records' own (TensorBoard keeps them as float32).

The rank that logs (the last pipeline stage's tp 0, dp 0, cp 0: the one holding the loss) writes
``<run_dir>/tensorboard/`` while it trains (:class:`TensorBoardLog`, flushed at each logged step, closed at the end:
a killed run keeps what was flushed), so ``tensorboard --logdir runs/`` shows every run.  :func:`export` writes the
same files for a run that trained without it, from its event files.  The writer is the ``tensorboard`` package's own
event-file writer (the one torch's ``SummaryWriter`` wraps; the same ``simple_value`` scalars), imported only when a
log is opened: like the rest of :mod:`workbench.run` this stays torch-free, so an export from a notebook or the
command line does not import torch.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from workbench.run.events import Eval, Event, Step
from workbench.run.reader import RunReader, as_reader

__all__ = ["DIR_NAME", "TAGS", "tensorboard_dir", "scalars", "logged_records", "TensorBoardLog", "export",
           "ExportError"]

#: the folder of a run directory holding its TensorBoard event files
DIR_NAME = "tensorboard"
GIB = float(1 << 30)
#: a step / eval record's declared field -> (tag, factor applied to the stored value); fields not named here and not
#: in _NOT_SCALARS (a family's own metrics, in the record's ``extra``) are ``train/<name>`` / ``eval/<name>``
TAGS: dict[str, dict[str, tuple[str, float]]] = {
    "step": {"loss": ("train/loss", 1.0), "lr": ("train/lr", 1.0), "grad_norm": ("train/grad_norm", 1.0),
             "step_time": ("perf/step_time_s", 1.0), "tokens_per_s": ("perf/tokens_per_s", 1.0),
             "tflops_per_gpu": ("perf/tflops_per_gpu", 1.0), "mfu": ("perf/mfu_percent", 100.0),
             "mem_allocated": ("memory/allocated_gib", 1.0 / GIB), "mem_reserved": ("memory/reserved_gib", 1.0 / GIB),
             "mem_peak": ("memory/peak_gib", 1.0 / GIB)},
    "eval": {"loss": ("eval/loss", 1.0), "ppl": ("eval/ppl", 1.0)},
}
_PREFIX = {"step": "train/", "eval": "eval/"}
#: a record's fields that are not scalars: its identity, the x axis, flags
_NOT_SCALARS = {"event", "time", "rank", "iteration", "skipped", "consumed_samples", "extra"}


class ExportError(ValueError):
    """A run directory :func:`export` cannot write TensorBoard files for (the message says why and what to do)."""


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Where a run's TensorBoard event files are: ``<run_dir>/tensorboard``."""
    return Path(run_dir) / DIR_NAME


def _tag_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip()) or "_"


def scalars(rec: Event) -> list[tuple[str, float]]:
    """The TensorBoard scalars of one record: ``[(tag, value)]`` for a ``step`` or ``eval`` record (every numeric field
    it fills, see the module docstring), ``[]`` for any other kind."""
    tags = TAGS.get(rec.event)
    if tags is None or not isinstance(rec, (Step, Eval)):
        return []
    out = []
    for name, value in rec.to_dict().items():
        if name in _NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag, factor = tags.get(name, (_PREFIX[rec.event] + _tag_name(name), 1.0))
        out.append((tag, float(value) * factor))
    return out


class TensorBoardLog:
    """A TensorBoard event file in ``logdir``, written from event records (needs the ``tensorboard`` package).

    ``purge_step``: a run resumed into the same directory at iteration N passes N + 1, so TensorBoard drops the
    earlier attempt's points from step N + 1 on (the resumed run writes them again), as ``SummaryWriter`` does."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._pb, self._summary = event_pb2, summary_pb2
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        # flushed by the caller at each logged step (flush_secs: the writer's own thread, a backstop)
        self._writer = EventFileWriter(str(self.logdir), max_queue_size=1000, flush_secs=30)
        if purge_step is not None:
            self._writer.add_event(event_pb2.Event(step=purge_step, wall_time=time.time(),
                                                   session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def write(self, rec: Event) -> int:
        """Add ``rec``'s scalars (at its iteration and time); how many were written."""
        if rec.get("iteration") is None:
            return 0
        points = scalars(rec)
        if points:
            Value = self._summary.Summary.Value
            summary = self._summary.Summary(value=[Value(tag=tag, simple_value=value) for tag, value in points])
            self._writer.add_event(self._pb.Event(wall_time=rec.time if rec.time is not None else time.time(),
                                                  step=int(rec["iteration"]), summary=summary))
        return len(points)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def logged_records(source: "str | Path | RunReader") -> list[Event]:
    """The ``step`` and ``eval`` records a live TensorBoard log of the run holds: those of the rank that logs (the
    lowest rank whose step records carry a loss, i.e. the last pipeline stage's first data-parallel rank; the lowest
    rank with step records when none carries one), in the order written."""
    reader = as_reader(source)
    steps = [r for r in reader.records("step") if r.rank is not None]
    with_loss = [r.rank for r in steps if isinstance(r.get("loss"), (int, float))]
    ranks = with_loss or [r.rank for r in steps]
    if not ranks:
        return []
    rank = min(ranks)
    mine = sorted((r for r in reader.records(refresh=False) if r.rank == rank and r.event in TAGS),
                  key=lambda r: r.time or 0.0)
    # a run resumed into the same directory wrote its steps from the resume point again: the live log's purge step
    # drops the earlier attempt's records from there on, so the newest record of an (event, iteration) stands
    newest = {(r.event, r.get("iteration")): i for i, r in enumerate(mine)}
    return [r for i, r in enumerate(mine) if newest[(r.event, r.get("iteration"))] == i]


def _event_files(d: Path) -> list[Path]:
    return sorted(d.glob("events.out.tfevents.*")) if d.is_dir() else []


def export(run_dir: str | Path, logdir: str | Path | None = None, *, replace: bool = False) -> Path:
    """Write TensorBoard event files for a finished (or running) run from its event records; the folder written
    (default ``<run_dir>/tensorboard``).  The same scalars a live log (``train.tensorboard: true``) holds.  A folder
    that already holds event files (the run's live log, an earlier export) is refused unless ``replace``, which
    removes them first.  Raises :class:`ExportError` for a folder with no run's step records."""
    run_dir = Path(run_dir)
    out = Path(logdir) if logdir is not None else tensorboard_dir(run_dir)
    records = logged_records(run_dir)
    if not records:
        raise ExportError(f"{run_dir}: no step records in {run_dir / 'events'} (not a run directory, or the run has "
                          "not logged a step yet)")
    old = _event_files(out)
    if old and not replace:
        raise ExportError(f"{out} already holds TensorBoard event files ({old[0].name}{' ...' if len(old) > 1 else ''}): "
                          "open it as it is, or pass replace (--replace) to write it again from the events")
    for f in old:
        f.unlink()
    with TensorBoardLog(out) as log:
        for rec in records:
            log.write(rec)
    return out

