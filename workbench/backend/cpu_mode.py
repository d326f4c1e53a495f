"""CPU mode: run the *real* megatron-core training path on CPU under gloo.

Deliberate choice: a CPU-only user and CI should exercise exactly the code
that runs on GPUs -- mcore's ``get_forward_backward_func`` schedules (1F1B, interleaved),
DDP grad buffers, ``get_megatron_optimizer``, ``dist_checkpointing`` -- on tiny models with
1-8 gloo processes.  Those pieces assume CUDA in a handful of places; this module patches
exactly those, in this one process, and only when :func:`enable` is called, which
:func:`workbench.backend.distributed.initialize` does only for ``parallel.device == "cpu"``.
GPU runs never call it and never depend on it.

Patches (all reversible by :func:`disable`, all listed in :data:`PATCHES`):
- ``torch.cuda.current_device()`` -> ``torch.device("cpu")`` (tensors allocated "on the
  current device" land on CPU);
- tensor factories (``torch.zeros/empty/ones/full/tensor``) called with a CUDA device ->
  CPU (e.g. ``torch.zeros([], device="cuda")`` in the schedules' token counter);
- ``torch.cuda.synchronize`` / ``torch.cuda.current_stream`` / ``Stream.wait_stream`` -> no-ops
  (dist_checkpointing's save strategy synchronises before writing); ``torch.cuda.Stream()`` /
  ``torch.cuda.stream(s)`` / ``Stream.record_event`` -> no-op streams and events (megatron's all-to-all
  MoE token dispatcher copies its split sizes to the host on a side stream); and that dispatcher's
  ``maybe_move_tensor_to_cpu(as_numpy=True)`` returns numpy split sizes for CPU tensors too, as it does for
  CUDA ones (``all_to_all_single`` takes lists, not tensors);
- ``torch.cuda.get_rng_state`` / ``set_rng_state`` -> CPU generator state, and megatron's RNG
  tracker ``fork`` -> a no-op context (there is no CUDA generator to fork; dropout then uses
  the CPU generator, which is fine for tests);
- megatron's ``clip_grad_by_total_norm_fp32`` (asserts CUDA grad tensors) -> the same
  scaling written for CPU tensors;
- ``Tensor.cuda()`` / ``Module.cuda()`` -> no-ops (tied output weights are moved with
  ``.cuda()`` in ``setup_embeddings_and_output_layer``);
- ``Tensor.type()`` (no-argument form) reports ``torch.cuda.<T>Tensor`` for CPU tensors,
  because mcore's fp16/bf16 and distributed optimizers only accept that type name;
- ``batch_p2p_comm=False`` is set in the TransformerConfig by :mod:`workbench.backend.model`
  (gloo has no batched isend/irecv) -- a config choice, not a patch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

__all__ = ["enable", "disable", "enabled", "tensor_cuda_is_identity", "PATCHES"]

PATCHES = (
    "torch.cuda.current_device",
    "torch.{zeros,empty,ones,full,tensor}(device=cuda)",
    "torch.cuda.synchronize / current_stream",
    "torch.cuda.Stream / stream / record_event (MoE dispatcher's side stream)",
    "megatron's MoE dispatcher maybe_move_tensor_to_cpu(as_numpy) on CPU tensors",
    "torch.cuda.get_rng_state / set_rng_state",
    "megatron CudaRNGStatesTracker.fork / add",
    "megatron clip_grad_by_total_norm_fp32 (asserts CUDA grads)",
    "torch.Tensor.cuda / torch.nn.Module.cuda -> no-op",
    "torch.Tensor.type() -> 'torch.cuda.<T>' name (optimizers' dtype checks)",
)

_saved: list[tuple[Any, str, Any]] = []


def enabled() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def tensor_cuda_is_identity(active: bool = True):
    """``Tensor.cuda()`` returns the tensor while a model is built on a machine without CUDA.

    megatron's LanguageModule moves the last pipeline stage's tied output-embedding copy with
    ``weight.data.cuda()`` before all-reducing it with the first stage.  For a CPU-only model
    build outside training (inference, conversion checks) that is the one CUDA call left, so
    they need this patch, not all of :func:`enable`.  A no-op where CUDA is available.
    """
    if not active or torch.cuda.is_available():
        yield
        return
    saved = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = saved  # type: ignore[method-assign]


def _patch(owner: Any, name: str, value: Any) -> None:
    _saved.append((owner, name, getattr(owner, name, None)))
    setattr(owner, name, value)


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal
    return str(device).startswith("cuda")


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _NoStream:
    """A CUDA stream / event stand-in on CPU.  A class (as ``torch.cuda.Stream`` is), so code that uses the name in
    a type expression (``torch.cuda.Stream | None``, transformers' generation utilities) still imports."""

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def wait_stream(self, *_: Any) -> None:
        pass

    def record_event(self, *_: Any) -> "_NoStream":
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "_NoStream":
        return self

    def __exit__(self, *_: Any) -> None:
        pass


def enable() -> None:
    """Apply the CPU patches (idempotent). Call before building the model."""
    if _saved:
        return
    cuda = torch.cuda
    _patch(cuda, "current_device", lambda: torch.device("cpu"))
    _patch(cuda, "synchronize", lambda *a, **k: None)
    _patch(cuda, "current_stream", lambda *a, **k: _NoStream())
    _patch(cuda, "Stream", _NoStream)
    _patch(cuda, "stream", lambda *a, **k: _NoStream())
    _patch(cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    _patch(cuda, "set_rng_state", lambda state, *a, **k: None)
    for name in ("zeros", "empty", "ones", "full", "tensor"):
        _patch(torch, name, _cpu_factory(getattr(torch, name)))

    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = mrandom.CudaRNGStatesTracker

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):  # noqa: ANN202
        yield

    def add(self: Any, name: str, seed: int) -> None:
        self.seeds_.add(seed)
        self.states_[name] = torch.get_rng_state()

    # clip_grad_by_total_norm_fp32 asserts 'torch.cuda.FloatTensor' grads; same maths on CPU.
    from megatron.core.optimizer import clip_grads as mclip
    from megatron.core.optimizer import optimizer as moptim

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(coeff, torch.Tensor):
            coeff = coeff.clamp_max(1.0)
        elif coeff >= 1.0:
            return
        for g in grads:
            g.mul_(coeff)

    _patch(mclip, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
    _patch(moptim, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)
    _patch(tracker_cls, "fork", fork)
    _patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    # mcore moves tied output weights / buffers with .cuda(); keep them where they are.
    _patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _patch(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    # mcore's mixed-precision / distributed optimizers accept only 'torch.cuda.*Tensor' params:
    # report CPU tensors under their CUDA type name (no-argument form of Tensor.type only).
    orig_type = torch.Tensor.type

    def tensor_type(self, *a, **k):
        if a or k:
            return orig_type(self, *a, **k)
        name = orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") and ".cuda." not in name else name

    _patch(torch.Tensor, "type", tensor_type)
    _patch(tracker_cls, "add", add)
    from megatron.core.transformer.moe import token_dispatcher as mdispatch

    move = mdispatch.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _patch(mdispatch, "maybe_move_tensor_to_cpu", to_host)
    _patch(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)


def disable() -> None:
    """Undo every patch (tests use this to keep processes clean)."""
    while _saved:
        owner, name, old = _saved.pop()
        setattr(owner, name, old)
