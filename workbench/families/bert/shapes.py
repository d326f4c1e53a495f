"""BERT's shape terms: parameter counts, Megatron FLOPs, and the planner's per-stage memory terms.

An encoder (megatron-core ``BertModel``, Megatron's pre-LN layout): word + learned position +
token-type embeddings, transformer layers with bidirectional attention under a padding mask, a
final norm, the masked-LM head (dense + GELU + LayerNorm transform, then the output layer tied to
the word embeddings, with a vocab-sized bias), and on the pooled first token the pooler (dense +
tanh) and the binary (sentence-order) head.

The transformer layers keep what GPT's keep (:mod:`workbench.families.common.shapes`): with SDPA
attention bidirectional and causal attention keep the same tensors; the padding mask is one
tensor per micro-batch shared by every layer (GPT's per-layer ``causal_mask`` term is dropped).
Torch-free and config-free (configs are read by attribute).

``param_counts`` keeps GPT's keys; for BERT ``final_norm`` holds *everything on the last stage
after the encoder that is not a vocab x hidden matrix*: the final norm, the LM-head transform,
the output bias, the pooler and the binary head (so :func:`workbench.config.derive` places them
on the last stage).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from workbench.families.common import shapes as _stack

__all__ = ["MASKED_SHARE", "masked_per_sequence", "param_counts", "head_params", "layer_and_head_flops", "Shape", "shape", "stage_params",
           "layer_activation_terms", "layer_backward_transient", "logits_bytes"]

Shape = _stack.Shape
layer_backward_transient = _stack.layer_backward_transient

#: the share of a sequence's positions the masked-LM data masks (megatron's ``BERTMaskedWordPieceDataset`` masks at
#: most that many: ``workbench.models.bert.data.MASKING``), so the rows the model's masked-LM head runs on
MASKED_SHARE = 0.15


def masked_per_sequence(seq_length: int) -> int:
    """The most masked positions one sequence holds: the rows a sequence gives the masked-LM head."""
    return math.ceil(MASKED_SHARE * seq_length)


def shape(cfg: Any, d: Any, micro_batch: int | None = None) -> Shape:
    """The common shape, with the rows the masked-LM head runs on a sequence (:func:`masked_per_sequence`, the
    model's ``masked_lm_losses``); every position under sequence parallelism (megatron's head there)."""
    base = _stack.shape(cfg, d, micro_batch)
    rows = 0 if cfg.parallel.sequence_parallel else min(base.s, masked_per_sequence(cfg.model.seq_length))
    return dataclasses.replace(base, head_rows=rows)


def head_params(cfg: Any, padded_vocab: int) -> dict[str, int]:
    """The last stage's non-vocab-matrix parameters: final norm, LM-head transform, output bias, pooler, binary head,
    classification head."""
    m = cfg.model
    h = m.hidden_size
    norm = (2 * h) if m.normalization == "layernorm" else h
    labels = max(getattr(m, "num_labels", 0), 0)
    pooled = bool(m.add_binary_head or m.add_pooler or labels)
    return dict(
        final_norm=norm,
        lm_transform=h * h + h + norm,
        output_bias=padded_vocab,
        pooler=(h * h + h) if pooled else 0,
        binary_head=(2 * h + 2) if m.add_binary_head else 0,
        classifier=(h * labels + labels) if labels else 0,
    )


def param_counts(cfg: Any, padded_vocab: int) -> dict[str, int]:
    """Parameters of the whole model (GPT's keys; see the module docstring for ``final_norm``)."""
    m = cfg.model
    base = _stack.param_counts(cfg, padded_vocab)
    emb = base["embedding"] + max(m.num_tokentypes, 0) * m.hidden_size
    tail = sum(head_params(cfg, padded_vocab).values())
    total = emb + m.num_layers * base["per_layer"] + tail + base["output_layer"]
    return dict(embedding=emb, per_layer=base["per_layer"], final_norm=tail, output_layer=base["output_layer"], total=total)


def layer_and_head_flops(cfg: Any, padded_vocab: int) -> tuple[float, float]:
    """Megatron's terms in units of ``12 * tokens * h^2``: one layer as GPT's (bidirectional attention
    costs the same dense FLOPs), and the head: the output layer and loss ``V / (2h)`` (logits for
    every token, as megatron's BERT computes them) plus the LM-head transform (one h x h GEMM: 1/2)."""
    layer, out = _stack.layer_and_head_flops(cfg, padded_vocab)
    return layer, out + 0.5


def stage_params(cfg: Any, sh: Shape, d: Any) -> list[dict[str, int]]:
    """Parameters on one TP rank of each stage, split into where they live.

    Replicated on every TP rank: norms, row-parallel biases, learned position and token-type
    embeddings, the LM-head transform, pooler and binary head (plain linears); divided by ``t``:
    the layers' GEMMs, the word embeddings, the output bias and an untied output layer.
    """
    m = cfg.model
    h, t = sh.h, sh.tp
    norm = (2 if sh.layernorm else 1) * h
    replicated_per_layer = 2 * norm + (2 * h if sh.bias else 0)
    word = sh.vocab * h
    pos = (sh.max_pos * h if sh.learned_pos else 0) + max(m.num_tokentypes, 0) * h
    heads = head_params(cfg, sh.vocab)
    out = []
    for r, total in enumerate(d.params_per_stage):
        layers = d.stage_layers[r]
        layer_part = layers * d.params.per_layer
        first, last = r == 0, r == sh.pp - 1
        emb_word = word if first else 0
        emb_pos = pos if first else 0
        tail = d.params.final_norm if last else 0
        output = total - layer_part - emb_word - emb_pos - tail  # untied output layer or the tied copy on the last stage
        tail_replicated = tail - (heads["output_bias"] if last else 0)
        bias = heads["output_bias"] if last else 0
        per_rank = ((layer_part - layers * replicated_per_layer) + emb_word + output + bias) // t \
            + layers * replicated_per_layer + emb_pos + tail_replicated
        out.append({
            "total": per_rank,
            "layers": (layer_part - layers * replicated_per_layer) // t + layers * replicated_per_layer,
            "embedding": emb_word // t + emb_pos,
            "output_layer": (output + bias) // t,
            "final_norm": tail_replicated,
            "vocab_padding": (sh.vocab - m.vocab_size) * h // t * ((1 if emb_word else 0) + (1 if output else 0)),
        })
    return out


def layer_activation_terms(sh: Shape, kp: Any) -> dict[str, float]:
    """GPT's per-layer terms without the per-layer causal mask (BERT's padding mask is shared)."""
    terms = _stack.layer_activation_terms(sh, kp)
    terms.pop("causal_mask", None)
    return terms


def logits_bytes(sh: Shape, kp: Any) -> tuple[float, float]:
    """(peak, kept) of the LM head and loss: GPT's logits + loss terms plus the LM-head transform,
    which keeps its input, the GELU input, the LayerNorm input and statistics, and the output
    layer's input (``e sbh`` each, ``/t`` under sequence parallelism) -- on the rows the head runs on
    (``sh.head_rows`` a sequence: the masked positions)."""
    if sh.head_rows:
        sh = dataclasses.replace(sh, s=min(sh.s, sh.head_rows))
    peak, kept = _stack.logits_bytes(sh, kp)
    tok = sh.s * sh.b
    tsp = sh.tp if sh.sp else 1
    transform = (4 * sh.e * tok * sh.h + 8 * tok) / tsp
    return peak + transform, kept + transform
