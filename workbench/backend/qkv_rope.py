"""The fused QKV output to SDPA's q, k, v with the rotary embedding: one Triton kernel forward (``KernelChoice.triton_ops``).

megatron's QKV GEMM writes, per token, each KV group's ``[q_1..q_{n/g}, k, v]`` heads; the compiled layer splits them,
rotates q and k (megatron's non-interleaved rotate-half, ``cos`` / ``sin`` of the frequencies cast to the activations'
dtype), repeats k and v over their group's query heads (grouped-query attention) and hands SDPA ``[b, n, s, d]`` views.
Inductor fused the forward into a kernel that recomputes two fp32 transcendentals for every element of q and k
(Llama-3.2-1B on an H200: 0.112 ms a call).  Here the tables are made once a call (s x d values) and one program a
token loads its row of QKV and of the tables once and writes q, the repeated k and v straight into contiguous
``[b, n, s, d]`` tensors (0.040 ms, ``bench/results/triton_ops_probe.jsonl``).  The backward is the transpose in
torch, which inductor fuses (:func:`_backward`).  The same operations as inductor's kernels, fp32 inside, the tables
rounded to the activations' dtype as megatron casts them, one rounding at each store; not bit-equal to them
(Llama-3.2-1B's first loss 12.16597 before, 12.16604 with the op: ``train_throughput.jsonl:221, 223``).  Where it does not apply (:func:`applies`)
the compiled layer keeps the torch expression (:func:`rotate`).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

__all__ = ["applies", "fits", "register", "rotate", "rotate_split"]


def rotate(t: torch.Tensor, freqs: torch.Tensor | None) -> torch.Tensor:
    """megatron's non-interleaved rotary embedding (bshd) on ``[s, b, n, d]``, ``freqs`` ``[s, 1, 1, rot]``: the
    compiled layer's torch expression (where :func:`applies` does not)."""
    return t if freqs is None else _apply_rotary_pos_emb_bshd(t, freqs)


def applies(qkv: torch.Tensor, freqs: torch.Tensor | None, head_dim: int) -> bool:
    """The kernel serves this call: a CUDA QKV that :func:`fits`."""
    return qkv.is_cuda and fits(qkv, freqs, head_dim)


def fits(qkv: torch.Tensor, freqs: torch.Tensor | None, head_dim: int) -> bool:
    """What the kernel takes, wherever the tensors are: 16-bit contiguous QKV ``[s, b, w]``, fp32 frequencies over
    the whole head ``[s, 1, 1, d]`` (no partial rotary), a power-of-two half head."""
    return (freqs is not None and qkv.dim() == 3 and qkv.dtype in (torch.bfloat16, torch.float16)
            and qkv.is_contiguous() and freqs.dtype == torch.float32 and freqs.shape[-1] == head_dim
            and freqs.numel() == qkv.shape[0] * head_dim and head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0)


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``cos`` / ``sin`` of the frequencies cast to the activations' dtype (``[s, 1, 1, d]``, s x d values:
    one small kernel each way under inductor)."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def _forward(qkv: torch.Tensor, freqs: torch.Tensor, groups: int, per_group: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                            torch.Tensor]:
    from triton import next_power_of_2

    from workbench.backend.qkv_rope_kernels import triton_qkv_rope_forward  # (Triton: only where the kernel runs)

    qkv = qkv.contiguous()  # (the kernel reads whole rows; a no-op where inductor kept the layout)
    s, b = qkv.shape[0], qkv.shape[1]
    d = qkv.shape[-1] // (groups * (per_group + 2))
    q, k, v = (qkv.new_empty((b, groups * per_group, s, d)) for _ in range(3))
    torch.library.wrap_triton(triton_qkv_rope_forward)[(s * b,)](
        qkv, *_tables(freqs, qkv.dtype), q, k, v, s, b, G=groups, PG=per_group, HALF=d // 2,
        GB=next_power_of_2(groups), PB=next_power_of_2(per_group))
    return q, k, v


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.groups, ctx.per_group = inputs[2], inputs[3]


def _backward(ctx, dq, dk, dv):
    """The transpose of the forward in torch, for inductor to fuse (a Triton backward that gathered the
    ``[b, n, s, d]`` gradients a token at a time ran at 0.31 ms a call on an H200, where the torch path's backward
    took 0.06: ``bench/results/triton_ops_probe.jsonl`` row 2; this transpose is not yet profiled alone): each group's
    k and v gradients summed over its query heads, q's and k's rotated back (``g * cos + rotate_half^T(g * sin)``,
    ``rotate_half^T(y) = [y_hi, -y_lo]``), in QKV's layout."""
    (freqs,) = ctx.saved_tensors
    g, pg = ctx.groups, ctx.per_group
    b, _, s, d = dq.shape
    cos, sin = (t.view(s, 1, 1, 1, d) for t in _tables(freqs, dq.dtype))

    def grouped(t: torch.Tensor) -> torch.Tensor:  # [b, n, s, d] -> [s, b, g, pg, d]
        return t.permute(2, 0, 1, 3).reshape(s, b, g, pg, d)

    def unrotate(t: torch.Tensor) -> torch.Tensor:
        lo, hi = (t * sin).chunk(2, dim=-1)
        return t * cos + torch.cat((hi, -lo), dim=-1)

    parts = (unrotate(grouped(dq)), unrotate(grouped(dk).sum(3, keepdim=True)), grouped(dv).sum(3, keepdim=True))
    return torch.cat(parts, dim=3).reshape(s, b, -1), None, None, None


@functools.cache
def register() -> None:
    """Registers ``workbench::qkv_rope`` (once; ``torch.library.triton_op`` imports torch's compiler, so never at
    import: the compiled layer calls this when it is built with the ops, :func:`rotate_split` before its first use)."""
    torch.library.triton_op("workbench::qkv_rope", _forward, mutates_args=()).register_autograd(
        _backward, setup_context=_setup)


def rotate_split(qkv: torch.Tensor, freqs: torch.Tensor, groups: int, per_group: int) -> tuple:
    """``qkv`` ``[s, b, g * (n/g + 2) * d]`` (megatron's per-group layout) to SDPA's rotated q and repeated k, v,
    each contiguous ``[b, n, s, d]``; ``freqs`` ``[s, 1, 1, d]`` fp32 (where :func:`applies`)."""
    if not torch.compiler.is_compiling():  # (compiled layers registered it when built)
        register()
    return torch.ops.workbench.qkv_rope(qkv, freqs.contiguous(), groups, per_group)
