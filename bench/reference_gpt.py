"""A plain nanoGPT-style PyTorch GPT: the yardstick the workbench backend is measured against.

Benchmark-only code (never imported by the product).  It builds the SAME architecture as a
workbench :class:`~workbench.config.RunConfig` (learned positions, pre-LayerNorm, biases,
tied embeddings, GELU MLP, the padded vocabulary from ``derive(cfg)``) and trains it the way
nanoGPT does: fp32 master weights, bf16 autocast, torch SDPA (flash) attention, fused AdamW,
``torch.compile`` of the whole model.  The optimizer maths is Megatron's: AdamW with
decoupled weight decay on >=2-D weights only, global-norm gradient clipping
(``coef = clip / (norm + 1e-6)`` applied when < 1), loss averaged over micro-batches.

Layout differences from megatron-core ([b, s, h] here, [s, b, h] there; one fused QKV
matrix in both) do not change the maths or the FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ReferenceSpec", "ReferenceGPT", "spec_from_config", "build_reference", "ReferenceTrainer"]


@dataclass(frozen=True)
class ReferenceSpec:
    """The architecture, read off a workbench config so both sides build the same network."""

    vocab_size: int  # padded, as the workbench pads it
    seq_length: int
    max_positions: int
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_size: int
    norm_epsilon: float
    bias: bool
    tie_embeddings: bool
    #: "tanh" when megatron's fused bias-GELU is in use (it implements the tanh approximation), else "none".
    gelu_approximate: str
    init_std: float


def spec_from_config(cfg, gelu_approximate: str = "none") -> ReferenceSpec:
    """Reference architecture for a workbench RunConfig (GPT-2 style models only)."""
    from workbench.config import derive

    m = cfg.model
    unsupported = []
    if m.position_embedding != "learned":
        unsupported.append(f"position_embedding={m.position_embedding}")
    if m.normalization != "layernorm":
        unsupported.append(f"normalization={m.normalization}")
    if m.activation != "gelu":
        unsupported.append(f"activation={m.activation}")
    if m.query_groups != m.num_attention_heads:
        unsupported.append(f"attention_type={m.attention_type}")
    if unsupported:
        raise ValueError(f"the reference GPT is GPT-2 style only; config has {', '.join(unsupported)}")
    return ReferenceSpec(
        vocab_size=derive(cfg).padded_vocab_size,
        seq_length=m.seq_length,
        max_positions=m.max_position_embeddings,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_heads=m.num_attention_heads,
        ffn_size=m.ffn_size,
        norm_epsilon=m.norm_epsilon,
        bias=m.add_bias_linear,
        tie_embeddings=m.tie_embeddings,
        gelu_approximate=gelu_approximate,
        init_std=m.init_method_std,
    )


class Block(nn.Module):
    def __init__(self, s: ReferenceSpec):
        super().__init__()
        h = s.hidden_size
        self.n_head = s.num_heads
        self.ln_1 = nn.LayerNorm(h, eps=s.norm_epsilon)
        self.c_attn = nn.Linear(h, 3 * h, bias=s.bias)
        self.c_proj = nn.Linear(h, h, bias=s.bias)
        self.ln_2 = nn.LayerNorm(h, eps=s.norm_epsilon)
        self.c_fc = nn.Linear(h, s.ffn_size, bias=s.bias)
        self.mlp_proj = nn.Linear(s.ffn_size, h, bias=s.bias)
        self.gelu_approximate = s.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q = q.view(b, t, self.n_head, h // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, h // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, h // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, h)
        x = x + self.c_proj(y)
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate=self.gelu_approximate))
        return x


class ReferenceGPT(nn.Module):
    def __init__(self, s: ReferenceSpec):
        super().__init__()
        self.spec = s
        self.wte = nn.Embedding(s.vocab_size, s.hidden_size)
        self.wpe = nn.Embedding(s.max_positions, s.hidden_size)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.ln_f = nn.LayerNorm(s.hidden_size, eps=s.norm_epsilon)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():  # megatron's scaled init of output projections
            if name.endswith("c_proj.weight") or name.endswith("mlp_proj.weight"):
                nn.init.normal_(p, 0.0, s.init_std / math.sqrt(2 * s.num_layers))

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, self.spec.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [b, s, V], or the mean next-token loss when labels are given."""
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.reshape(-1))


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Megatron's rule: no weight decay on biases and 1-D (norm) parameters."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_reference(cfg, device: str | torch.device = "cuda", compile: bool = True, gelu_approximate: str = "none"):
    """(model, optimizer, step_fn-ready trainer) for a workbench config; fused AdamW on CUDA."""
    return ReferenceTrainer(cfg, device=device, compile=compile, gelu_approximate=gelu_approximate)


class ReferenceTrainer:
    """One optimizer step = the workbench's step: grad accumulation over micro-batches, clip, AdamW."""

    def __init__(self, cfg, device: str | torch.device = "cuda", compile: bool = True, gelu_approximate: str = "none"):
        from workbench.config import derive

        self.cfg = cfg
        self.device = torch.device(device)
        torch.manual_seed(cfg.train.seed)
        self.spec, model = self.build(cfg, gelu_approximate)
        self.model = model.to(self.device)
        t = cfg.train
        cuda = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            _param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps, fused=cuda,
        )
        self.num_microbatches = derive(cfg).num_microbatches
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.forward = torch.compile(self.model) if compile else self.model

    def build(self, cfg, gelu_approximate: str = "none") -> tuple:
        """(spec, model) of the architecture trained: the GPT here; other references override this."""
        spec = spec_from_config(cfg, gelu_approximate)
        return spec, ReferenceGPT(spec)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One training step over ``num_microbatches`` (tokens, labels) pairs; returns the mean loss."""
        assert len(batches) == self.num_microbatches, (len(batches), self.num_microbatches)
        total = torch.zeros((), device=self.device)
        for tokens, labels in batches:
            with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32,
                                enabled=self.autocast_dtype is not None):
                loss = self.forward(tokens, labels) / self.num_microbatches
            loss.backward()
            total += loss.detach()
        if self.cfg.train.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_grad, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)
