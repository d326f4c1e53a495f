"""FP8 GEMMs without Transformer Engine: ``train.fp8: tensorwise | rowwise | delayed`` on the compiled layer.

megatron-core's own FP8 (``config.fp8``) is a silent no-op without Transformer Engine, so the
workbench does it in torch: every GEMM of the compiled dense layer (QKV, output projection,
fc1, fc2; T5's cross-attention q / kv / projection) becomes :func:`linear`, which casts both
operands to FP8 with a dynamic scale and multiplies them with ``torch._scaled_mm`` (cuBLASLt's
FP8 GEMM on Hopper; a reference kernel on CPU), accumulating in fp32 and writing bf16.  Master
weights, the optimizer, the norms, attention, the embedding and the output layer with its
cross-entropy stay as they are (torchtitan's Float8 leaves the output layer in bf16 too).

Scaling (the recipe): each operand is scaled so that its absolute maximum maps to the FP8
format's largest value, along the GEMM's contracted dimension so that the scales factor out
of the sum (``(a / sa) @ (b / sb) = (a @ b) / (sa sb)`` for a scale per row of ``a`` and per
column of ``b``):

- ``tensorwise``: one scale per tensor; inputs and weights in E4M3, output gradients in E5M2
  (more range, the usual split).  The forward's FP8 input serves backward's weight gradient
  (tensorwise quantisation does not depend on the layout): forward saves its token-major copy.
- ``rowwise``: one scale per row of the left operand and per column of the right one, in E4M3
  for everything (cuBLAS's row-wise FP8 GEMM takes E4M3 operands); backward re-quantises along
  its own contracted dimension (the token dimension for the weight gradient).
- ``delayed``: ``tensorwise``'s formats and GEMMs, but the GEMM inputs and output gradients are
  scaled by the previous training step's absolute maximum (TE's ``DelayedScaling`` with megatron's
  defaults: a history of one step, no margin) instead of their own.  A cast then needs nothing
  from the tensor it casts, so inductor fuses it into the kernel that produces the tensor (the
  SwiGLU, its backward, the norm) rather than reading the tensor again after its maximum; each
  tensor's maximum is still taken in that kernel, for the next step.  A value above the previous
  maximum saturates at the format's largest.  Weights keep current scaling (cast once per step).
  A GEMM scales like ``tensorwise`` until it has seen a step with both maxima finite and nonzero
  (a run's first step, and the first step after a resume: the state is not checkpointed).  On
  Transformer Engine's layer ``delayed`` is TE's own recipe, with a 1024-step history.

Scales are computed from the current tensor ("current scaling"; ``delayed``: see above), in fp32.
The forward GEMM accumulates with cuBLAS's fast FP8 accumulation (as torchao's Float8 training
does for the output); both backward GEMMs accumulate in full fp32.

Weights are cast once per training step, not once per micro-batch and GEMM: between
:func:`open_step` and :func:`close_step` (the training loop's forward-backward, where no
weight changes) :func:`cached` hands the compiled layer an :class:`FP8Weight`, the weight
with its forward and transposed backward FP8 copies, refreshed in place on the first call of
the step (static addresses: the CUDA graphs read them where they are).  That is 2 bytes per
GEMM weight element of persistent memory (the planner's ``fp8_weight_copies``).  Outside the
window (evaluation, generation, tests) every call quantises its weight, inputs and gradients
itself (``delayed`` included: current scaling, no state touched).
This module is torch-only and runs on CPU (the tests compare it with a float reference).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from workbench.backend import grad_accumulation
from workbench.kernel_rule import FP8_RECIPES

__all__ = ["RECIPES", "GEMMS", "FP8Weight", "Delayed", "quantize", "transpose", "scaled_mm", "linear", "supported_here",
           "open_step", "close_step", "cached", "weight_casts"]

RECIPES = FP8_RECIPES["torch"]  # the kernel rule's list for this implementation
#: The GEMMs that run in FP8 (the kernel path names them).
GEMMS = "QKV, attention output, fc1, fc2 (and T5's cross-attention q/kv/output)"

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: ``torch._scaled_mm`` needs every GEMM dimension to be a multiple of 16 (cuBLASLt FP8)
ALIGN = 16


def supported_here() -> Optional[str]:
    """Why FP8 GEMMs cannot run on this process's GPU (None when they can)."""
    if not torch.cuda.is_available():
        return None  # CPU: torch's reference kernel (tests)
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name()
        return f"{name} (sm_{major}{minor}) has no FP8 tensor cores (needs sm_89+: Ada, Hopper, Blackwell)"
    return None


