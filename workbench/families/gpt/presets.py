"""GPT presets: nested RunConfig sections (fields not named take the RunConfig defaults)."""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]


def _gpt2(layers: int, hidden: int, heads: int, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, vocab_size=50257,
                      max_position_embeddings=1024, seq_length=1024, hidden_dropout=0.0, attention_dropout=0.0),
        "train": dict(micro_batch_size=8, global_batch_size=64, train_iters=1000, lr=6e-4, min_lr=6e-5, lr_warmup_iters=100),
        "data": dict(source="demo"),
    }


def _demo_small() -> dict[str, Any]:
    """A small GPT on the embedded corpus: trains in minutes on one GPU."""
    cfg = _gpt2(6, 384, 6, "demo-small")
    cfg["model"].update(vocab_size=4096, seq_length=256, max_position_embeddings=256)  # the demo tokenizer's vocabulary
    cfg["train"] = dict(micro_batch_size=16, global_batch_size=32, train_iters=200, lr=1e-3, min_lr=1e-4, lr_warmup_iters=20)
    return cfg


def _llama3(layers: int, hidden: int, heads: int, ffn: int, tied: bool, name: str) -> dict[str, Any]:
    """Llama 3.x shapes (Meta's published configs): GQA with 8 KV heads, RoPE base 500000, RMSNorm, SwiGLU,
    no linear biases, the 128256-token vocabulary.  Plain RoPE: the published Llama 3.1 / 3.2 checkpoints
    also rescale the low RoPE frequencies (HF ``rope_type: llama3``), which the workbench model has not."""
    return {
        "name": name,
        "model": dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, attention_type="grouped",
                      num_query_groups=8, ffn_hidden_size=ffn, vocab_size=128256, max_position_embeddings=131072,
                      seq_length=2048, position_embedding="rope", rotary_base=500000.0, normalization="rmsnorm",
                      norm_epsilon=1e-5, activation="swiglu", add_bias_linear=False, tie_embeddings=tied,
                      hidden_dropout=0.0, attention_dropout=0.0),
        "train": dict(micro_batch_size=4, global_batch_size=64, train_iters=1000, lr=3e-4, min_lr=3e-5, lr_warmup_iters=100),
    }


def _moe(name: str, layers: int, hidden: int, heads: int, groups: int, ffn: int, experts: int, top_k: int, expert_ffn: int,
         vocab: int, max_pos: int, rope_base: float, eps: float, pre_softmax: bool, kv: int | None = None,
         z_loss: float = 0.0, qk: bool = False, qk_scope: str = "head") -> dict[str, Any]:
    """A Llama-shaped MoE decoder (RoPE, RMSNorm, SwiGLU experts, no biases, untied output layer), MoE on every layer;
    ``qk``: q/k norms (``qk_layernorm``), per head or over all heads at once (``qk_scope``: ``qk_norm_scope``)."""
    return {
        "name": name,
        "model": dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, attention_type="grouped" if groups != heads else "multihead",
                      num_query_groups=groups if groups != heads else None, kv_channels=kv, ffn_hidden_size=ffn, vocab_size=vocab,
                      max_position_embeddings=max_pos, seq_length=min(4096, max_pos), position_embedding="rope", rotary_base=rope_base,
                      normalization="rmsnorm", norm_epsilon=eps, activation="swiglu", add_bias_linear=False, tie_embeddings=False,
                      hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=qk, qk_norm_scope=qk_scope,
                      moe=dict(num_experts=experts, top_k=top_k, ffn_hidden_size=expert_ffn, router_pre_softmax=pre_softmax,
                               aux_loss_coeff=0.01, z_loss_coeff=z_loss)),
        "train": dict(micro_batch_size=1, global_batch_size=64, train_iters=1000, lr=3e-4, min_lr=3e-5, lr_warmup_iters=100),
    }


