"""The T5 yardstick for the throughput rows: what a capable user trains with public tools.

HF's own ``T5ForConditionalGeneration`` of the workbench config's shape (v1.0 ReLU + tied/scaled head, or v1.1 gated
GELU), on torch SDPA attention (``attn_implementation="sdpa"``: transformers 5.24 serves T5's relative position
bias through SDPA's additive mask; where a transformers refuses SDPA for T5, HF's eager attention, and the row
says so: :attr:`ReferenceT5.attention`),
the whole model under ``torch.compile``, trained like the workbench's step (:class:`bench.harness.HFReference`:
grad accumulation over micro-batches, clip 1.0, fused AdamW, bf16 autocast over fp32 weights) on the same
span-corruption batches, without the decoder's generation cache (``use_cache=False``).  The loss is HF's own: the
token mean of the decoder's cross-entropy over its real targets (labels -100 elsewhere).

Dropout is the preset's: HF's ``dropout_rate`` is the hidden dropout; HF applies the same rate to the attention
probabilities, so each attention module's rate is set to the preset's attention dropout (0 in the T5 presets).

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.harness import HFReference

__all__ = ["ReferenceT5", "hf_t5_config"]


def hf_t5_config(cfg: Any, attention: str = "sdpa"):
    from transformers import T5Config

    m = cfg.model
    ff = {"relu": "relu", "geglu": "gated-gelu", "gelu": "gelu", "swiglu": "gated-silu"}[m.activation]
    return T5Config(vocab_size=m.vocab_size, d_model=m.hidden_size, d_kv=m.head_dim, d_ff=m.ffn_size, num_layers=m.num_layers,
                    num_decoder_layers=m.decoder_layers, num_heads=m.num_attention_heads,
                    relative_attention_num_buckets=m.relative_attention_num_buckets,
                    relative_attention_max_distance=m.relative_attention_max_distance, dropout_rate=m.hidden_dropout,
                    layer_norm_epsilon=m.norm_epsilon, feed_forward_proj=ff, tie_word_embeddings=m.tie_embeddings,
                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, attn_implementation=attention)


def build_hf_t5(cfg: Any, device: str) -> Any:
    """HF's T5 of the config's shape on SDPA attention (eager where transformers refuses SDPA for T5), its
    attention dropout the preset's (module docstring)."""
    import transformers
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Attention

    try:
        model = T5ForConditionalGeneration(hf_t5_config(cfg))
        attention = model.config._attn_implementation
    except ValueError as e:  # this transformers has no SDPA path for T5
        model = T5ForConditionalGeneration(hf_t5_config(cfg, "eager"))
        attention = f"eager (transformers {transformers.__version__} refused SDPA for T5: {str(e)[:120]})"
    model.workbench_attention = attention
    for module in model.modules():
        if isinstance(module, T5Attention):
            module.dropout = cfg.model.attention_dropout
    return model.to(device)


class ReferenceT5(HFReference):
    def __init__(self, cfg: Any, device: str = "cuda", compile: bool = True, mode: str | None = None):
        model = build_hf_t5(cfg, device)
        #: the attention HF's T5 runs on here: "sdpa", or "eager (...why)"
        self.attention = model.workbench_attention
        super().__init__(model, cfg, device, compile, mode)

    def _loss(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = torch.where(b["loss_mask"] > 0, b["labels"], -100)  # HF's convention: -100 is ignored
        # use_cache=False: training needs no decoder cache; left on, HF's decoder builds one every forward and
        # torch.compile breaks the graph there (copy.deepcopy of the config: 4 breaks a step, never steady, 2026-11-29)
        return self.forward(input_ids=b["tokens"], attention_mask=b["enc_mask"], decoder_input_ids=b["dec_tokens"],
                            labels=labels, use_cache=False).loss
