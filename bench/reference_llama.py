"""A plain-PyTorch Llama: the yardstick for the Llama rows of bench/train_throughput.py.

Benchmark-only code (never imported by the product).  It builds the SAME architecture as a
workbench :class:`~workbench.config.RunConfig` with Llama fields (RoPE, RMSNorm, SwiGLU,
grouped-query attention, no linear biases, tied or untied head, the padded vocabulary from
``derive(cfg)``): per layer RMSNorm -> one q/k/v projection -> RoPE (megatron's non-interleaved
rotate-half, fp32 frequencies) -> torch SDPA causal with ``enable_gqa`` -> output projection ->
residual; RMSNorm -> SwiGLU MLP (``silu(gate) * up``, gate and up in one GEMM) -> residual.
It trains through :class:`bench.reference_gpt.ReferenceTrainer`'s step (fp32 master weights,
bf16 autocast, fused AdamW with Megatron's weight-decay groups, grad clipping, loss averaged
over micro-batches, ``torch.compile`` of the whole model).

Layout differences from megatron-core ([b, s, h] here, [s, b, h] there; q/k/v rows grouped as
[all q | all k | all v] here, per KV group [q_1..q_{a/g}, k, v] there) do not change the maths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from bench.reference_gpt import ReferenceTrainer

__all__ = ["LlamaSpec", "ReferenceLlama", "spec_from_config", "LlamaTrainer"]


@dataclass(frozen=True)
class LlamaSpec:
    """The architecture, read off a workbench config so both sides build the same network."""

    vocab_size: int  # padded, as the workbench pads it
    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int  # KV heads
    head_dim: int
    ffn_size: int
    rotary_base: float
    norm_epsilon: float
    tie_embeddings: bool
    init_std: float


def spec_from_config(cfg) -> LlamaSpec:
    """Reference architecture for a workbench RunConfig (Llama-style models only)."""
    from workbench.config import derive

    m = cfg.model
    wrong = [f"{k}={getattr(m, k)}" for k, want in (("position_embedding", "rope"), ("rotary_percent", 1.0),
             ("normalization", "rmsnorm"), ("activation", "swiglu"), ("add_bias_linear", False)) if getattr(m, k) != want]
    if wrong:
        raise ValueError(f"the reference Llama is Llama style only; config has {', '.join(wrong)}")
    return LlamaSpec(vocab_size=derive(cfg).padded_vocab_size, num_layers=m.num_layers, hidden_size=m.hidden_size,
                     num_heads=m.num_attention_heads, num_groups=m.query_groups, head_dim=m.head_dim, ffn_size=m.ffn_size,
                     rotary_base=m.rotary_base, norm_epsilon=m.norm_epsilon, tie_embeddings=m.tie_embeddings,
                     init_std=m.init_method_std)


def rope_tables(s: LlamaSpec, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim], megatron's RotaryEmbedding: fp32 inverse frequencies, cat(freqs, freqs)."""
    d = s.head_dim
    inv_freq = 1.0 / (s.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved rotate-half; cos/sin cast to x's dtype first, as megatron does."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        h, d = s.hidden_size, s.head_dim
        self.a, self.g, self.d = s.num_heads, s.num_groups, d
        self.attn_norm = nn.RMSNorm(h, eps=s.norm_epsilon)
        self.qkv = nn.Linear(h, (s.num_heads + 2 * s.num_groups) * d, bias=False)
        self.o_proj = nn.Linear(s.num_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=s.norm_epsilon)
        self.gate_up = nn.Linear(h, 2 * s.ffn_size, bias=False)  # [gate | up], megatron's fc1 order
        self.down = nn.Linear(s.ffn_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        a, g, d = self.a, self.g, self.d
        q, k, v = self.qkv(self.attn_norm(x)).split([a * d, g * d, g * d], dim=-1)
        q = apply_rope(q.view(b, t, a, d).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, g, d).transpose(1, 2), cos, sin)
        v = v.view(b, t, g, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g != a)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, a * d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class ReferenceLlama(nn.Module):
    def __init__(self, s: LlamaSpec):
        super().__init__()
        self.spec = s
        self.wte = nn.Embedding(s.vocab_size, s.hidden_size)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.norm_f = nn.RMSNorm(s.hidden_size, eps=s.norm_epsilon)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # megatron's init: N(0, std), output projections scaled
            if p.dim() >= 2:
                scaled = name.endswith(("o_proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, s.init_std / math.sqrt(2 * s.num_layers) if scaled else s.init_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, V], or the mean next-token loss when labels are given."""
        cos, sin = rope_tables(self.spec, tokens.shape[1], tokens.device)
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.reshape(-1))


class LlamaTrainer(ReferenceTrainer):
    """reference_gpt's trainer (its ``step``: grad accumulation, clipping, AdamW) around the Llama."""

    def build(self, cfg, gelu_approximate: str = "none") -> tuple:
        spec = spec_from_config(cfg)
        return spec, ReferenceLlama(spec)
