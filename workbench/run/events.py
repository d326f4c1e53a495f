"""The event stream's records: the public contract between the backend and everything that watches it.

Every rank appends JSON lines to ``<run_dir>/events/rank-<r>.jsonl``, one object per line,
flushed per line so a notebook (or ``tail -f``) sees it at once.  Every record has

    {"event": KIND, "time": <unix seconds>, "rank": <global rank>, ...fields}

Kinds and their fields (all sizes in bytes, all times in seconds unless named *_ms); each kind
is a dataclass below (:class:`RunStart`, :class:`Step`, ...):

- ``run_start``: config (dict), versions (dict), device, hostname, world_size, coords {tp, pp, dp},
  kernel_path (dict: attention, norm, optimizer, ...; the fast paths as ``fast_<name>``, read
  them with :meth:`RunStart.fusions` / :meth:`RunStart.uses_cuda_graphs`), kernels, data, start_iteration.
- ``step``: iteration, loss, lr, grad_norm, skipped, step_time, tokens_per_s, tflops_per_gpu, mfu,
  mem_allocated, mem_reserved, mem_peak, consumed_samples, step_graph.  Only ranks that hold the loss (last
  pipeline stage) fill loss.
- ``microbatch``: iteration, ops: list of {kind: "F"|"B", microbatch, chunk, start_ms, end_ms}
  (times relative to the step start, measured with CUDA events), sampled every K steps.
- ``eval``: iteration, loss, ppl.
- ``eval_progress``: iteration, done, total (evaluation batches; every rank, at most every
  ``EVAL_PROGRESS_SECONDS`` of the backend while an evaluation runs, so a long one is progress).
- ``checkpoint``: iteration, path, seconds.
- ``error``: message, traceback, exception (type name).
- ``run_end``: status ("finished" | "stopped" | "failed"), iteration, seconds, exit_code.
- ``router`` (MoE models, every ``model.moe.router_stats_interval`` steps, one rank): iteration, layers (the MoE
  layers' 0-based indices), per layer: tokens_per_expert (tokens each expert received in that step, all ranks and
  micro-batches, after any capacity), assignments (tokens x top_k asked for), dropped (assignments beyond an
  expert's capacity), load_balancing_loss and z_loss (each the loss before its coefficient, the step's mean over
  micro-batches as megatron's tracker reduces it; None when off).

Field names are the on-disk names, so runs written by any earlier version parse; fields a
record does not declare are kept in its ``extra`` dict (and written back out as they came).
Records also answer ``rec["field"]`` / ``rec.get("field")`` like dicts.
This module must not import torch or megatron-core.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

from workbench.layout import Layout as ParallelLayout

KINDS = ("run_start", "step", "microbatch", "eval", "eval_progress", "checkpoint", "error", "run_end", "router")

#: prefix of the kernel-path entries that name the backend's fast paths (``compiled_layer.summary()``)
FUSION_PREFIX = "fast_"

__all__ = [
    "KINDS", "FUSION_PREFIX", "Event", "RunStart", "Step", "Microbatch", "Eval", "EvalProgress", "Checkpoint", "Error", "RunEnd", "Router",
    "RECORD_TYPES", "Layout", "parse_record", "parse_line", "fusion_entries", "EventWriter", "events_dir", "event_file",
]


def events_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "events"


def event_file(run_dir: str | Path, rank: int) -> Path:
    return events_dir(run_dir) / f"rank-{rank}.jsonl"


def fusion_entries(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The kernel-path entries for the backend's fast paths: ``{"fast_<name>": value}``."""
    return {f"{FUSION_PREFIX}{k}": v for k, v in summary.items()}


@dataclass(kw_only=True)
class Event:
    """One record of the stream. ``event`` is the kind, ``extra`` holds undeclared fields."""

    KIND: ClassVar[str] = ""
    event: str = ""
    time: float | None = None
    rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.event:
            self.event = self.KIND

    # ---- the dict view (what the JSON line holds)
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name != "extra":
                out[f.name] = getattr(self, f.name)
        out.update(self.extra)
        return out

    def _declared(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self) if f.name != "extra")

    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key != "extra" and key in self._declared():
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            value = self[key]
        except KeyError:
            return default
        return default if value is None else value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (key in self.extra or (key != "extra" and key in self._declared()))

    def keys(self):
        return self.to_dict().keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())


