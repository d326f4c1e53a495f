"""Megatron's token-mean LM loss, the default loss of the decoder families (GPT, T5).

``token_mean_loss(batch, losses)`` -> ``(loss_sum, num_tokens, report)``: megatron's per-token loss
convention (the schedule divides by the token count summed over micro-batches); the report holds
``[sum, tokens]`` under :data:`LOSS_NAME`, which the trainer averages over micro-batches and
data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOSS_NAME", "token_mean_loss"]

#: the key the reported LM loss goes under
LOSS_NAME = "lm loss"


def token_mean_loss(batch: Any, losses: Any) -> tuple[Any, Any, dict]:
    """Sum of the masked per-token losses, the token count, and the report megatron averages."""
    import torch

    mask = batch.loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {LOSS_NAME: torch.stack([loss_sum.detach().clone(), num_tokens.detach().float()])}
