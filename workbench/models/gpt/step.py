"""GPT's default train step: the forward step and Megatron's token-mean LM loss.

``forward_step(batch, model, return_logits)`` returns per-token losses ``[b, s]`` on the last
pipeline stage (the logits with ``return_logits``), hidden states elsewhere.
``loss(batch, losses)`` -> ``(loss_sum, num_tokens, report)``: the token-mean LM loss of
:mod:`workbench.models.common.lm_loss`.
"""

from __future__ import annotations

from typing import Any

from workbench.models.common.lm_loss import LOSS_NAME, token_mean_loss

__all__ = ["forward_step", "loss", "logits_forward", "LOSS_NAME"]


def forward_step(batch: Any, model: Any, return_logits: bool = False, **_: Any) -> Any:
    """Megatron's GPT forward: per-token losses on the last stage (logits with return_logits)."""
    labels = None if return_logits else batch.labels
    return model(batch.tokens, batch.position_ids, batch.attention_mask, labels=labels)


def loss(batch: Any, losses: Any) -> tuple[Any, Any, dict]:
    """Megatron's token-mean LM loss (:func:`workbench.models.common.lm_loss.token_mean_loss`)."""
    return token_mean_loss(batch, losses)


def logits_forward(chunk: Any, inputs: dict) -> Any:
    """One model chunk's forward for logits (conversion's verify): hidden states, or the last stage's vocab-parallel
    logits ``[b, s, V/tp]``; ``inputs`` holds ``tokens`` ``[b, s]`` (see :func:`workbench.models.gpt.hf.verify_inputs`)."""
    import torch

    tokens = inputs["tokens"]
    b, s = tokens.shape
    return chunk(tokens, torch.arange(s).unsqueeze(0).expand(b, -1), None)
