"""The T5 reference for the throughput rows: HF ``T5ForConditionalGeneration`` of the workbench config's shape
(v1.0 ReLU + tied/scaled head, or v1.1 gated GELU), attention on torch SDPA where transformers offers it
(``attn_implementation="sdpa"``, else eager), compiled with ``torch.compile``, trained like the workbench's
step (:class:`bench.harness.HFReference`: grad accumulation over micro-batches, clip 1.0, fused AdamW, bf16
autocast over fp32 weights), same shapes and span-corruption batches; the loss is the token mean over the
decoder's real targets.

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import HFReference

__all__ = ["ReferenceT5", "hf_t5_config"]


def hf_t5_config(cfg: Any):
    from transformers import T5Config

    m = cfg.model
    ff = {"relu": "relu", "geglu": "gated-gelu", "gelu": "gelu", "swiglu": "gated-silu"}[m.activation]
    return T5Config(vocab_size=m.vocab_size, d_model=m.hidden_size, d_kv=m.head_dim, d_ff=m.ffn_size, num_layers=m.num_layers,
                    num_decoder_layers=m.decoder_layers, num_heads=m.num_attention_heads,
                    relative_attention_num_buckets=m.relative_attention_num_buckets,
                    relative_attention_max_distance=m.relative_attention_max_distance, dropout_rate=m.hidden_dropout,
                    layer_norm_epsilon=m.norm_epsilon, feed_forward_proj=ff, tie_word_embeddings=m.tie_embeddings,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def build_hf_t5(cfg: Any, device: str) -> Any:
    from transformers import T5ForConditionalGeneration

    try:
        return T5ForConditionalGeneration(hf_t5_config(cfg), attn_implementation="sdpa").to(device)
    except (ValueError, TypeError):
        return T5ForConditionalGeneration(hf_t5_config(cfg)).to(device)


class ReferenceT5(HFReference):
    def __init__(self, cfg: Any, device: str = "cuda", compile: bool = True):
        super().__init__(build_hf_t5(cfg, device), cfg, device, compile)

    def _loss(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.forward(input_ids=b["tokens"], attention_mask=b["enc_mask"], decoder_input_ids=b["dec_tokens"])
        logits = out.logits.float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), b["labels"].view(-1), reduction="none")
        mask = b["loss_mask"].view(-1).float()
        return (losses * mask).sum() / mask.sum().clamp(min=1)
