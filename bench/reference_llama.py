"""A plain-PyTorch Llama: the yardstick for the Llama rows of bench/train_throughput.py.

Benchmark-only code (never imported by the product).  It builds the SAME architecture as a
workbench :class:`~workbench.config.RunConfig` with Llama fields (RoPE, RMSNorm, SwiGLU,
grouped-query attention, no linear biases, tied or untied head, the padded vocabulary from
``derive(cfg)``): per layer RMSNorm -> one q/k/v projection -> RoPE (megatron's non-interleaved
rotate-half, fp32 frequencies) -> torch SDPA causal -> output projection -> residual; RMSNorm ->
SwiGLU MLP (``silu(gate) * up``, gate and up in one GEMM) -> residual.
It trains through :class:`bench.reference_gpt.ReferenceTrainer`'s step (fp32 master weights,
bf16 autocast, fused AdamW with Megatron's weight-decay groups, grad clipping, loss averaged
over micro-batches, ``torch.compile`` of the whole model).

Written as fast as a plain compiled Llama goes (an earlier version ran 9% below a plain compiled Llama of the
same shape on an H100; what changed, each a candidate for that gap):

- the residual stream in the autocast dtype (bf16, as megatron's): under autocast the embedding's output is fp32,
  which made every residual add, norm input and saved residual fp32 (twice their memory traffic);
- the KV heads expanded to the query heads before SDPA rather than SDPA's ``enable_gqa`` (which torch served with
  its flash kernel only, pytorch#139586), and the process's SDPA order cuDNN first on Hopper
  (:func:`workbench.backend.attention.apply_sdpa_order`): cuDNN's attention measured 0.38 ms against flash's
  0.57 ms forward + backward on an H100 (``workbench.kernel_rule.KernelChoice.sdpa_order``);
- the rotary tables computed once (buffers), not in every forward;
- the loss as ``F.cross_entropy`` on the logits under autocast (which runs it in fp32), not on an explicit fp32
  copy of the logits.

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
    seq_length: int = 2048  # the rotary tables' length


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
                     init_std=m.init_method_std, seq_length=m.seq_length)


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
        if g != a:  # expanded KV heads: SDPA's cuDNN / flash kernels without the GQA flag (see the module docstring)
            k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        cos, sin = rope_tables(s, s.seq_length, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():  # megatron's init: N(0, std), output projections scaled
            if p.dim() >= 2:
                scaled = name.endswith(("o_proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, s.init_std / math.sqrt(2 * s.num_layers) if scaled else s.init_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, V], or the mean next-token loss when labels are given."""
        t = tokens.shape[1]
        cos, sin = (self.rope_cos[:t], self.rope_sin[:t]) if t <= self.spec.seq_length else \
            rope_tables(self.spec, t, tokens.device)
        x = self.wte(tokens)
        if torch.is_autocast_enabled(tokens.device.type):  # the residual stream in bf16 (module docstring)
            x = x.to(torch.get_autocast_dtype(tokens.device.type))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


class LlamaTrainer(ReferenceTrainer):
    """reference_gpt's trainer (its ``step``: grad accumulation, clipping, AdamW) around the Llama."""

    def build(self, cfg, gelu_approximate: str = "none") -> tuple:
        spec = spec_from_config(cfg)
        if torch.cuda.is_available():
            from workbench.backend.attention import apply_sdpa_order
            from workbench.kernel_rule import SDPA_CUDNN_FIRST

            apply_sdpa_order(SDPA_CUDNN_FIRST)  # Hopper and later only
        return spec, ReferenceLlama(spec)