@dataclass(frozen=True)
class Layout:
    """The run's parallel layout: sizes (from the config) and world size."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    world_size: int = 1
    #: context-parallel size (each sequence split over this many ranks; dp counts the rest)
    cp: int = 1


@dataclass(kw_only=True)
class RunStart(Event):
    KIND: ClassVar[str] = "run_start"
    config: dict[str, Any] | None = None
    versions: dict[str, Any] | None = None
    device: str | None = None
    hostname: str | None = None
    world_size: int | None = None
    coords: dict[str, int] | None = None
    kernel_path: dict[str, Any] | None = None
    kernels: Any = None  # the kernel rule's choice (workbench.kernel_rule), when the backend records it
    data: Any = None
    start_iteration: int | None = None

    def fusions(self) -> dict[str, Any]:
        """The fast paths in the kernel path, by name (``cuda_graphs``, ``cross_entropy``, ...)."""
        kp = self.kernel_path or {}
        return {k[len(FUSION_PREFIX):]: v for k, v in kp.items() if k.startswith(FUSION_PREFIX)}

    def uses_cuda_graphs(self) -> bool:
        """The backend names the ``cuda_graphs`` fast path only when the layers replay as graphs."""
        return "cuda_graphs" in self.fusions()

    def layout(self) -> Layout:
        """TP/PP/DP sizes from the run's config (VPP and CP too), else from world size and coords."""
        par = (self.config or {}).get("parallel") or {}
        tp = int(par.get("tensor_parallel") or 1)
        pp = int(par.get("pipeline_parallel") or 1)
        vpp = int(par.get("virtual_pipeline_parallel") or 1)
        cp = max(int(par.get("context_parallel") or 1), 1)
        world = int(self.world_size or int(par.get("nproc_per_node") or 0) * int(par.get("nnodes") or 1) or tp * pp * cp)
        dp = ParallelLayout(world=max(world, 1), tp=max(tp, 1), pp=max(pp, 1), cp=cp).dp
        return Layout(tp, pp, dp, vpp, world, cp)


@dataclass(kw_only=True)
class Step(Event):
    KIND: ClassVar[str] = "step"
    iteration: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    skipped: Any = None
    step_time: float | None = None
    tokens_per_s: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    mem_allocated: int | None = None
    mem_reserved: int | None = None
    mem_peak: int | None = None
    consumed_samples: int | None = None
    #: under the whole-step CUDA graph (workbench.backend.step_graph): "eager" (a warm-up step, or a fallback),
    #: "captured" (recorded, then replayed) or "replayed"; None without it
    step_graph: str | None = None


@dataclass(kw_only=True)
class Microbatch(Event):
    KIND: ClassVar[str] = "microbatch"
    iteration: int | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    pp_rank: int | None = None
    num_microbatches: int | None = None
    num_chunks: int | None = None


@dataclass(kw_only=True)
class Eval(Event):
    KIND: ClassVar[str] = "eval"
    iteration: int | None = None
    loss: float | None = None
    ppl: float | None = None


@dataclass(kw_only=True)
class EvalProgress(Event):
    KIND: ClassVar[str] = "eval_progress"
    iteration: int | None = None
    done: int | None = None
    total: int | None = None


@dataclass(kw_only=True)
class Checkpoint(Event):
    KIND: ClassVar[str] = "checkpoint"
    iteration: int | None = None
    path: str | None = None
    seconds: float | None = None


@dataclass(kw_only=True)
class Error(Event):
    KIND: ClassVar[str] = "error"
    message: str | None = None
    traceback: str | None = None
    exception: str | None = None

    @property
    def exception_type(self) -> str | None:
        """The exception's type name (older writers called the field ``type``)."""
        return self.exception or self.extra.get("type")


@dataclass(kw_only=True)
class RunEnd(Event):
    KIND: ClassVar[str] = "run_end"
    status: str | None = None
    iteration: int | None = None
    seconds: float | None = None
    exit_code: int | None = None


