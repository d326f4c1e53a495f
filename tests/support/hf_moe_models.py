"""Tiny random HF MoE models made to show conversion mistakes (the Qwen3-MoE and OLMoE conversion tests share it)."""

from __future__ import annotations

import torch


def spread(model, head_dim: int | None = None, seed: int = 1):
    """Move ``model``'s fresh weights (in place) so a conversion mistake shows in its logits: every weight nudged, the
    routers' logits spread far from top-k ties, the q/k norms far from ones; ``head_dim``: the q/k projections' heads
    also scaled unequally, so a norm over each head differs from one over all heads.  Returns ``model`` in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
            if name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
            if name.endswith("_norm.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
            if head_dim and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = p.shape[0] // head_dim
                p.mul_(torch.linspace(0.3, 3.0, heads).repeat_interleave(head_dim)[:, None])
    return model.eval()
