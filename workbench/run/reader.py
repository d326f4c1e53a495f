"""The one reader of a run directory: its event files, ``launch.json``, ``exit_status.json``, ``config.json``.

:class:`RunReader` follows ``<run_dir>/events/rank-*.jsonl`` incrementally: it remembers a
byte offset per rank file, returns only complete lines (a partial last line, which the writer
may be in the middle of, waits for the next :meth:`RunReader.poll`) and skips a corrupt line
anywhere in a file (counted in :attr:`RunReader.bad_lines`); when a line is a torn write glued
to the next record (a rank killed mid-line, then the run resumed into the same file), the
glued record is still read.  Every record read so far stays available by kind, so the
notebook-side :class:`workbench.launch.Run`, the supervisor, ``write_exit_status``, the planner's
measured peaks and the measured pipeline schedule all read through it and nothing re-reads.

The run's kernel path and TP/PP/DP layout come from one place: :meth:`RunReader.run_start`.
Torch-free, like the rest of :mod:`workbench.run`.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from workbench.run.events import KINDS, Event, Layout, Router, RunStart, events_dir, parse_line
from workbench.run.files import read_json
from workbench.run.nodes import EXIT_STATUS_FILE, LAUNCH_FILE, node_dir

__all__ = ["RunReader", "read_events", "read_records", "as_reader",
           "LAUNCH_FILE", "EXIT_STATUS_FILE", "CONFIG_FILE"]

CONFIG_FILE = "config.json"
_MARK = b'{"event"'


def _rank_of(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 1 << 30


class RunReader:
    """Incremental, thread-safe reader of one run directory (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._by_kind: dict[str, list[Event]] = {k: [] for k in KINDS}
        self._count = 0
        self.bad_lines = 0
        self.last_event_time = 0.0  # the newest record's timestamp (any kind, any rank)
        self._lock = threading.RLock()

    # ---- events
    def _parse(self, raw: bytes) -> list[Event]:
        rec = parse_line(raw)
        if rec is not None:
            return [rec]
        if not raw.strip():
            return []
        self.bad_lines += 1
        # a torn line glued to a whole record: keep the whole record that follows the tear
        i = raw.rfind(_MARK)
        if i > 0:
            rec = parse_line(raw[i:])
            if rec is not None:
                return [rec]
        return []

    def poll(self) -> list[Event]:
        """Records written since the last call, across every rank file, time-ordered."""
        with self._lock:
            out: list[Event] = []
            d = events_dir(self.run_dir)
            if not d.is_dir():
                return out
            for path in sorted(d.glob("rank-*.jsonl"), key=_rank_of):
                off = self._offsets.get(path, 0)
                try:
                    with open(path, "rb") as fh:
                        fh.seek(0, 2)
                        size = fh.tell()
                        if size < off:  # truncated / rewritten: start over
                            off, self._partial[path] = 0, b""
                        fh.seek(off)
                        chunk = fh.read()
                except FileNotFoundError:
                    continue
                if not chunk:
                    continue
                self._offsets[path] = off + len(chunk)
                lines = (self._partial.pop(path, b"") + chunk).split(b"\n")
                if lines[-1]:
                    self._partial[path] = lines[-1]
                for raw in lines[:-1]:
                    out.extend(self._parse(raw))
            out.sort(key=lambda r: r.time or 0.0)
            for rec in out:
                self._by_kind.setdefault(rec.event, []).append(rec)
                self.last_event_time = max(self.last_event_time, float(rec.time or 0.0))
            self._count += len(out)
            return out

    def refresh(self) -> int:
        """Read what is new; how many records arrived."""
        return len(self.poll())

    def records(self, kind: str | None = None, *, refresh: bool = True) -> list[Event]:
        """Every record read so far (of ``kind``), after reading what is new unless ``refresh=False``."""
        if refresh:
            self.poll()
        with self._lock:
            if kind is not None:
                return list(self._by_kind.get(kind, []))
            return sorted((r for rs in self._by_kind.values() for r in rs), key=lambda r: r.time or 0.0)

    def has(self, kind: str, *, refresh: bool = True) -> bool:
        if refresh:
            self.poll()
        with self._lock:
            return bool(self._by_kind.get(kind))

    @property
    def count(self) -> int:
        """How many records have been read."""
        return self._count

    def router(self, *, refresh: bool = True) -> list[Router]:
        """An MoE run's ``router`` records (tokens per expert, router losses per layer), in step order."""
        recs = [r for r in self.records("router", refresh=refresh) if isinstance(r, Router)]
        return sorted(recs, key=lambda r: (r.iteration or 0, r.time or 0.0))

    # ---- the run's identity: kernel path and layout, from one place
    def run_starts(self, *, refresh: bool = True) -> list[RunStart]:
        return [r for r in self.records("run_start", refresh=refresh) if isinstance(r, RunStart)]

    def run_start(self, rank: int | None = None, *, refresh: bool = True) -> RunStart | None:
        """The (latest) ``run_start`` of ``rank``, or of the lowest rank that wrote one."""
        starts = self.run_starts(refresh=refresh)
        if rank is not None:
            starts = [s for s in starts if s.rank == rank]
        if not starts:
            return None
        low = min(s.rank if s.rank is not None else 1 << 30 for s in starts)
        return [s for s in starts if (s.rank if s.rank is not None else 1 << 30) == low][-1]

    def kernel_path(self, rank: int | None = None) -> dict[str, Any]:
        s = self.run_start(rank)
        return dict(s.kernel_path or {}) if s else {}

    def fusions(self, rank: int | None = None) -> dict[str, Any]:
        s = self.run_start(rank)
        return s.fusions() if s else {}

    def uses_cuda_graphs(self) -> bool:
        """True when any rank replayed its layers as CUDA graphs (their pool is reserved memory)."""
        return any(s.uses_cuda_graphs() for s in self.run_starts())

    def coords(self) -> dict[int, dict[str, int]]:
        """{global rank: {tp, pp, dp} (and cp where context parallel > 1)}: each rank's coordinates from its
        ``run_start``."""
        return {int(s.rank): dict(s.coords) for s in self.run_starts() if s.rank is not None and isinstance(s.coords, dict)}

    def layout(self) -> Layout | None:
        """The run's layout (TP / PP / DP / CP ... sizes): from ``run_start`` (the config the ranks ran), else from
        config.json."""
        s = self.run_start()
        if s is not None:
            return s.layout()
        cfg = self.config_dict()
        if cfg is None:
            return None
        return RunStart(config=cfg, world_size=None).layout()

    # ---- the run directory's other files
    def config_dict(self) -> dict | None:
        """``config.json`` as saved at launch, else the config of a ``run_start``; None when neither exists."""
        cfg = read_json(self.run_dir / CONFIG_FILE)
        if cfg is not None:
            return cfg
        s = self.run_start()
        return s.config if s and isinstance(s.config, dict) else None

    def launch_info(self, node_rank: int = 0) -> dict:
        """``launch.json`` (commands, pids, start time) of node ``node_rank``, or {} for a run not launched here."""
        return read_json(node_dir(self.run_dir, node_rank) / LAUNCH_FILE) or {}

    def exit_status(self, node_rank: int = 0) -> dict | None:
        """``exit_status.json`` (status, returncode, reason, failed_rank, ...) of node ``node_rank``, None while it runs."""
        return read_json(node_dir(self.run_dir, node_rank) / EXIT_STATUS_FILE)


def as_reader(source: "str | Path | RunReader") -> RunReader:
    """``source`` itself when it is a reader (records already read are reused), else a new one."""
    return source if isinstance(source, RunReader) else RunReader(source)


def read_records(run_dir: str | Path) -> list[Event]:
    """All complete records of a run directory, time-ordered."""
    return RunReader(run_dir).records()


def read_events(run_dir: str | Path) -> list[dict]:
    """All complete events of a run directory as plain dicts (the JSON objects), time-ordered."""
    return [r.to_dict() for r in read_records(run_dir)]