@dataclass(kw_only=True)
class Router(Event):
    """One training step of an MoE model's routers (see the module docstring); lists run over ``layers``."""

    KIND: ClassVar[str] = "router"
    iteration: int | None = None
    layers: list[int] = field(default_factory=list)
    tokens_per_expert: list[list[int]] = field(default_factory=list)
    assignments: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    load_balancing_loss: list[float] | None = None
    z_loss: list[float] | None = None

    def layer(self, index: int) -> list[int]:
        """Tokens per expert of MoE layer ``index`` (its 0-based index in the model)."""
        return self.tokens_per_expert[self.layers.index(index)]

    def coefficient_of_variation(self) -> list[float]:
        """Per layer: the standard deviation of the experts' token counts over their mean (0: perfectly balanced)."""
        out = []
        for row in self.tokens_per_expert:
            mean = sum(row) / len(row) if row else 0.0
            var = sum((x - mean) ** 2 for x in row) / len(row) if row else 0.0
            out.append(var ** 0.5 / mean if mean else 0.0)
        return out


RECORD_TYPES: dict[str, type[Event]] = {c.KIND: c for c in (RunStart, Step, Microbatch, Eval, EvalProgress, Checkpoint, Error, RunEnd, Router)}
_INT_FIELDS = ("rank", "iteration", "world_size", "start_iteration", "pp_rank", "exit_code")


def parse_record(data: Mapping[str, Any]) -> Event:
    """A record from a JSON object; unknown fields go to ``extra``, an unknown kind gives a plain :class:`Event`."""
    kind = data.get("event")
    if not isinstance(kind, str) or not kind:
        raise ValueError("not an event record (no 'event' kind)")
    cls = RECORD_TYPES.get(kind, Event)
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for k, v in data.items():
        (known if k in names else extra)[k] = v
    for k in _INT_FIELDS:
        v = known.get(k)
        if isinstance(v, float) and v.is_integer():
            known[k] = int(v)
    if isinstance(known.get("time"), int):
        known["time"] = float(known["time"])
    return cls(**known, extra=extra)


def _check_types(rec: Event) -> Event:
    """A damaged line can still be JSON: a record read from disk whose fields have the wrong types
    (or a time that is not a finite number) is refused like a corrupt line, never reaching a reader."""
    for k, allowed in _field_types(type(rec)).items():
        v = getattr(rec, k, None)
        if v is not None and (not isinstance(v, allowed) or isinstance(v, bool) and bool not in allowed):
            raise ValueError(f"field {k!r} has a {type(v).__name__}")
    t = rec.time
    if t is not None and not (t == t and abs(t) != float("inf")):
        raise ValueError("time is not a finite number")
    return rec


_TYPES_CACHE: dict[type, dict[str, tuple]] = {}


def _field_types(cls: type) -> dict[str, tuple]:
    """Python types each field of a record class accepts (from its annotations; absent = anything)."""
    if cls not in _TYPES_CACHE:
        out: dict[str, tuple] = {}
        for f in dataclasses.fields(cls):
            hint = str(f.type).replace(" ", "")
            base = hint.split("|")[0].split("[")[0]
            out[f.name] = {"float": (int, float), "int": (int, float), "str": (str,), "bool": (bool,),
                           "dict": (dict,), "list": (list,)}.get(base)  # Any and the rest: not checked
            if out[f.name] is None:
                del out[f.name]
        _TYPES_CACHE[cls] = out
    return _TYPES_CACHE[cls]


def parse_line(line: bytes | str) -> Event | None:
    """A record from one JSON line; None for a blank, corrupt or non-record line."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    try:
        return _check_types(parse_record(data))
    except (TypeError, ValueError):
        return None


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

    def write(self, record: Event) -> Event:
        """Append a typed record (``time`` and ``rank`` filled in when unset)."""
        if record.event not in KINDS:
            raise ValueError(f"unknown event kind {record.event!r}; known: {KINDS}")
        if record.time is None:
            record.time = time.time()
        if record.rank is None:
            record.rank = self.rank
        data = {"event": record.event, "time": record.time, "rank": record.rank, **record.to_dict()}
        self._fh.write(json.dumps(data, default=_default, allow_nan=True) + "\n")
        self._fh.flush()
        return record

    def emit(self, kind: str, **fields: Any) -> Event:
        """Append a record of ``kind`` built from keyword fields (undeclared ones go to ``extra``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r}; known: {KINDS}")
        return self.write(parse_record({"event": kind, **fields}))

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
