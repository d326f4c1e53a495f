"""T5's default train step: encoder + decoder forward and the decoder's token-mean LM loss.

Batches (from :mod:`.data`) hold ``tokens`` (encoder input ``[b, s_enc]``), ``labels`` (decoder
targets ``[b, s_dec]``, 0 at padding), ``loss_mask`` (1 at real target tokens) and in ``extra``:
``dec_tokens`` (decoder input: the targets shifted right after the start token) and ``enc_mask``
(1 = real encoder token).  ``forward_step`` returns the per-token losses ``[b, s_dec]`` (the logits
``[b, s_dec, V/tp]`` with ``return_logits``); ``loss`` is the token-mean LM loss
(:mod:`workbench.models.common.lm_loss`, megatron's per-token convention).
"""

from __future__ import annotations

from typing import Any

from workbench.models.common.lm_loss import LOSS_NAME, token_mean_loss

__all__ = ["forward_step", "loss", "LOSS_NAME", "encoder_mask", "logits_forward"]


def encoder_mask(enc_mask: Any) -> Any:
    """``[b, s]`` 1 = real token -> megatron's boolean ``[b, 1, 1, s]``, True = masked out (keys only)."""
    return (enc_mask == 0)[:, None, None, :]


def forward_step(batch: Any, model: Any, return_logits: bool = False, **_: Any) -> Any:
    """Encoder over ``tokens``, decoder over ``dec_tokens``; per-token losses (or logits)."""
    mask = encoder_mask(batch.extra["enc_mask"])
    labels = None if return_logits else batch.labels
    return model(batch.tokens, batch.extra["dec_tokens"], mask, None, mask, lm_labels=labels)


def loss(batch: Any, losses: Any) -> tuple[Any, Any, dict]:
    """The decoder's token-mean LM loss (:func:`workbench.models.common.lm_loss.token_mean_loss`)."""
    return token_mean_loss(batch, losses)


def logits_forward(chunk: Any, inputs: dict) -> Any:
    """The whole model's forward for logits (conversion's verify): vocab-parallel decoder logits ``[b, s_dec, V/tp]``;
    ``inputs``: ``tokens``, ``enc_mask``, ``dec_tokens`` (:func:`workbench.models.t5.hf.verify_inputs`)."""
    mask = encoder_mask(inputs["enc_mask"])
    return chunk(inputs["tokens"], inputs["dec_tokens"], mask, None, mask)
