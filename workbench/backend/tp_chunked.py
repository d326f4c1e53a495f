"""TP = 2 with sequence parallelism, each GEMM split in two row chunks so its communication runs under the other
chunk's GEMM (``parallel.tp_chunked``; the kernel rule's ``tp_overlap == "chunked"``).

Under SP a rank holds half the sequence.  Megatron's column-parallel GEMM all-gathers the input, then multiplies;
its row-parallel GEMM multiplies, then reduce-scatters the partial sums.  Nothing in a layer's forward can run under
those collectives: the next GEMM needs their result.  With two ranks each collective is one exchange with the peer,
and half of each GEMM needs nothing from it:

- column (:func:`column_linear`): the shard is sent to the peer while this rank multiplies its own rows; then the
  peer's rows.  Backward: the peer's rows' input gradient is sent back while this rank's own input gradient (and
  the weight gradient, where the compiled graph keeps that order) is computed.
- row (:func:`row_linear`): the peer's rows' partial product first, sent while this rank's own rows are multiplied;
  the two partial sums of this rank's rows then added.  Backward: the output gradient is sent to the peer while the
  own rows' input gradient is computed.

Each exchange is one ``all_to_all_single`` on the TP group with this rank's own split empty (NCCL: a send and a
receive; capturable in a CUDA graph), its wait moved to the first use in the compiled graph
(:func:`workbench.backend.tp_overlap.sink_exchange_waits`).  Both functions are ``torch.autograd.Function`` s, so the
backward's order is the one written here, not autograd's.  The maths is megatron's: the same products (each weight
gradient one GEMM over the whole gathered sequence, as megatron's, so it rounds once), the two-rank sum in the other
order (exact for two operands).  bf16 / fp32 GEMMs only (FP8 layers keep the plain collectives).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed import _functional_collectives as funcol

__all__ = ["column_linear", "row_linear", "waited"]


def _splits(rank: int, n: int) -> list[int]:
    """``all_to_all_single`` splits that send ``n`` rows to the peer and none to this rank (``rank`` 0 or 1)."""
    return [0, n] if rank == 0 else [n, 0]


def _start(x: torch.Tensor, rank: int, group: str) -> torch.Tensor:
    """The exchange with the peer, started: ``x`` goes to it, its tensor of the same shape comes back (wait with
    :func:`waited` where it is needed)."""
    s = _splits(rank, x.shape[0])
    return funcol.all_to_all_single(x.contiguous(), s, s, group)


def waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited.  Traced, the collective already carries its one ``wait_tensor`` (a
    second would stand between an all-gather and its GEMM and hide the pair from inductor's micro-pipeline TP pass,
    ``parallel.async_tp``; a post-grad pass places an exchange's wait); eagerly it is an ``AsyncCollectiveTensor``:
    waited here.  The compiled layer's collectives use it too."""
    return t if torch.compiler.is_compiling() else funcol.wait_tensor(t)


def _in_order(mine: torch.Tensor, other: torch.Tensor, rank: int) -> torch.Tensor:
    """The two halves along the sequence in rank order (rank 0's rows first)."""
    return torch.cat([mine, other] if rank == 0 else [other, mine], dim=0)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` over the last dim of a ``[s, b, k]`` tensor."""
    return torch.matmul(x, w.t())


def _wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g^T x`` over every row (one GEMM): the weight gradient of ``x @ w.T`` for output gradient ``g``."""
    return g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _ColumnChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], rank: int, group: str):
        pending = _start(x, rank, group)
        y_mine = _mm(x, w)  # under the exchange
        x_other = waited(pending)
        y_other = _mm(x_other, w)
        ctx.save_for_backward(_in_order(x, x_other, rank), w)  # the gathered input, for one weight-gradient GEMM
        ctx.rank, ctx.group, ctx.bias = rank, group, b is not None
        y = _in_order(y_mine, y_other, rank)
        return y if b is None else y + b

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x_full, w = ctx.saved_tensors
        n = x_full.shape[0] // 2
        gy = gy.contiguous()
        g_mine, g_other = (gy[:n], gy[n:]) if ctx.rank == 0 else (gy[n:], gy[:n])
        pending = _start(g_other.matmul(w), ctx.rank, ctx.group)  # the peer's rows' input gradient, back to it
        dx = g_mine.matmul(w)  # under the exchange: this rank's own input gradient and the weight gradient
        dw = _wgrad(gy, x_full)
        db = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.bias else None
        return dx + waited(pending), dw, db, None, None


class _RowChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, w: torch.Tensor, rank: int, group: str):
        n = a.shape[0] // 2
        a_mine, a_other = (a[:n], a[n:]) if rank == 0 else (a[n:], a[:n])
        pending = _start(_mm(a_other, w), rank, group)  # the peer's rows' partial product, to it
        z = _mm(a_mine, w)  # under the exchange
        ctx.save_for_backward(a, w)
        ctx.rank, ctx.group = rank, group
        return z + waited(pending)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        a, w = ctx.saved_tensors
        g = g.contiguous()
        pending = _start(g, ctx.rank, ctx.group)  # the gradient of the peer's partial product of these rows
        da_mine = g.matmul(w)  # under the exchange
        g_other = waited(pending)
        dw = _wgrad(_in_order(g, g_other, ctx.rank), a)  # the output gradient of every row: one GEMM
        return _in_order(da_mine, g_other.matmul(w), ctx.rank), dw, None, None


def column_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], rank: int, group: str) -> torch.Tensor:
    """Megatron's column-parallel GEMM under SP at TP = 2 (all-gather along the sequence, then ``@ w.T + b``), its
    exchange under this rank's own rows' GEMM.  ``x``: this rank's ``[s/2, b, k]`` shard; returns ``[s, b, n/2]``."""
    return _ColumnChunked.apply(x, w, b, rank, group)


def row_linear(a: torch.Tensor, w: torch.Tensor, rank: int, group: str) -> torch.Tensor:
    """Megatron's row-parallel GEMM under SP at TP = 2 without its bias (``a @ w.T``, then reduce-scatter along the
    sequence), its exchange under this rank's own rows' GEMM.  ``a``: ``[s, b, k/2]``; returns ``[s/2, b, n]``."""
    return _RowChunked.apply(a, w, rank, group)