def amax_of(t: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of ``t`` (0-dim).  Row maxima first: inductor then fuses the reduction into the
    kernel producing ``t`` (a whole-tensor one it splits into blocks it cannot fuse)."""
    return t.abs().amax(dim=-1).amax() if t.dim() > 1 else t.abs().amax()


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: Optional[int],
             scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to the FP8 ``dtype`` and the fp32 inverse scale that undoes it.

    ``dim=None``: one scale for the tensor; ``dim=d``: one scale per slice reduced along ``d``
    (kept as a size-1 dimension, the shape ``torch._scaled_mm`` takes for row-wise scales).
    The scale maps the absolute maximum to the format's largest finite value; a given ``scale``
    (``delayed``: from an earlier maximum) is used as it is, values beyond the range saturating.
    """
    if scale is None:
        amax = amax_of(t) if dim is None else t.abs().amax(dim=dim, keepdim=True)
        scale = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    q = (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q, scale.reciprocal()


_TRANSPOSE_KERNEL = None


def _transpose_kernel():
    global _TRANSPOSE_KERNEL
    if _TRANSPOSE_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _fp8_transpose(src, dst, m, n, BM: tl.constexpr, BN: tl.constexpr):
            """dst [n, m] = src [m, n].T, bytes, one BM x BN tile per program: both sides coalesced."""
            rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
            rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
            mask = (rm[:, None] < m) & (rn[None, :] < n)
            tile = tl.load(src + rm[:, None] * n + rn[None, :], mask=mask)
            tl.store(dst + rn[None, :] * m + rm[:, None], tile, mask=mask)

        _TRANSPOSE_KERNEL = _fp8_transpose
    return _TRANSPOSE_KERNEL


@torch.library.custom_op("workbench::fp8_transpose", mutates_args=())
def transpose(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` for a 2-D FP8 tensor, as an op of its own that inductor does not fuse.

    The weight gradient needs the output gradient with the token dimension contiguous (cuBLASLt's FP8
    GEMM takes only row-major x column-major).  Left to inductor, that transposed copy is written by
    the kernel producing the gradient, whose rows are the reduction's (its maximum): each program then
    stores a few bytes per column, uncoalesced (measured: the SwiGLU-backward kernel 0.59 ms per
    call on an H100, Llama-1B).  Here: the producer writes one row-major FP8 tensor, then a tiled
    Triton kernel (CUDA) transposes its bytes.
    """
    m, n = t.shape
    out = torch.empty((n, m), dtype=t.dtype, device=t.device)
    t = t.contiguous()  # the kernel reads row-major bytes (a no-op for the casts' outputs)
    if not t.is_cuda:  # (never the input itself: a custom op's output may not alias it)
        return out.copy_(t.t())
    bm = bn = 64
    _transpose_kernel()[(-(-m // bm), -(-n // bn))](t.view(torch.uint8), out.view(torch.uint8), m, n, BM=bm, BN=bn)
    return out


@transpose.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty((t.shape[1], t.shape[0]))


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype,
              fast_accum: bool = False) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for FP8 ``a`` [m, k] (row-major) and ``b`` [k, n] (made column-major here),
    fp32 accumulation (``fast_accum``: cuBLAS's faster FP8 accumulation, for the forward), ``out_dtype`` result."""
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a.contiguous(), b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


class FP8Weight(NamedTuple):
    """A GEMM weight ``w`` [n, k] with its FP8 copies for one training step (:func:`cached`).

    ``fwd`` [n, k] (the forward's right operand is ``fwd.t()``) with ``fwd_inv`` (a scalar, or
    per output row [n, 1] for rowwise); ``bwd`` [k, n] (the input gradient's right operand is
    ``bwd.t()``: ``w`` column-major) with ``bwd_inv`` (a scalar, or per input column [1, k]).
    ``delayed``: the GEMM's :class:`Delayed` state as tensors: ``x_scale`` / ``g_scale`` (None in a
    run's first step: current scaling), ``x_amax`` (this step's input maximum so far, updated in
    place) and ``probe`` (backward hands the output gradient's maximum to it as its gradient).
    """

    w: torch.Tensor
    fwd: torch.Tensor
    fwd_inv: torch.Tensor
    bwd: torch.Tensor
    bwd_inv: torch.Tensor
    x_scale: Optional[torch.Tensor] = None
    g_scale: Optional[torch.Tensor] = None
    x_amax: Optional[torch.Tensor] = None
    probe: Optional[torch.Tensor] = None


class Delayed:
    """One GEMM's ``delayed`` scaling state: the scales this step uses (from the last step's maxima) and the
    maxima this step has seen so far (fp32 scalars at fixed addresses: the CUDA graphs read and update them).

    The input's maximum is folded into ``x_amax`` inside the compiled layer; the output gradient's comes out
    of backward as the gradient of ``probe`` (a leaf of its own, so no graph mutates anything in backward), and
    a hook folds it into ``g_amax`` and drops it.  :func:`open_step` turns the maxima into the next scales.
    One use of a weight per forward graph (as every layer GEMM is): autograd would sum two uses' probe gradients
    before the hook (a larger maximum: a smaller, safe scale).  ``torch.autograd.grad`` calls fire no hook: the
    gradient's maximum is then not seen and the GEMM stays on current scaling.
    """

    def __init__(self, device: torch.device):
        new = lambda v: torch.full((), v, dtype=torch.float32, device=device)  # noqa: E731
        self.x_scale, self.g_scale, self.x_amax, self.g_amax = new(1.0), new(1.0), new(0.0), new(0.0)
        self.probe = new(0.0).requires_grad_()
        self.ready = False  # a step's maxima seen: the scales are the delayed ones
        if device.type == "cuda":
            from torch._dynamo import mark_static_address

            for t in (self.x_scale, self.g_scale, self.x_amax, self.probe):
                mark_static_address(t, guard=False)

        def fold(p: torch.Tensor) -> None:
            torch.maximum(self.g_amax, p.grad.detach().reshape(()).float(), out=self.g_amax)
            p.grad = None  # (under CUDA graphs it is the graph's output memory: hold none of it)

        self.probe.register_post_accumulate_grad_hook(fold)

    def fields(self) -> dict:
        ready = self.ready
        return {"x_scale": self.x_scale if ready else None, "g_scale": self.g_scale if ready else None,
                "x_amax": self.x_amax, "probe": self.probe}


def _next_scales(states: list[Delayed]) -> None:
    """The step ends: each state's maxima become its scales (format maximum / amax; a zero or non-finite
    maximum keeps the old scale, as TE does), and the maxima restart.  A state turns ready (its scales used)
    once both its maxima were valid; until then (one host read, only while some state is not ready) its GEMM
    keeps current scaling."""
    by_device: dict[torch.device, list[Delayed]] = {}
    for st in states:
        by_device.setdefault(st.x_amax.device, []).append(st)
    for group in by_device.values():
        amax = torch.stack([t for s in group for t in (s.x_amax, s.g_amax)]).view(-1, 2)
        old = torch.stack([t for s in group for t in (s.x_scale, s.g_scale)]).view(-1, 2)
        fmax = torch.tensor([torch.finfo(E4M3).max, torch.finfo(E5M2).max], device=amax.device)
        valid = (amax > 0) & torch.isfinite(amax)
        new = torch.where(valid, fmax / amax.clamp(min=1e-30), old)
        torch._foreach_copy_([t for s in group for t in (s.x_scale, s.g_scale)], list(new.view(-1).unbind(0)))
        torch._foreach_zero_([t for s in group for t in (s.x_amax, s.g_amax)])
        if not all(s.ready for s in group):
            for s, ok in zip(group, valid.all(dim=1).tolist()):
                s.ready = s.ready or ok


def _cast_weight(w: torch.Tensor, recipe: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four FP8 tensors of :class:`FP8Weight` for ``w`` under ``recipe`` (``delayed``: as ``tensorwise``)."""
    if recipe == "rowwise":
        fwd, fwd_inv = quantize(w, E4M3, -1)
        bwd, bwd_inv = quantize(w, E4M3, 0)
        return fwd, fwd_inv, bwd.t().contiguous(), bwd_inv
    fwd, inv = quantize(w, E4M3, None)
    return fwd, inv, fwd.t().contiguous(), inv


def _refresh(w: torch.Tensor, fwd: torch.Tensor, fwd_inv: torch.Tensor, bwd: torch.Tensor, bwd_inv: torch.Tensor,
             recipe: str) -> None:
    """Cast ``w`` into the step's FP8 buffers in place (their addresses stay: CUDA graphs read them)."""
    for dst, src in zip((fwd, fwd_inv, bwd, bwd_inv), _cast_weight(w, recipe)):
        dst.copy_(src)


_compiled_refresh = None
_STEP = {"open": False, "generation": 0, "casts": 0}
#: ``delayed`` states used since the last :func:`open_step` (their maxima become the next step's scales)
_USED: list[Delayed] = []


def weight_casts() -> int:
    """How many times a weight's step copies were cast in this process (once per weight and step)."""
    return _STEP["casts"]


def open_step() -> None:
    """Weights stay fixed until :func:`close_step`: each is cast to FP8 once (on its first use).
    ``delayed``: the maxima the last step saw become this step's scales."""
    with torch.no_grad():
        _next_scales(_USED)
    _USED.clear()
    _STEP["generation"] += 1
    _STEP["open"] = True


def close_step() -> None:
    """Weights may change (the optimizer step follows): no cached FP8 copy is handed out until the next
    :func:`open_step`."""
    _STEP["open"] = False


def cached(w: torch.Tensor, recipe: Optional[str]) -> Union[torch.Tensor, FP8Weight]:
    """``w`` with its FP8 copies for this step (:class:`FP8Weight`), cast on its first use in the step;
    ``w`` itself outside an open step or without a recipe (:func:`linear` then quantises per call)."""
    global _compiled_refresh
    if recipe is None or not _STEP["open"]:
        return w
    entry = getattr(w, "_workbench_fp8", None)
    key = (recipe, w.device, w.dtype, tuple(w.shape))
    if entry is None or entry[0] != key:
        bufs = tuple(torch.empty_like(t) for t in _cast_weight(w.detach(), recipe))
        if w.is_cuda:  # the CUDA graphs read them in place: static inputs, no copy per replay
            from torch._dynamo import mark_static_address

            for t in bufs:
                mark_static_address(t, guard=False)
        entry = [key, -1, bufs, Delayed(w.device) if recipe == "delayed" else None]
        w._workbench_fp8 = entry
    if entry[1] != _STEP["generation"]:
        if w.is_cuda and _compiled_refresh is None:
            _compiled_refresh = torch.compile(_refresh, dynamic=False)
        with torch.no_grad():
            (_compiled_refresh if w.is_cuda else _refresh)(w.detach(), *entry[2], recipe)
        entry[1] = _STEP["generation"]
        _STEP["casts"] += 1
        if entry[3] is not None:
            _USED.append(entry[3])
    return FP8Weight(w, *entry[2], **(entry[3].fields() if entry[3] is not None else {}))


class _FP8Linear(torch.autograd.Function):
    """``x @ w.T`` with both GEMMs of backward in FP8 too (recipe: see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str, fwd: Optional[torch.Tensor],
                fwd_inv: Optional[torch.Tensor], bwd: Optional[torch.Tensor], bwd_inv: Optional[torch.Tensor],
                x_scale: Optional[torch.Tensor], g_scale: Optional[torch.Tensor],
                probe: Optional[torch.Tensor]) -> torch.Tensor:
        """``fwd .. bwd_inv``: the step's FP8 copies of ``w`` (:class:`FP8Weight`), or None (cast here);
        ``x_scale`` / ``g_scale``: ``delayed``'s scales (None: from the tensor); ``probe``: ``delayed``'s leaf
        whose gradient is the output gradient's maximum (None: not wanted).
        (Fixed arguments, no ``*args`` / ``bool(tuple)``: dynamo traces this Function into the layer's graph.)"""
        x2 = x.reshape(-1, x.shape[-1])
        rows = recipe == "rowwise"
        cached_w = fwd is not None
        x8, xs = quantize(x2, E4M3, -1 if rows else None, x_scale)
        if cached_w:
            w8, ws = fwd, fwd_inv
        else:  # w [n, k]: a scale per output row = per column of w.T
            w8, ws = quantize(w, E4M3, -1 if rows else None)
        y = scaled_mm(x8, xs, w8.t(), ws.t() if rows else ws, x.dtype, fast_accum=True)
        ctx.recipe = recipe
        ctx.x_shape = x.shape
        ctx.cached_w = cached_w
        ctx.probe = probe is not None
        ctx.g_scaled = g_scale is not None  # delayed: saved last
        # tensorwise: the FP8 input is the weight gradient's operand as it is, token-major (the transposed copy made
        # here, by the opaque op: saved, where inductor would recompute it in backward from the tensor x8 came from)
        if rows and cached_w:
            ctx.save_for_backward(x2, w, bwd, bwd_inv)
        elif rows:
            ctx.save_for_backward(x2, w)
        elif cached_w:
            ctx.save_for_backward(transpose(x8), xs, w, bwd, bwd_inv, *(() if g_scale is None else (g_scale,)))
        else:
            ctx.save_for_backward(transpose(x8), xs, w, *(() if g_scale is None else (g_scale,)))
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.reshape(-1, grad.shape[-1])  # [t, n]
        saved = ctx.saved_tensors
        if ctx.recipe == "rowwise":
            x2, w = saved[0], saved[1]
            g8, gs = quantize(g, E4M3, -1)                 # dgrad: contracted over n
            if ctx.cached_w:                               # w [n, k] column-major, a scale per column [1, k]
                wc8, wcs = saved[2].t(), saved[3]
            else:
                wc8, wcs = quantize(w, E4M3, 0)
            dx = scaled_mm(g8, gs, wc8, wcs, grad.dtype)
            gt8, gts = quantize(g.t(), E4M3, -1)           # wgrad: contracted over t
            xc8, xcs = quantize(x2, E4M3, 0)
            dw = scaled_mm(gt8, gts, xc8, xcs, w.dtype)
        else:
            x8t, xs, w = saved[0], saved[1], saved[2]
            g8, gs = quantize(g, E5M2, None, saved[-1] if ctx.g_scaled else None)
            if ctx.cached_w:
                w8, ws = saved[3].t(), saved[4]
            else:
                w8, ws = quantize(w, E4M3, None)
            dx = scaled_mm(g8, gs, w8, ws, grad.dtype)
            dw = scaled_mm(transpose(g8), gs, x8t.t(), xs, w.dtype)  # (see transpose: not fused into g's producer)
        g_amax = amax_of(g).float() if ctx.probe else None  # delayed: the next step's scale from it
        return dx.view(ctx.x_shape), dw, None, None, None, None, None, None, None, g_amax


def linear(x: torch.Tensor, w: Union[torch.Tensor, FP8Weight, "grad_accumulation.MainGradWeight"],
           bias: Optional[torch.Tensor], recipe: Optional[str]) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with the GEMM in FP8 under ``recipe`` (plain ``F.linear`` when None).
    ``w`` may be the step's :class:`FP8Weight` (:func:`cached`): its FP8 copies are used as they are; or a
    :class:`~workbench.backend.grad_accumulation.MainGradWeight` (no FP8): its gradient goes into its ``main_grad``.
    The bias is added in the output's precision after the GEMM (as a bf16 GEMM epilogue would)."""
    if isinstance(w, grad_accumulation.MainGradWeight):  # bf16: the weight gradient added into main_grad in its GEMM
        return grad_accumulation.linear(x, w, bias)
    fwd = fwd_inv = bwd = bwd_inv = x_scale = g_scale = x_amax = probe = None
    if isinstance(w, FP8Weight):
        w, fwd, fwd_inv, bwd, bwd_inv, x_scale, g_scale, x_amax, probe = w
    if recipe is None:
        return torch.nn.functional.linear(x, w, bias)
    tokens = x.numel() // x.shape[-1]
    if tokens % ALIGN or x.shape[-1] % ALIGN or w.shape[0] % ALIGN:
        raise ValueError(f"train.fp8: a GEMM of shape tokens={tokens}, in={x.shape[-1]}, out={w.shape[0]} is not a "
                         f"multiple of {ALIGN} in every dimension (torch._scaled_mm needs that); fix: sizes that are "
                         f"multiples of {ALIGN}, or train.fp8: off")
    if x_amax is not None:  # delayed: this step's input maximum so far (fused into the kernel producing x)
        with torch.no_grad():
            x_amax.copy_(torch.maximum(x_amax, amax_of(x.detach()).float()))
    y = _FP8Linear.apply(x, w, recipe, fwd, fwd_inv, bwd, bwd_inv, x_scale, g_scale, probe)
    return y if bias is None else y + bias
