"""T5's shape terms: parameter counts, Megatron-style FLOPs, and the planner's memory terms.

An encoder-decoder (megatron-core ``T5Model``): shared word embeddings (no absolute positions), an
encoder of ``num_layers`` layers (RMS norm, bidirectional self-attention with a padding mask, MLP),
a decoder of ``decoder_num_layers`` layers (causal self-attention, cross-attention over the encoder
output, MLP), one relative-position-bias table per stack (``buckets x heads``), final norms on both
stacks, and the LM head (tied to the embeddings, or untied).  Two sequence lengths: the encoder's
``seq_length`` and the decoder's ``decoder_seq_length``.

The interface is the other families' (:mod:`workbench.families.common.shapes`), so the planner and
:func:`workbench.config.derive` need nothing T5-specific:

- ``param_counts``: ``per_layer`` is one *encoder* layer; ``final_norm`` holds everything on the
  (only) stage besides the encoder layers and vocab matrices: the decoder layers, both final norms
  and both relative-bias tables (T5 has no pipeline parallelism, so all of it sits on stage 0);
- ``layer_and_head_flops``: in units of ``12 * batch * seq_length * h^2`` (encoder tokens); the
  "layer" is one encoder layer, the "head" is the decoder stack plus the output layer and loss;
- ``layer_activation_terms``: one encoder layer's kept tensors plus, as ``decoder_*`` terms, the
  decoder's divided by the encoder layer count (the planner multiplies by ``num_layers``).

Torch-free and config-free (configs are read by attribute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.families.common import shapes as _stack

__all__ = ["param_counts", "layer_and_head_flops", "Shape", "shape", "stage_params", "layer_activation_terms",
           "layer_backward_transient", "logits_bytes", "layer_params", "attention_mask_bytes"]


def layer_params(cfg: Any) -> dict[str, int]:
    """Parameters of one encoder layer and one decoder layer (no biases, RMS norms of ``h``)."""
    m = cfg.model
    h, ad, f = m.hidden_size, m.num_attention_heads * m.head_dim, m.ffn_size
    fc1_out = 2 * f if m.gated_mlp else f
    norm = h if m.normalization == "rmsnorm" else 2 * h
    bias = m.add_bias_linear
    attn = 4 * h * ad + ((3 * ad + h) if bias else 0)
    mlp = h * fc1_out + f * h + ((fc1_out + h) if bias else 0)
    enc = attn + mlp + 2 * norm
    dec = 2 * attn + mlp + 3 * norm
    return {"encoder": enc, "decoder": dec, "norm": norm}


def param_counts(cfg: Any, padded_vocab: int) -> dict[str, int]:
    """Parameters of the whole model (GPT's keys; see the module docstring for ``per_layer`` / ``final_norm``)."""
    m = cfg.model
    lp = layer_params(cfg)
    emb = padded_vocab * m.hidden_size
    rel = 2 * m.relative_attention_num_buckets * m.num_attention_heads if m.position_embedding == "relative" else 0
    rest = m.decoder_layers * lp["decoder"] + 2 * lp["norm"] + rel
    out = 0 if m.tie_embeddings else padded_vocab * m.hidden_size
    total = emb + m.num_layers * lp["encoder"] + rest + out
    return dict(embedding=emb, per_layer=lp["encoder"], final_norm=rest, output_layer=out, total=total)


def _macs(cfg: Any, padded_vocab: int) -> tuple[float, float, float]:
    """Multiply-accumulates per sample: one encoder layer, one decoder layer, the output layer."""
    m = cfg.model
    h, ad, f = m.hidden_size, m.num_attention_heads * m.head_dim, m.ffn_size
    se, sd = m.seq_length, m.decoder_seq
    fc1_out = 2 * f if m.gated_mlp else f
    mlp = h * fc1_out + f * h
    enc = se * (4 * h * ad + mlp) + 2 * se * se * ad
    dec = sd * (4 * h * ad + 2 * h * ad + mlp) + se * 2 * h * ad + 2 * sd * sd * ad + 2 * sd * se * ad
    head = sd * h * padded_vocab
    return enc, dec, head


def layer_and_head_flops(cfg: Any, padded_vocab: int) -> tuple[float, float]:
    """Megatron's accounting (forward + backward = 6 x MACs, attention scores counted in full), in
    units of ``12 * tokens * h^2`` with the encoder's tokens: (one encoder layer, decoder + output layer)."""
    m = cfg.model
    enc, dec, head = _macs(cfg, padded_vocab)
    unit = 12.0 * m.seq_length * m.hidden_size ** 2
    return 6.0 * enc / unit, 6.0 * (m.decoder_layers * dec + head) / unit


# --------------------------------------------------------------------------- planner shapes


@dataclass(frozen=True)
class Shape(_stack.Shape):
    """GPT's shape plus the decoder's sequence length and layer count."""

    sd: int = 0
    dec_layers: int = 0
    enc_layers: int = 0
    relative: bool = False


def shape(cfg: Any, d: Any, micro_batch: int | None = None) -> Shape:
    base = _stack.shape(cfg, d, micro_batch)
    fields = {k: getattr(base, k) for k in base.__dataclass_fields__}
    fields.update(fc1_out=2 * cfg.model.ffn_size if cfg.model.gated_mlp else cfg.model.ffn_size, swiglu=cfg.model.gated_mlp,
                  learned_pos=False, rope=False)
    return Shape(**fields, sd=cfg.model.decoder_seq, dec_layers=cfg.model.decoder_layers, enc_layers=cfg.model.num_layers,
                 relative=cfg.model.position_embedding == "relative")


def stage_params(cfg: Any, sh: Shape, d: Any) -> list[dict[str, int]]:
    """Parameters on one TP rank (one stage): GEMM weights and vocab matrices divided by ``t``; norms
    and the relative-bias tables replicated."""
    m = cfg.model
    t = sh.tp
    lp = layer_params(cfg)
    norm = lp["norm"]
    rel = 2 * m.relative_attention_num_buckets * m.num_attention_heads if m.position_embedding == "relative" else 0
    enc_rep, dec_rep = 2 * norm, 3 * norm
    layers = sh.enc_layers * (lp["encoder"] - enc_rep) // t + sh.enc_layers * enc_rep \
        + sh.dec_layers * (lp["decoder"] - dec_rep) // t + sh.dec_layers * dec_rep
    word = sh.vocab * sh.h // t
    out = 0 if m.tie_embeddings else sh.vocab * sh.h // t
    tail = 2 * norm + rel
    total = layers + word + out + tail
    pad = (sh.vocab - m.vocab_size) * sh.h // t * (1 + (0 if m.tie_embeddings else 1))
    return [{"total": total, "layers": layers, "embedding": word, "output_layer": out, "final_norm": tail,
             "vocab_padding": pad}]


def _scaled(sh: Shape, s: int) -> Shape:
    fields = {k: getattr(sh, k) for k in _stack.Shape.__dataclass_fields__}
    fields["s"] = s
    return _stack.Shape(**fields)


def layer_activation_terms(sh: Shape, kp: Any) -> dict[str, float]:
    """Bytes one encoder layer keeps (GPT's terms at the encoder length, no per-layer mask: the padding
    mask is shared) plus ``decoder_*``: the decoder's kept bytes / ``num_layers`` (see module docstring).

    A decoder layer keeps a GPT layer's tensors at the decoder length, and for cross-attention its
    norm input and output, q, the attention output, the softmax statistics and k, v over the encoder
    length (``e * b * se * 2 a d / t``; the encoder output itself is kept once by the stack).

    With the relative position bias, every self-attention layer keeps its own additive mask
    (:func:`attention_mask_bytes`)."""
    enc = _stack.layer_activation_terms(_scaled(sh, sh.s), kp)
    enc.pop("causal_mask", None)
    dec = _stack.layer_activation_terms(_scaled(sh, sh.sd), kp)
    enc_mask, dec_mask = attention_mask_bytes(sh, kp)
    if enc_mask:
        enc["attention_mask_bias"] = enc_mask
    dec["attention_mask_bias"] = dec_mask
    t, e, b = sh.tp, sh.e, sh.b
    tsp = t if sh.sp else 1
    ad = sh.heads * sh.head_dim
    cross = 2 * e * b * sh.sd * sh.h / tsp + 2 * e * b * sh.sd * ad / t + 2 * e * b * sh.s * ad / t + 4 * b * sh.heads / t * sh.sd
    per = (sum(dec.values()) + cross) * sh.dec_layers / max(sh.enc_layers, 1)
    out = dict(enc)
    out["decoder_layers_share"] = per
    out["encoder_output"] = e * b * sh.s * sh.h / tsp / max(sh.enc_layers, 1)
    return out


def attention_mask_bytes(sh: Shape, kp: Any) -> tuple[float, float]:
    """Bytes of the additive mask one (encoder, decoder) self-attention layer keeps for backward.

    The workbench SDPA module adds the stack's relative bias ``[1, a/t, sq, sk]`` to the layer's mask
    with ``masked_fill``: a new tensor per layer, which SDPA's masked kernels (memory-efficient /
    cuDNN; flash takes no mask) keep for backward.  The encoder's carries the batch (its padding
    mask is ``[b, 1, 1, s]``): ``e b (a/t) s^2``; the decoder's self-attention mask is the causal
    triangle only: ``e (a/t) sd^2``.  Without relative positions the masks are booleans of
    ``[b, 1, 1, s]`` (negligible).  mcore's unfused attention (``local``) is not used by T5."""
    if not sh.relative:
        return 0.0, 0.0
    a = sh.heads / sh.tp
    return float(sh.e * sh.b * a * sh.s * sh.s), float(sh.e * a * sh.sd * sh.sd)


def layer_backward_transient(sh: Shape, kp: Any, assumptions: Any) -> float:
    """The larger of GPT's MLP-backward transient at the longer sequence and the encoder attention's:
    SDPA's gradient of the ``[b, a/t, s, s]`` mask and ``masked_fill``'s gradient of it coexist before
    they are summed over the batch into the relative bias's gradient (plus the residual-stream grads)."""
    mlp = _stack.layer_backward_transient(_scaled(sh, max(sh.s, sh.sd)), kp, assumptions)
    enc_mask, _ = attention_mask_bytes(sh, kp)
    stream = 2 * sh.e * sh.s * sh.b * sh.h / (sh.tp if sh.sp else 1)
    return max(mlp, 2 * enc_mask + stream)


def logits_bytes(sh: Shape, kp: Any) -> tuple[float, float]:
    """The logits and loss live on the decoder's tokens."""
    return _stack.logits_bytes(_scaled(sh, sh.sd), kp)
