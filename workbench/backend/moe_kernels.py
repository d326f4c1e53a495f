"""Triton kernels of the workbench's MoE token permutation (:mod:`workbench.backend.moe_dispatch`) on CUDA.

:func:`gather_sum`: each token's ``k`` rows of the experts' output summed in fp32 and rounded once (the
un-permutation, and the permutation's backward).  Inductor's kernel for the same gather-and-sum (one persistent
reduction over ``k`` beside ``tokens x hidden``) read its rows at about a fifth of an H200's bandwidth (40.8 ms a step
of moe-research, 128 calls, ``bench/results/moe_profile.jsonl:17``); here one program per token and block of the
hidden dimension reads its ``k`` rows whole and writes one: 0.076 ms against inductor's 0.325 at moe-research's
shapes, bitwise the eager sum (``bench/results/moe_permute.jsonl:1``).  The sum is in fp32 in slot order, then
rounded to the rows' dtype: ``index_select(...).sum(1, dtype=float32).to(dtype)`` up to the order of an fp32 sum
of ``k`` terms.

It runs where :mod:`workbench.backend.moe_dispatch` asks for it (training on CUDA in the kernel rule's compiled
paths) and under Triton's interpreter on the CPU (the tests).  The permutation's row gather stays ``index_select``:
a Triton kernel of one program a row ran it no faster (0.120 ms either way, ``bench/results/moe_permute.jsonl:2``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = ["gather_sum"]

#: the widest block of the hidden dimension one program takes (wider rows: several programs a row)
MAX_BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_sum_kernel(y_ptr, slots_ptr, out_ptr, hidden, y_stride, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(K):
            row = tl.load(slots_ptr + t * K + r).to(tl.int64)
            acc += tl.load(y_ptr + row * y_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    return _gather_sum_kernel


def _launch(hidden: int, block: int | None) -> tuple[int, int, int]:
    """``(block, blocks a row, warps)`` for rows of ``hidden`` elements."""
    import triton

    block = block or min(MAX_BLOCK, triton.next_power_of_2(hidden))
    return block, -(-hidden // block), max(1, min(8, block // 256))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, hidden]`` with unit stride along the hidden dimension (a copy only where it has none)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_sum(y: torch.Tensor, slots: torch.Tensor, k: int, block: int | None = None) -> torch.Tensor:
    """``out[t] = sum(y[slots[t * k + r]] for r in range(k))`` in fp32, rounded once to ``y``'s dtype:
    ``[slots.numel() // k, hidden]``.  ``slots`` must index rows of ``y`` (unchecked: no host sync; megatron's
    permutation makes them).  ``block``: the hidden dimension's block (tests; a power of two)."""
    if slots.numel() % k:
        raise ValueError(f"gather_sum: {slots.numel()} slots are not {k} a token")
    tokens, hidden = slots.numel() // k, y.shape[-1]
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)
    if tokens == 0 or hidden == 0:
        return out
    y, slots = _rows(y), slots.contiguous()
    block, blocks, warps = _launch(hidden, block)
    with torch.cuda.device(y.device) if y.is_cuda else contextlib.nullcontext():  # (Triton launches on the current one)
        _kernels()[(tokens, blocks)](y, slots, out, hidden, y.stride(0), K=k, BLOCK=block, num_warps=warps)
    return out

