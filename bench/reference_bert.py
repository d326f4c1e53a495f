"""The BERT reference for the throughput rows: HF ``MegatronBertForPreTraining`` (pre-LN, Megatron's layout)
with SDPA attention (transformers 5.23 has no SDPA path for megatron-bert and refuses
``attn_implementation="sdpa"``, so each layer's self-attention is switched to :class:`SDPASelfAttention`: the same
weights and maths, ``torch.nn.functional.scaled_dot_product_attention`` instead of matmul + softmax), compiled with ``torch.compile``, trained like the workbench's step (:class:`bench.harness.HFReference`: grad accumulation
over micro-batches, clip 1.0, fused AdamW, bf16 autocast over fp32 weights), same shapes and batches.

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import HFReference

__all__ = ["ReferenceBert", "SDPASelfAttention"]


def _sdpa_class():
    from transformers.models.megatron_bert.modeling_megatron_bert import MegatronBertSelfAttention

    class SDPASelfAttention(MegatronBertSelfAttention):
        """HF megatron-bert self-attention on torch SDPA (the additive padding mask passed through)."""

        def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
            b, s, _ = hidden_states.shape
            shape = (b, s, -1, self.attention_head_size)
            q, k, v = (lin(hidden_states).view(shape).transpose(1, 2) for lin in (self.query, self.key, self.value))
            mask = attention_mask.to(q.dtype) if attention_mask is not None and attention_mask.is_floating_point() else attention_mask
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout.p if self.training else 0.0)
            return ctx.transpose(1, 2).reshape(b, s, self.all_head_size), None

    return SDPASelfAttention


def SDPASelfAttention():  # noqa: N802 - the class, built on first use (transformers is imported lazily)
    return _sdpa_class()


class ReferenceBert(HFReference):
    def __init__(self, cfg: Any, device: str = "cuda", compile: bool = True):
        from transformers import MegatronBertConfig, MegatronBertForPreTraining

        m = cfg.model
        hf = MegatronBertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                                num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
                                max_position_embeddings=m.max_position_embeddings, type_vocab_size=max(m.num_tokentypes, 1),
                                hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
                                layer_norm_eps=m.norm_epsilon)
        model = MegatronBertForPreTraining(hf)
        sdpa = _sdpa_class()
        for layer in model.bert.encoder.layer:
            layer.attention.self.__class__ = sdpa
        super().__init__(model, cfg, device, compile)
        self.positions = torch.arange(m.seq_length, device=self.device)[None]

    def _loss(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.forward(input_ids=b["tokens"], attention_mask=b["padding_mask"], token_type_ids=b.get("tokentype_ids"),
                           position_ids=self.positions.expand_as(b["tokens"]))
        logits = out.prediction_logits.float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), b["labels"].view(-1), reduction="none")
        mask = b["loss_mask"].view(-1).float()
        loss = (losses * mask).sum() / mask.sum().clamp(min=1)
        if "is_random" in b:
            loss = loss + F.cross_entropy(out.seq_relationship_logits.float(), b["is_random"].view(-1))
        return loss
