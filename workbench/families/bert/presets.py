"""BERT presets: nested RunConfig sections (fields not named take the RunConfig defaults).

``bert-tiny`` trains on a CPU in the backend's CPU mode (the embedded corpus, the demo WordPiece
tokenizer); ``bert-base`` / ``bert-large`` are the published BERT shapes (Devlin et al., 2019:
30,522-token WordPiece vocabulary, 512 positions, two token types, dropout 0.1) on Megatron's
pre-LN layout.  All three train the masked-LM and the sentence-order (binary head) losses.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

_BERT_MODEL = dict(arch="bert", num_tokentypes=2, add_binary_head=True, position_embedding="learned",
                   normalization="layernorm", activation="gelu", add_bias_linear=True, tie_embeddings=True,
                   norm_epsilon=1e-12, init_method_std=0.02)


def _bert(layers: int, hidden: int, heads: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": dict(_BERT_MODEL, num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=30522,
                      max_position_embeddings=512, seq_length=512, hidden_dropout=0.1, attention_dropout=0.1),
        "train": dict(micro_batch_size=8, global_batch_size=64, train_iters=1000, lr=1e-4, min_lr=1e-5, lr_warmup_iters=100,
                      lr_decay_style="linear", weight_decay=0.01, adam_beta2=0.999, adam_eps=1e-6),
        "data": dict(source="demo", tokenizer="demo-wordpiece"),
    }


PRESETS: dict[str, dict[str, Any]] = {
    "bert-tiny": {
        "name": "bert-tiny",
        "model": dict(_BERT_MODEL, num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=4096,
                      max_position_embeddings=128, seq_length=64, make_vocab_size_divisible_by=64),
        "parallel": dict(device="cpu"),
        "train": dict(micro_batch_size=4, global_batch_size=8, train_iters=20, lr=2e-3, min_lr=2e-4, lr_warmup_iters=2,
                      weight_decay=0.01, eval_interval=10, eval_iters=2, precision="fp32", compile_kernels=False),
        "data": dict(source="demo", tokenizer="demo-wordpiece"),
    },
    "bert-base": _bert(12, 768, 12, "bert-base"),
    "bert-large": _bert(24, 1024, 16, "bert-large"),
}
