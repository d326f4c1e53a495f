"""A training step's whole forward-backward as one CUDA graph (``kernel_rule.KernelChoice.cuda_graphs_impl == "step"``).

Per-layer graphs still leave the host launching a step: BERT-base as shipped (8 micro-batches of 8 x 512) ran 81 ms
of kernels in a 236 ms step on an H200 (b534cf8), the rest the host replaying 192 layer graphs through the
cudagraph trees' bookkeeping, megatron's schedule and DDP hooks, and the eager embedding, head and loss.  Here the
trainer's call of megatron's forward-backward function runs eagerly for the first :data:`WARMUP_STEPS` steps
(compiling, autotuning), is captured once on the process's own stream (:func:`own_stream`), and is replayed from then on: one
launch for every layer, micro-batch, loss and gradient accumulation of the step.  Megatron's gradient finalisation
(DDP's all-reduce, over one rank here), the optimizer step, the zeroing of the gradient buffers and the reading of
the losses stay outside, eager; the compiled layers inside compile without cudagraph trees (a capture cannot nest).

What a replay cannot see, the kernel rule keeps off this path (:func:`workbench.kernel_rule.step_graph_blocker`):
more than one process, fp16's loss scale, FP8's per-step weight casts, custom train-step hooks.  What it handles
here: each step's micro-batches are read before the replay (the loader's order and prefetching unchanged) and
copied into the captured input tensors; a micro-batch of another shape or dtype than the captured ones runs that
step eagerly instead (counted in :attr:`StepGraph.eager_steps`).  Random numbers (dropout) come from torch's
default CUDA generator, which a capture registers: each replay draws new ones.  Micro-batch timing is not sampled
(the trainer's timer would record events once, at capture).
"""

from __future__ import annotations

import gc
import traceback
from typing import Any, Callable, Optional

import torch

#: eager steps before the capture: the first compiles the layers and autotunes, the second runs them compiled
#: (a capture must find nothing left to compile: compiling synchronises)
WARMUP_STEPS = 2

Batch = dict[str, torch.Tensor]


def _signature(batch: Batch) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else (k, repr(v))
                 for k, v in sorted(batch.items()))


def own_stream() -> None:
    """Make a new stream the process's current one, for the whole run.  Call before megatron's DDP wraps the model:
    the parameters' gradient-accumulation nodes, which DDP makes once and keeps, run their backward on the stream
    that was current when they were made.  Made on the legacy default stream, a capture's backward would have to
    make that stream wait on the capturing one, which CUDA refuses ("operation would make the legacy stream depend
    on a capturing blocking stream": torch 2.11 on an H200; torch 2.14's
    ``torch.autograd.graph.set_override_stale_capture_stream`` redirects such nodes instead).  On this stream the
    warm-up, the capture and every replay run where those nodes do."""
    torch.cuda.set_stream(torch.cuda.Stream())


def _differs(captured: tuple, now: tuple) -> str:
    for k, (a, b) in enumerate(zip(captured, now)):
        if a != b:
            return f"micro-batch {k}: {[x for x in b if x not in a]} where the capture had {[x for x in a if x not in b]}"
    return f"{len(now)} micro-batches against {len(captured)}"


