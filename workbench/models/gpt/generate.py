"""GPT's generation engine: the decoder-only engine of :mod:`workbench.backend.decoding` over one rank's model stage."""

from __future__ import annotations

from typing import Any

from workbench.backend.decoding import InferenceEngine

__all__ = ["make_engine"]


def make_engine(model: Any, cfg: Any, tokenizer: Any, ids: dict[str, Any], cuda_graphs: bool | str = "auto") -> InferenceEngine:
    """The engine :func:`workbench.rank.inference.load_engine` returns for a GPT checkpoint: prompt and new
    tokens share the model's ``max_position_embeddings`` positions; ``ids``: the tokenizer's special ids."""
    return InferenceEngine(model, vocab_size=cfg.model.vocab_size, max_positions=cfg.model.max_position_embeddings,
                           tokenizer=tokenizer, eos_id=ids["eos"], bos_id=ids["bos"], pad_id=ids["pad"], cuda_graphs=cuda_graphs)
