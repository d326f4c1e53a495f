"""Query / key RMSNorms spanning all heads at once (``model.qk_norm_scope: all_heads``; OLMoE's q/k norms).

megatron-core's ``qk_layernorm`` normalises each query and key head on its own: the attention builds
``submodules.q_layernorm(hidden_size=head_dim, config=..., eps=...)`` and applies it to the query
``[sq, b, heads_local, head_dim]`` (the key: ``[sq, b, groups_local, head_dim]``).  OLMoE's ``q_norm`` is one RMSNorm
over the whole query projection (``num_heads x head_dim`` wide, before the split into heads and before RoPE) and its
``k_norm`` one over the whole key projection (``num_kv_heads x head_dim``).  :class:`AllHeadsQNorm` /
:class:`AllHeadsKNorm` are those norms in megatron's slots: built with the same arguments, they flatten the local
heads and take the root mean square over the full width.

Tensor parallelism splits the heads over the TP ranks: each rank holds ``heads / TP`` contiguous heads (megatron's
QKV split), so the sum of squares is all-reduced over the TP group (forward and backward: each rank's output depends
on the others' inputs).  The weight is held whole on every TP rank (a replicated parameter, like megatron's per-head
q/k norms; its checkpoint entry is the full tensor) and each rank applies its heads' slice: its gradient is then
non-zero on that slice only, and megatron's ``finalize_model_grads``, which sums the gradients of every
``q_layernorm`` / ``k_layernorm`` parameter over TP under ``qk_layernorm``, completes the full gradient on every rank.
(A TP-sharded weight would be wrong under that sum: it would add different shards.)  Fewer KV groups than TP ranks (a
key head replicated over ranks) is refused by the config rules, not handled here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["AllHeadsRMSNorm", "AllHeadsQNorm", "AllHeadsKNorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group in the forward and in the backward (the sum feeds every rank's output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def _tp_group() -> tuple[object | None, int, int]:
    """(TP group, its size, this rank's place in it); (None, 1, 0) outside megatron's parallel state."""
    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    if group is None:
        return None, 1, 0
    return group, torch.distributed.get_world_size(group=group), torch.distributed.get_rank(group=group)


class AllHeadsRMSNorm(torch.nn.Module):
    """RMSNorm over ``heads x head_dim`` values at once, this rank's ``heads / TP`` heads of them.

    ``heads``: the model's query heads or KV groups (the subclasses pick); ``hidden_size``: the head width megatron's
    attention passes.  Input ``[..., heads_local, head_dim]``; output of the same shape.  ``weight``: all heads'
    (``heads x head_dim``) on every rank, this rank's slice applied."""

    #: "q": the query heads (``num_attention_heads``); "k": the key groups (``num_query_groups``)
    role = "q"

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError("q/k norms over all heads are RMSNorms (OLMoE's) -> set normalization: rmsnorm")
        heads = config.num_attention_heads if self.role == "q" else (config.num_query_groups or config.num_attention_heads)
        tp = int(config.tensor_model_parallel_size or 1)
        if heads % tp:
            raise ValueError(f"{heads} {'query heads' if self.role == 'q' else 'KV groups'} do not split over TP {tp}")
        self.config, self.eps, self.head_dim = config, eps, hidden_size
        self.full_width = heads * hidden_size
        self.local_heads = heads // tp
        dev = torch.device("cpu") if config.use_cpu_initialization else None
        self.weight = torch.nn.Parameter(torch.ones(self.full_width, dtype=config.params_dtype, device=dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if shape[-2] != self.local_heads or shape[-1] != self.head_dim:
            raise ValueError(f"{self.role} norm over all heads: input {tuple(shape)}, expected [..., {self.local_heads}, {self.head_dim}]")
        flat = x.reshape(*shape[:-2], shape[-2] * shape[-1])
        group, tp, rank = _tp_group()
        if tp == 1:  # normalised in fp32, cast, then weighted (HF's OlmoeRMSNorm's two roundings, as at TP > 1)
            return (F.rms_norm(flat.float(), (self.full_width,), eps=self.eps).to(x.dtype) * self.weight).view(shape)
        width = self.local_heads * self.head_dim
        xf = flat.float()
        ss = _AllReduceSum.apply(xf.pow(2).sum(-1, keepdim=True), group)
        y = (xf * torch.rsqrt(ss / self.full_width + self.eps)).to(x.dtype)
        return (self.weight.narrow(0, rank * width, width) * y).view(shape)

    def extra_repr(self) -> str:
        return f"{self.role}: {self.local_heads} local heads x {self.head_dim} of {self.full_width}, eps={self.eps}"


class AllHeadsQNorm(AllHeadsRMSNorm):
    """The query norm over all ``num_attention_heads`` heads (OLMoE's ``self_attn.q_norm``)."""

    role = "q"


class AllHeadsKNorm(AllHeadsRMSNorm):
    """The key norm over all ``num_query_groups`` KV heads (OLMoE's ``self_attn.k_norm``)."""

    role = "k"
