"""The compiled layer's rotary embedding: megatron's non-interleaved rotate-half on cos / sin tables made once.

megatron's ``_apply_rotary_pos_emb_bshd`` takes the frequencies ``[s, 1, 1, rot]`` and computes ``cos`` and ``sin`` of
them, cast to the activations' dtype, in every call: inside the compiled layer inductor fused both into the rotary
kernel, so each of q's and k's elements recomputed two fp32 transcendentals in every layer's forward and again in its
backward (Llama-3.2-1B, H200: the forward's rotary kernel 8.4 ms a step, 64 calls).  megatron's ``RotaryEmbedding``
hands every layer, micro-batch and step the same frequencies tensor (its forward is cached), so :func:`rope_tables`
makes the two tables once per frequencies tensor and dtype and keeps them (never dropped: a recorded CUDA graph may
read them), and :func:`rotate` applies them: the same operations on the same rounded tables as megatron's function.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["rope_tables", "rotate", "MAX_TABLES"]

#: tables kept at most (megatron caches 32 frequency tensors; generation at changing offsets makes new ones): beyond
#: this the tables are made per call and not kept
MAX_TABLES = 64

_TABLES: dict[tuple[int, torch.dtype], tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}


def rope_tables(freqs: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(cos(freqs), sin(freqs))`` cast to ``dtype`` (megatron's, ``mscale`` 1), made once per ``freqs`` tensor."""
    if freqs is None:
        return None
    key = (id(freqs), dtype)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is freqs:
        return hit[1]
    with torch.no_grad():
        tables = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
    if len(_TABLES) < MAX_TABLES or key in _TABLES:
        _TABLES[key] = (freqs, tables)  # (the key's object kept alive with it: its id is not reused)
    return tables


def rotate(t: torch.Tensor, rope: Any) -> torch.Tensor:
    """megatron's non-interleaved rotary embedding (bshd) of ``t`` ``[s, b, n, d]``: ``rope`` is :func:`rope_tables`'
    ``(cos, sin)`` ``[s, 1, 1, rot]`` (``t * cos + rotate_half(t) * sin`` on the first ``rot`` channels), the
    frequencies themselves (megatron's ``_apply_rotary_pos_emb_bshd``), or None (no rotation)."""
    if rope is None:
        return t
    if not isinstance(rope, tuple):
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(t, rope)
    cos, sin = rope
    rot = cos.shape[-1]
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    x = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((x, x_pass), dim=-1)