class StepGraph:
    """Calls like megatron's ``forward_backward_func`` (keyword arguments, one model chunk, one data iterator)."""

    def __init__(self, forward_backward: Callable[..., Any], config: Any = None, warmup: int = WARMUP_STEPS,
                 log: Callable[[str], None] = print):
        self.forward_backward = forward_backward
        #: the model's TransformerConfig: its ``finalize_model_grads_func`` (DDP's gradient all-reduce, over one rank
        #: here) runs after each replay, eagerly, instead of inside the graph (no collective in a capture)
        self.config = config
        self.warmup = warmup
        self.log = log
        self._finalize_args: Optional[tuple] = None
        self.calls = 0
        #: steps run eagerly after the warm-up (a micro-batch unlike the captured ones, or a capture that failed)
        self.eager_steps = 0
        #: why the capture failed ("" while it did not): every step from then on runs eagerly
        self.failed = ""
        #: how the last call ran: "eager" (warm-up, a fallback), "captured" (recorded, then replayed) or "replayed"
        self.last = ""
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._inputs: list[Batch] = []
        self._signature: tuple = ()
        self._result: Any = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, *, data_iterator: Any, num_microbatches: int, forward_only: bool = False, **kwargs: Any) -> Any:
        if forward_only or isinstance(data_iterator, list) or isinstance(kwargs.get("model"), list):
            raise ValueError("StepGraph captures a training step of one model chunk (PP = 1) with one data iterator")
        batches = [next(data_iterator) for _ in range(num_microbatches)]
        self.calls += 1
        signature = tuple(_signature(b) for b in batches)
        eager = self.calls <= self.warmup or bool(self.failed) or (self.captured and signature != self._signature)
        if eager and self.calls > self.warmup:
            if self.eager_steps == 0 and not self.failed:
                self.log(f"[workbench] step graph: step {self.calls} has micro-batches unlike the captured ones "
                         f"({_differs(self._signature, signature)}); such steps run eagerly")
            self.eager_steps += 1
        self.last = "eager" if eager else "replayed"
        if not eager and not self.captured:
            try:
                self._capture(batches, signature, num_microbatches, kwargs)  # (its inputs are these micro-batches)
                self.last = "captured"
            except Exception as e:  # (a capture records, it runs nothing: undo the Python side, train eagerly)
                self._give_up(e, kwargs.get("model"))
                self.last = "eager"
                self.eager_steps += 1
        if self.last == "eager":  # (outside the except: its traceback would keep the failed capture's memory alive)
            return self.forward_backward(data_iterator=iter(batches), num_microbatches=num_microbatches,
                                         forward_only=False, **kwargs)
        if self.last == "replayed":
            for held, batch in zip(self._inputs, batches):
                for k, v in batch.items():
                    if isinstance(v, torch.Tensor):
                        held[k].copy_(v, non_blocking=True)
        self.graph.replay()
        if self._finalize_args is not None:
            self.config.finalize_model_grads_func(*self._finalize_args[0], **self._finalize_args[1])
        return self._result

    def _give_up(self, error: Exception, model: Any) -> None:
        """After a failed capture: nothing it recorded ran, but the backward's Python side did (DDP's hooks cleared
        ``.grad`` and set their flags), so the gradient buffers and flags are reset as at a step's start."""
        self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        self.graph, self._inputs, self._result, self._finalize_args = None, [], None, None
        traceback.clear_frames(error.__traceback__)  # (the frames hold the half-built step's tensors)
        gc.collect()
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # (an error the capture left on the stream is reported by the next call, if sticky)
            pass
        if model is not None:
            for p in model.parameters():
                p.grad = None
            if hasattr(model, "zero_grad_buffer"):
                model.zero_grad_buffer()
        self.log(f"[workbench] step graph: the capture failed ({self.failed}); training goes on eagerly, without CUDA graphs")

    def _capture(self, batches: list[Batch], signature: tuple, num_microbatches: int, kwargs: dict) -> None:
        """Record the step into a graph (nothing runs: the caller replays it for this step's numbers)."""
        self._inputs = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in batches]
        self._signature = signature
        override = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
        finalize = getattr(self.config, "finalize_model_grads_func", None)
        if override is not None:  # (torch >= 2.14) a node on another stream than the capture's joins the capture
            override(True)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the warm-up's cached blocks: the graph's own pool holds the step from now on
            graph = torch.cuda.CUDAGraph()
            if finalize is not None:
                def held(*args: Any, **kw: Any) -> None:  # the schedule's call, kept for after each replay
                    self._finalize_args = (args, kw)
                self.config.finalize_model_grads_func = held
            # on the current stream (own_stream's), where the warm-up ran and the parameters' nodes run;
            # thread_local: the loader's pin-memory thread may touch CUDA while this thread captures
            with torch.cuda.graph(graph, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
                self._result = self.forward_backward(data_iterator=iter(self._inputs),
                                                     num_microbatches=num_microbatches, forward_only=False, **kwargs)
        finally:
            if finalize is not None:
                self.config.finalize_model_grads_func = finalize
            if override is not None:
                override(False)  # (the process-initial state)
        torch.cuda.synchronize()
        self.graph = graph
