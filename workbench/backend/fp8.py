"""FP8 GEMMs without Transformer Engine: ``train.fp8: tensorwise | rowwise`` on the compiled layer.

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
  (more range, the usual split).  The forward's FP8 input serves backward's weight gradient as
  it is (tensorwise quantisation does not depend on the layout).
- ``rowwise``: one scale per row of the left operand and per column of the right one, in E4M3
  for everything (cuBLAS's row-wise FP8 GEMM takes E4M3 operands); backward re-quantises along
  its own contracted dimension (the token dimension for the weight gradient).

Scales are computed from the current tensor (no amax history: "current scaling"), in fp32.
This module is torch-only and runs on CPU (the tests compare it with a float reference).
"""

from __future__ import annotations

from typing import Optional

import torch

from workbench.kernels import FP8_RECIPES

__all__ = ["RECIPES", "GEMMS", "quantize", "scaled_mm", "linear", "supported_here"]

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


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to the FP8 ``dtype`` and the fp32 inverse scale that undoes it.

    ``dim=None``: one scale for the tensor; ``dim=d``: one scale per slice reduced along ``d``
    (kept as a size-1 dimension, the shape ``torch._scaled_mm`` takes for row-wise scales).
    The scale maps the absolute maximum to the format's largest finite value.
    """
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = torch.finfo(dtype).max / amax.float().clamp(min=1e-12)
    q = (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    return q, scale.reciprocal()


def scaled_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` for FP8 ``a`` [m, k] (row-major) and ``b`` [k, n] (made column-major here),
    fp32 accumulation, ``out_dtype`` result."""
    if b.stride(0) != 1:
        b = b.t().contiguous().t()
    return torch._scaled_mm(a.contiguous(), b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _FP8Linear(torch.autograd.Function):
    """``x @ w.T`` with both GEMMs of backward in FP8 too (recipe: see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rows = recipe == "rowwise"
        x8, xs = quantize(x2, E4M3, -1 if rows else None)
        w8, ws = quantize(w, E4M3, -1 if rows else None)  # w [n, k]: a scale per output row = per column of w.T
        y = scaled_mm(x8, xs, w8.t(), ws.t() if rows else ws, x.dtype)
        ctx.recipe = recipe
        ctx.x_shape = x.shape
        if rows:
            ctx.save_for_backward(x2, w)
        else:  # the FP8 input is the weight gradient's operand as it is
            ctx.save_for_backward(x8, xs, w)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = grad.reshape(-1, grad.shape[-1])  # [t, n]
        if ctx.recipe == "rowwise":
            x2, w = ctx.saved_tensors
            g8, gs = quantize(g, E4M3, -1)                 # dgrad: contracted over n
            wc8, wcs = quantize(w, E4M3, 0)                # a scale per column of w [1, k]
            dx = scaled_mm(g8, gs, wc8, wcs, grad.dtype)
            gt8, gts = quantize(g.t(), E4M3, -1)           # wgrad: contracted over t
            xc8, xcs = quantize(x2, E4M3, 0)
            dw = scaled_mm(gt8, gts, xc8, xcs, w.dtype)
        else:
            x8, xs, w = ctx.saved_tensors
            g8, gs = quantize(g, E5M2, None)
            w8, ws = quantize(w, E4M3, None)
            dx = scaled_mm(g8, gs, w8, ws, grad.dtype)
            dw = scaled_mm(g8.t(), gs, x8, xs, w.dtype)
        return dx.view(ctx.x_shape), dw, None


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], recipe: Optional[str]) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with the GEMM in FP8 under ``recipe`` (plain ``F.linear`` when None).
    The bias is added in the output's precision after the GEMM (as a bf16 GEMM epilogue would)."""
    if recipe is None:
        return torch.nn.functional.linear(x, w, bias)
    tokens = x.numel() // x.shape[-1]
    if tokens % ALIGN or x.shape[-1] % ALIGN or w.shape[0] % ALIGN:
        raise ValueError(f"train.fp8: a GEMM of shape tokens={tokens}, in={x.shape[-1]}, out={w.shape[0]} is not a "
                         f"multiple of {ALIGN} in every dimension (torch._scaled_mm needs that); fix: sizes that are "
                         f"multiples of {ALIGN}, or train.fp8: off")
    y = _FP8Linear.apply(x, w, recipe)
    return y if bias is None else y + bias
