"""The BERT yardstick for the throughput rows: what a capable user trains with public tools.

HF's own ``BertForPreTraining`` (``attn_implementation="sdpa"``: torch SDPA, flash / cuDNN / memory-efficient
kernels under BERT's padding mask) of the workbench config's shape (layers, hidden, heads, FFN, 512 positions, two
token types, the preset's hidden and attention dropout), the whole model under ``torch.compile``, trained like the
workbench's step (:class:`bench.harness.HFReference`: grad accumulation over micro-batches, clip 1.0, fused AdamW,
bf16 autocast over fp32 weights) on the same batches (BERT's padding included).  The loss is HF's own: masked-LM
cross-entropy over the masked positions (labels -100 elsewhere) plus the next-sentence (here sentence-order) loss,
i.e. the workbench's ``MLM token mean + sentence-order mean``.  As HF users run it, its head computes logits at
every position, and its layout is HF's post-LN BERT (the workbench trains Megatron's pre-LN layout: the same
parameter count and FLOPs).

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import HFReference

__all__ = ["ReferenceBert", "hf_bert_config"]


def hf_bert_config(cfg: Any):
    """HF's ``BertConfig`` of the workbench config's shape and dropout, on SDPA attention."""
    from transformers import BertConfig

    m = cfg.model
    return BertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                      num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_size,
                      max_position_embeddings=m.max_position_embeddings, type_vocab_size=max(m.num_tokentypes, 1),
                      hidden_dropout_prob=m.hidden_dropout, attention_probs_dropout_prob=m.attention_dropout,
                      layer_norm_eps=m.norm_epsilon, hidden_act="gelu", attn_implementation="sdpa")


class ReferenceBert(HFReference):
    def __init__(self, cfg: Any, device: str = "cuda", compile: bool = True, mode: str | None = None):
        from transformers import BertForPreTraining

        model = BertForPreTraining(hf_bert_config(cfg))
        #: the attention HF's BERT runs on here
        self.attention = model.config._attn_implementation
        super().__init__(model, cfg, device, compile, mode)

    def _loss(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = torch.where(b["loss_mask"] > 0, b["labels"], -100)  # HF's convention: -100 is ignored
        out = self.forward(input_ids=b["tokens"], attention_mask=b["padding_mask"], token_type_ids=b.get("tokentype_ids"),
                           labels=labels, next_sentence_label=b.get("is_random"))
        if out.loss is not None:
            return out.loss
        # no sentence-order label (a model without the binary head): HF computes no loss; the MLM mean
        logits = out.prediction_logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