def _moe_research() -> dict[str, Any]:
    """A research-scale MoE for one 80 GB GPU on the embedded corpus: 1.66B parameters, 0.31B active per token
    (16 layers, hidden 1024, 64 fine-grained experts of FFN 512, top-8; OLMoE's proportions at a quarter width)."""
    cfg = _moe("moe-research", 16, 1024, 16, 4, 2816, 64, 8, 512, 4096, 2048, 10000.0, 1e-5, False, z_loss=1e-3)
    cfg["model"].update(seq_length=2048)
    cfg["train"] = dict(micro_batch_size=8, global_batch_size=32, train_iters=300, lr=1e-3, min_lr=1e-4, lr_warmup_iters=30)
    cfg["data"] = dict(source="demo")
    return cfg


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "name": "tiny",
        "model": dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=4096,
                      max_position_embeddings=128, seq_length=64, make_vocab_size_divisible_by=64),
        "parallel": dict(device="cpu"),
        "train": dict(micro_batch_size=2, global_batch_size=4, train_iters=10, lr=1e-3, min_lr=1e-4,
                      lr_warmup_iters=2, eval_interval=5, eval_iters=2, precision="fp32", compile_kernels=False),
        "data": dict(source="demo"),
    },
    "moe-tiny": {
        "name": "moe-tiny",
        "model": dict(num_layers=2, hidden_size=64, num_attention_heads=4, attention_type="grouped", num_query_groups=2,
                      ffn_hidden_size=128, vocab_size=4096, max_position_embeddings=128, seq_length=64, make_vocab_size_divisible_by=64,
                      position_embedding="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                      tie_embeddings=False, moe=dict(num_experts=8, top_k=2, ffn_hidden_size=64, z_loss_coeff=1e-3,
                                                     router_stats_interval=1)),
        "parallel": dict(device="cpu"),
        "train": dict(micro_batch_size=2, global_batch_size=4, train_iters=10, lr=3e-3, min_lr=3e-4,
                      lr_warmup_iters=2, eval_interval=5, eval_iters=2, precision="fp32", compile_kernels=False),
        "data": dict(source="demo"),
    },
    "moe-research": _moe_research(),
    # published shapes (plan them; Qwen3-MoE's per-head q/k norms are qk_layernorm; OLMoE's span all heads:
    # qk_norm_scope all_heads)
    "mixtral-8x7b": _moe("mixtral-8x7b", 32, 4096, 32, 8, 14336, 8, 2, 14336, 32000, 32768, 1e6, 1e-5, False),
    "qwen3-30b-a3b": _moe("qwen3-30b-a3b", 48, 2048, 32, 4, 6144, 128, 8, 768, 151936, 40960, 1e6, 1e-6, False, kv=128, qk=True),
    "olmoe-1b-7b": _moe("olmoe-1b-7b", 16, 2048, 16, 16, 1024, 64, 8, 1024, 50304, 4096, 10000.0, 1e-5, True, z_loss=1e-3,
                        qk=True, qk_scope="all_heads"),
    "demo-small": _demo_small(),
    "gpt2-small": _gpt2(12, 768, 12, "gpt2-small"),
    "gpt2-medium": _gpt2(24, 1024, 16, "gpt2-medium"),
    "gpt2-large": _gpt2(36, 1280, 20, "gpt2-large"),
    "gpt2-xl": _gpt2(48, 1600, 25, "gpt2-xl"),
    "llama-small": {
        "name": "llama-small",
        "model": dict(num_layers=12, hidden_size=768, num_attention_heads=12, attention_type="grouped",
                      num_query_groups=4, vocab_size=32000, max_position_embeddings=2048, seq_length=1024,
                      position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                      add_bias_linear=False, tie_embeddings=False, norm_epsilon=1e-6),
        "train": dict(micro_batch_size=8, global_batch_size=64, train_iters=1000, lr=3e-4, lr_warmup_iters=100),
    },
    "llama3.2-1b": _llama3(16, 2048, 32, 8192, True, "llama3.2-1b"),
    "llama3.2-3b": _llama3(28, 3072, 24, 8192, True, "llama3.2-3b"),
    "llama3.1-8b": _llama3(32, 4096, 32, 14336, False, "llama3.1-8b"),
}
