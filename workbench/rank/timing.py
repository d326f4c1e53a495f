"""Per-micro-batch forward/backward timings for the schedule overlay (``microbatch`` events).

One isolated place: the backend wraps its own forward step (it knows chunk and
micro-batch), and :func:`install` wraps megatron's ``schedules.backward_step`` once per
process.  Backward calls are matched to their forward by the identity of the output tensor
the schedule hands back (the loss tensor on the last stage, the activations elsewhere),
recorded when the forward finished.  On sampled steps each op records two CUDA events
(``torch.cuda.Event(enable_timing=True)``; ``time.perf_counter`` on CPU); the events are
resolved once after the step, so the cost is a few microseconds per micro-batch on sampled
steps and one flag check otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["MicrobatchTimer", "install", "active_timer"]

_active: Optional["MicrobatchTimer"] = None
_installed = False


def active_timer() -> Optional["MicrobatchTimer"]:
    return _active


class _Mark:
    """A point in time: a CUDA event, or perf_counter on CPU."""

    __slots__ = ("event", "t")

    def __init__(self, cuda: bool):
        if cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
            self.t = None
        else:
            self.event = None
            self.t = time.perf_counter()

    def ms_since(self, origin: "_Mark") -> float:
        if self.event is not None:
            return float(origin.event.elapsed_time(self.event))
        return (self.t - origin.t) * 1000.0


@dataclass
class _Op:
    kind: str
    microbatch: int
    chunk: int
    start: _Mark
    end: Optional[_Mark] = None


@dataclass
class MicrobatchTimer:
    cuda: bool
    enabled: bool = False
    origin: Optional[_Mark] = None
    ops: list = field(default_factory=list)
    _by_tensor: dict = field(default_factory=dict)

    def begin_step(self, enabled: bool) -> None:
        global _active
        self.enabled = enabled
        self.ops = []
        self._by_tensor = {}
        _active = self
        if enabled:
            self.origin = _Mark(self.cuda)

    def forward_start(self, microbatch: int, chunk: int) -> Optional[_Op]:
        if not self.enabled:
            return None
        op = _Op("F", microbatch, chunk, _Mark(self.cuda))
        self.ops.append(op)
        return op

    def forward_end(self, op: Optional[_Op], output: Any) -> None:
        if op is None:
            return
        op.end = _Mark(self.cuda)
        if isinstance(output, torch.Tensor):
            self._by_tensor[id(output)] = (op.microbatch, op.chunk)

    def remember(self, tensor: Any, microbatch: int, chunk: int) -> None:
        """Map a tensor the schedule will pass to backward (e.g. the loss) to its micro-batch."""
        if self.enabled and isinstance(tensor, torch.Tensor):
            self._by_tensor[id(tensor)] = (microbatch, chunk)

    def backward_start(self, output_tensor: Any) -> Optional[_Op]:
        if not self.enabled:
            return None
        t = output_tensor[0] if isinstance(output_tensor, (list, tuple)) and output_tensor else output_tensor
        mb, chunk = self._by_tensor.get(id(t), (-1, -1))
        op = _Op("B", mb, chunk, _Mark(self.cuda))
        self.ops.append(op)
        return op

    def backward_end(self, op: Optional[_Op]) -> None:
        if op is not None:
            op.end = _Mark(self.cuda)

    def end_step(self) -> list[dict]:
        """Resolve the marks (one device sync) into [{kind, microbatch, chunk, start_ms, end_ms}]."""
        global _active
        _active = None
        if not self.enabled or self.origin is None:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        out = []
        for op in self.ops:
            if op.end is None:
                continue
            out.append({"kind": op.kind, "microbatch": op.microbatch, "chunk": op.chunk,
                        "start_ms": round(op.start.ms_since(self.origin), 4), "end_ms": round(op.end.ms_since(self.origin), 4)})
        self.enabled = False
        self.ops = []
        self._by_tensor = {}
        return out


def install() -> None:
    """Wrap megatron's schedules.backward_step once (a pass-through unless a timer is sampling)."""
    global _installed
    if _installed:
        return
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step

    def timed_backward_step(input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs):
        timer = _active
        op = timer.backward_start(output_tensor) if timer is not None and timer.enabled else None
        result = original(input_tensor, output_tensor, output_tensor_grad, config, *args, **kwargs)
        if op is not None:
            timer.backward_end(op)
        return result

    timed_backward_step.__wrapped__ = original  # type: ignore[attr-defined]
    schedules.backward_step = timed_backward_step
    _installed = True
