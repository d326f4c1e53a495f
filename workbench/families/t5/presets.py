"""T5 presets: nested RunConfig sections (fields not named take the RunConfig defaults).

``t5-tiny`` trains on a CPU in the backend's CPU mode (span corruption on the embedded corpus with
the demo sentinel tokenizer).  ``t5-small`` / ``t5-base`` are the published shapes (Raffel et al.,
2020; 32,128-token SentencePiece vocabulary with 100 sentinels, 32 relative-position buckets,
max distance 128, RMS norm without bias, no linear biases) in two styles: v1.0 (ReLU MLP, tied
embeddings and head, decoder output scaled by ``d_model ** -0.5``) and v1.1 (gated-GELU MLP,
untied head, no scaling; mT5's layout).  Encoder 512 / decoder 114 tokens is T5's pretraining
setting (noise density 0.15, mean span 3).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_T5_MODEL = dict(arch="t5", position_embedding="relative", normalization="rmsnorm", norm_epsilon=1e-6,
                 add_bias_linear=False, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                 init_method_std=0.02, attention_backend="auto")


def _t5(name: str, layers: int, hidden: int, heads: int, ffn: int, v11: bool) -> dict[str, Any]:
    style = dict(activation="geglu", gelu_approximate="tanh", tie_embeddings=False) if v11 else \
        dict(activation="relu", tie_embeddings=True)
    return {
        "name": name,
        "model": dict(_T5_MODEL, **style, num_layers=layers, decoder_num_layers=layers, hidden_size=hidden,
                      num_attention_heads=heads, kv_channels=64, ffn_hidden_size=ffn, vocab_size=32128,
                      make_vocab_size_divisible_by=128, max_position_embeddings=512, seq_length=512,
                      decoder_seq_length=114, hidden_dropout=0.1, attention_dropout=0.0),
        "train": dict(micro_batch_size=16, global_batch_size=128, train_iters=1000, lr=1e-4, min_lr=1e-5,
                      lr_warmup_iters=100, lr_decay_style="linear", weight_decay=0.01, adam_beta2=0.999),
        "data": dict(source="demo", tokenizer="demo-t5"),
    }


PRESETS: dict[str, dict[str, Any]] = {
    "t5-tiny": {
        "name": "t5-tiny",
        "model": dict(_T5_MODEL, activation="geglu", gelu_approximate="tanh", tie_embeddings=False, num_layers=2,
                      decoder_num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=4196,
                      make_vocab_size_divisible_by=64, max_position_embeddings=128, seq_length=64, decoder_seq_length=24,
                      relative_attention_num_buckets=16, relative_attention_max_distance=32),
        "parallel": dict(device="cpu"),
        "train": dict(micro_batch_size=4, global_batch_size=8, train_iters=20, lr=3e-3, min_lr=3e-4, lr_warmup_iters=2,
                      weight_decay=0.01, eval_interval=10, eval_iters=2, precision="fp32", compile_kernels=False),
        "data": dict(source="demo", tokenizer="demo-t5"),
    },
    "t5-small": _t5("t5-small", 6, 512, 8, 2048, v11=False),
    "t5-base": _t5("t5-base", 12, 768, 12, 3072, v11=False),
    "t5-v1_1-small": _t5("t5-v1_1-small", 8, 512, 6, 1024, v11=True),
    "t5-v1_1-base": _t5("t5-v1_1-base", 12, 768, 12, 2048, v11=True),
}
