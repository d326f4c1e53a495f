"""The workbench core-attention module: megatron's ``CoreAttention`` slot on torch SDPA.

Why: megatron-core's local ``DotProductAttention`` materialises the s x s score matrix
(slow, memory hungry, no flash kernel), and Transformer Engine is often not installed.
``torch.nn.functional.scaled_dot_product_attention`` dispatches to flash / memory-efficient
/ cuDNN kernels on GPUs and to a fused CPU kernel otherwise.

Features
- causal (top-left aligned when sq == sk; bottom-right aligned when a KV cache makes
  sk > sq, i.e. query i sits at absolute position sk - sq + i), ``no_mask`` and explicit
  boolean masks (megatron convention: ``True`` = masked out);
- MHA / MQA / GQA: SDPA's ``enable_gqa`` when no additive bias is needed (flash path),
  otherwise an explicit ``repeat_interleave`` of the KV heads;
- ALiBi (Press et al., 2022), which megatron-core lacks: per-head slopes from the paper
  (geometric sequence ``2^(-8 i / n)``; for non-power-of-two n the closest power of two
  plus every other slope of the doubled sequence), the bias ``-slope * (i - j)`` is built
  for the heads this TP rank owns (heads are sharded contiguously across TP ranks);
- attention dropout under megatron's TP RNG tracker (as stock ``DotProductAttention``).

Signature is mcore's: ``__init__(config, layer_number, attn_mask_type, attention_type,
attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None)`` and
``forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
packed_seq_params=None)`` with q/k/v ``[s, b, heads, head_dim]`` and output ``[sq, b, hp]``.
Packed sequences (THD) need Transformer Engine and are refused with a clear message.
Context parallelism (``context_parallel_size > 1``): attention of this rank's load-balanced shard against the whole
sequence by ring attention over megatron's CP group (:func:`workbench.backend.context_parallel.ring_attention`):
causal (GPT), or bidirectional with BERT's key-padding mask.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

__all__ = ["SDPAttention", "alibi_slopes", "alibi_bias", "sdpa_mask", "apply_sdpa_order"]

_SDP_BACKENDS = {"math": 0, "flash": 1, "efficient": 2, "cudnn": 3}


def apply_sdpa_order(order: tuple[str, ...], capability: Optional[tuple[int, int]] = None) -> Optional[list[str]]:
    """Put torch SDPA's backends in ``order`` for this process (the kernel rule's ``sdpa_order``) on a GPU of
    compute capability 9.0 or later (``capability``; default: the current CUDA device's), where torch's own order
    without Transformer Engine is the same; backends not named keep their place after these.  Returns the order
    set, or None when nothing was changed (empty order, an older GPU, or a torch without the setting)."""
    if not order or not hasattr(torch._C, "_set_sdp_priority_order"):
        return None
    if capability is None:
        if not torch.cuda.is_available():
            return None
        capability = torch.cuda.get_device_capability()
    if capability[0] < 9:
        return None
    wanted = [_SDP_BACKENDS[name] for name in order]
    rest = [b for b in torch._C._get_sdp_priority_order() if b not in wanted]
    torch._C._set_sdp_priority_order(wanted + rest)
    return list(order)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes exactly as in the paper's reference implementation (fp32, [num_heads])."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias ``[heads, sq, sk]`` = ``-slope * (query_pos - key_pos)`` (query i at position sk - sq + i).

    Future positions get a positive distance' bias too; the causal mask removes them.
    """
    q_pos = torch.arange(sk - sq, sk, device=device, dtype=torch.float32)[:, None]
    k_pos = torch.arange(sk, device=device, dtype=torch.float32)[None, :]
    dist = (q_pos - k_pos).abs()
    return (-slopes.to(device)[:, None, None] * dist[None]).to(dtype)


def sdpa_mask(allowed: Optional[torch.Tensor], additive: Optional[torch.Tensor], causal: bool, sq: int, sk: int,
              device: torch.device) -> tuple[Optional[torch.Tensor], bool]:
    """``(attn_mask, is_causal)`` for ``F.scaled_dot_product_attention`` from a boolean ``allowed`` mask (True =
    may attend), an additive score bias and causality.  Causality stays SDPA's flag when nothing else is
    given and sq == sk; otherwise it becomes a bottom-right aligned triangle (query i at position
    sk - sq + i: KV-cache prefill / decode) combined with the mask; masked positions of the bias are -inf.
    One rule for :class:`SDPAttention` and the compiled layer (:mod:`workbench.backend.compiled_layer`)."""
    if causal and (sq != sk or additive is not None or allowed is not None):
        tri = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        allowed = tri if allowed is None else (allowed & tri)
        causal = False
    if additive is not None:
        return (additive if allowed is None else additive.masked_fill(~allowed, float("-inf"))), causal
    return allowed, causal


class SDPAttention(MegatronModule):
    """Core attention on ``torch.nn.functional.scaled_dot_product_attention`` (see module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if config.context_parallel_size > 1 else ["tp"])
        self.pg_collection = pg_collection
        # context parallelism: this rank holds a load-balanced shard of each sequence; attention runs as a K/V ring
        # over the CP group (workbench.backend.context_parallel.ring_attention)
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None)
            if self.cp_group is None:  # a collection without the CP group: megatron's own (never local attention)
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
        if self.cp_group is not None:
            if (self.dropout_p_of(config, attention_dropout)) > 0:
                raise ValueError("context parallelism: the ring attention has no dropout; set model.attention_dropout: 0")
            if getattr(config, "workbench_alibi", False):
                raise ValueError("context parallelism: the ring attention takes no ALiBi bias")
        tp_size = pg_collection.tp.size()
        tp_rank = pg_collection.tp.rank()
        projection = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection, tp_size)
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        head_dim = divide(projection, config.num_attention_heads)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # ALiBi: stored as a non-persistent buffer so checkpoints stay identical to stock GPT.
        self.use_alibi = bool(getattr(config, "workbench_alibi", False))
        if self.use_alibi:
            all_slopes = alibi_slopes(config.num_attention_heads)
            lo = tp_rank * self.heads_per_partition
            self.register_buffer("alibi_slopes", all_slopes[lo : lo + self.heads_per_partition].clone(), persistent=False)
        self._bias_cache: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def dropout_p_of(config: TransformerConfig, attention_dropout: Optional[float]) -> float:
        return config.attention_dropout if attention_dropout is None else attention_dropout

    def _alibi(self, sq: int, sk: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (sq, sk, device, dtype)
        bias = self._bias_cache.get(key)
        if bias is None:
            bias = alibi_bias(self.alibi_slopes, sq, sk, device, dtype)
            self._bias_cache = {key: bias}  # keep only the latest shape
        return bias

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences (THD) need Transformer Engine attention; set model.attention_backend: te")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, _, _ = query.shape
        sk = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)

        additive: Optional[torch.Tensor] = None
        if self.use_alibi:
            additive = self._alibi(sq, sk, q.device, q.dtype)[None]
        if attention_bias is not None:
            additive = attention_bias if additive is None else additive + attention_bias

        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        if self.cp_group is not None and self.cp_group.size() > 1:
            return self._ring(q, k, v, attention_mask, mask_type, additive, sq, b)
        allowed: Optional[torch.Tensor] = None  # boolean, True = may attend
        if attention_mask is not None and mask_type != AttnMaskType.no_mask:
            allowed = ~attention_mask.bool()
            causal = causal and mask_type == AttnMaskType.padding_causal
        attn_mask, causal = sdpa_mask(allowed, additive, causal, sq, sk, q.device)

        groups = self.heads_per_partition // self.groups_per_partition
        gqa_kwargs = {}
        if groups > 1:
            if attn_mask is None:
                gqa_kwargs = {"enable_gqa": True}
            else:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)

        dropout_p = self.dropout_p if self.training else 0.0

        def run() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale, **gqa_kwargs
            )

        if dropout_p > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = run()
        else:
            out = run()
        # [b, h, sq, d] -> [sq, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor],
              mask_type: AttnMaskType, additive: Optional[torch.Tensor], sq: int, b: int) -> torch.Tensor:
        """Context parallel: this rank's queries against the whole sequence by ring attention: GPT's implicit causal
        mask, or BERT's key-padding mask (``padding``: ``[b, 1, 1, s_local]``, True = padded, the keys of this rank's
        chunks; the ring gathers every rank's once)."""
        from workbench.backend.context_parallel import key_padding, ring_attention

        if additive is not None:
            raise NotImplementedError("context parallelism: the ring attention takes no additive bias (ALiBi, attention_bias)")
        kv_padding = None
        if mask_type == AttnMaskType.padding and attention_mask is None:
            raise NotImplementedError("context parallelism: a padding mask type without its mask")
        if mask_type == AttnMaskType.padding:
            kv_padding = key_padding(attention_mask, b)
        elif mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise NotImplementedError(f"context parallelism: attention mask type {mask_type.name} is not wired "
                                      "(GPT's implicit causal mask, BERT's key padding)")
        elif attention_mask is not None and mask_type != AttnMaskType.no_mask:
            raise NotImplementedError("context parallelism: an explicit attention mask (per-document masks) is not wired; "
                                      "GPT's causal mask is implicit")
        out = ring_attention(q, k, v, self.cp_group, causal=mask_type == AttnMaskType.causal, scale=self.softmax_scale,
                             kv_padding=kv_padding)
        # [b, h, sq, d] -> [sq, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
