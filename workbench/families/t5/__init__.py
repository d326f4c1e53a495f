"""T5: encoder-decoder pretraining (span corruption) on megatron-core's ``T5Model``.

The declaration: :mod:`.shapes` (counts, FLOPs, planner terms), :mod:`.presets`, :mod:`.spans` (T5's
span corruption and its checks, torch-free), the config and data rules.  The rank side,
:mod:`workbench.models.t5`: ``model`` (the workbench's encoder / decoder specs and the builder), ``step``
(forward step and the decoder's token-mean LM loss), ``data`` (span-corruption datasets over ``.bin/.idx``
and a learnable synthetic stream), ``hf`` (HF ``T5ForConditionalGeneration`` /
``MT5ForConditionalGeneration`` adapter), ``generate`` (encoder once, decoder with a KV cache and cached
cross-attention keys/values; greedy, sampling, beam search).

Facts this family is built on (megatron-core 0.19.2):

- no pipeline parallelism: encoder-decoder pipelining was removed from megatron-core in 0.14 and
  Megatron-LM's ``pretrain_t5.py`` raises "Pipeline parallelism is not supported for T5";
- without Transformer Engine, megatron-core's ``get_t5_{encoder,decoder}_with_local_block_spec``
  set the final layer norm to ``TENorm``, which is ``None``: both stacks would silently lose their
  final norms.  The workbench's own specs (:mod:`workbench.models.t5.model`) keep them;
- ``position_embedding_type='relative'`` is T5's bucketed relative position bias (one table per
  stack, computed once and added to every self-attention layer's scores), so HF T5 weights map
  onto it; attention scores are not scaled by ``1/sqrt(d)`` (T5 folds the scale into the weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config_fields import LAYERS, SEQ_WHY, bounded
from workbench.data.errors import DataError
from workbench.families.family import Family, Supports
from workbench.families.t5 import shapes
from workbench.families.t5.presets import PRESETS

__all__ = ["FAMILY", "T5Fields", "rules", "data_rules", "PIPELINE_REASON", "TOKENIZER_HINT"]

PIPELINE_REASON = ("megatron-core 0.19 has no pipeline parallelism for T5: encoder-decoder pipelining was removed in "
                   "megatron-core 0.14 (Megatron-LM's pretrain_t5.py raises 'Pipeline parallelism is not supported for T5'); "
                   "split the model with tensor_parallel (+ sequence_parallel) and data parallelism (+ distributed_optimizer) instead")
TOKENIZER_HINT = ("set data.tokenizer: demo-t5 (the embedded corpus's BPE with 100 <extra_id_i> sentinels), or a local "
                  "HF T5 tokenizer directory / tokenizer.json that has <extra_id_i> tokens, or a SentencePiece .model "
                  "(read as T5's: its pieces + 100 sentinels)")


@dataclass
class T5Fields:
    """The model-config fields T5 reads (``model.<field>``, mounted on :class:`workbench.config.ModelConfig`)."""

    #: encoder-decoder (T5): decoder layers (`num_layers` is the encoder's); None -> num_layers
    decoder_num_layers: int | None = bounded(None, None, 1024, why=LAYERS.why)
    #: encoder-decoder (T5): decoder (target) sequence length (`seq_length` is the encoder's); None -> seq_length
    decoder_seq_length: int | None = bounded(None, None, 1 << 20, why=SEQ_WHY)
    #: position_embedding relative: buckets of the relative position bias and the distance beyond which all share one bucket
    relative_attention_num_buckets: int = bounded(32, None, 1 << 20, why="T5 uses 32")
    relative_attention_max_distance: int = bounded(128, None, 1 << 20, why="T5 uses 128")

    @property
    def decoder_layers(self) -> int:
        """Decoder layers of an encoder-decoder model (``decoder_num_layers`` or ``num_layers``)."""
        return self.decoder_num_layers or self.num_layers  # type: ignore[attr-defined]  # the mounted ModelConfig's

    @property
    def decoder_seq(self) -> int:
        """Decoder (target) sequence length of an encoder-decoder model."""
        return self.decoder_seq_length or self.seq_length  # type: ignore[attr-defined]


def rules(cfg: Any) -> list[tuple[str, str, str]]:
    """T5's config rules: (field, rule, fix)."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    out: list[tuple[str, str, str]] = []
    if m.attention_backend == "local":
        out.append(("model.attention_backend", "T5's relative position bias and unscaled scores are implemented in the "
                    "workbench SDPA attention and Transformer Engine's, not megatron's local attention",
                    "set attention_backend: auto (or sdpa, or te with Transformer Engine installed)"))
    if m.attention_backend == "te" and p.recompute != "none":
        out.append(("parallel.recompute", f"T5 on Transformer Engine's layer passes TE's (queries, keys) cross-attention "
                    f"mask pair, which megatron's recompute checkpoint cannot save ('{p.recompute}')",
                    "set parallel.recompute: none, or attention_backend: auto / sdpa"))
    if m.attention_type != "multihead":
        out.append(("model.attention_type", "megatron-core's CrossAttention has no grouped / multi-query attention",
                    "set attention_type: multihead"))
    if m.decoder_num_layers is not None and m.decoder_num_layers < 1:
        out.append(("model.decoder_num_layers", f"must be >= 1 (got {m.decoder_num_layers})", "use e.g. num_layers, or null"))
    if m.decoder_seq_length is not None and m.decoder_seq_length < 2:
        out.append(("model.decoder_seq_length", f"must be >= 2 (got {m.decoder_seq_length})",
                    "use a length that holds the sentinels, the noise spans and </s> (T5: 114 for 512 encoder tokens)"))
    if m.position_embedding == "relative":
        nb, md = m.relative_attention_num_buckets, m.relative_attention_max_distance
        if nb < 4 or nb % 2:
            out.append(("model.relative_attention_num_buckets", f"must be an even number >= 4 (got {nb}): the encoder's "
                        "bidirectional bias uses half the buckets per direction, half of those exact", "use 32 (T5)"))
        elif md <= nb // 2:
            out.append(("model.relative_attention_max_distance", f"{md} must exceed half the buckets ({nb // 2}): the "
                        "logarithmic buckets span from there to max_distance", "use 128 (T5)"))
    if p.sequence_parallel and m.decoder_seq % max(p.tensor_parallel, 1):
        out.append(("model.decoder_seq_length", f"with sequence parallelism decoder_seq_length {m.decoder_seq} must be "
                    f"divisible by tensor_parallel {p.tensor_parallel}", "round decoder_seq_length to a multiple of tensor_parallel"))
    if d.source != "synthetic" and d.tokenizer in ("demo", "demo-wordpiece"):
        out.append(("data.tokenizer", f"'{d.tokenizer}' has no sentinel tokens (<extra_id_i>), which T5's span corruption "
                    "puts in place of each masked span", TOKENIZER_HINT))
    from workbench.families.t5.spans import span_problems

    out += span_problems(cfg)
    return out


def data_rules(cfg: Any) -> list[tuple[str, str, str]]:
    """Before launch: the tokenizer has sentinels, an end-of-sequence and a padding token."""
    if cfg.data.source == "synthetic":
        return []
    from workbench.families.t5.spans import check_t5_tokenizer

    try:
        check_t5_tokenizer(cfg.data.tokenizer, cfg)
    except DataError as e:
        return [("data.tokenizer", f"{e.where}: {e.problem}", e.fix or TOKENIZER_HINT)]
    return []


def generation_rules(cfg: Any, n: int, max_new: int) -> list[tuple[str, str, str]]:
    """No length limit from positions: the prompt is the encoder's input and the new tokens the decoder's,
    each under T5's bucketed relative bias (no table of absolute positions to run past; HF's
    ``generate`` takes any length too), so neither is added to the other nor held to
    ``max_position_embeddings``.  Memory is the only bound: the decoder's KV cache holds ``max_new``
    slots and the encoder's output ``n`` tokens."""
    return []


FAMILY = Family(
    name="t5",
    title="T5 (encoder-decoder: span-corruption pretraining)",
    supports=Supports(pipeline=False, interleaved=False, sequence_parallel=True, generation=True,
                      hf_classes=(("t5", "T5ForConditionalGeneration"), ("mt5", "MT5ForConditionalGeneration")),
                      pipeline_reason=PIPELINE_REASON, transformer_engine=False, positions=("relative",),
                      te_userbuffers_blocker="T5's cross-attention has TE linears with no userbuffer of their own "
                                             "(megatron asserts a tp_comm_buffer_name), and its encoder and decoder lengths may differ",
                      activations=("relu", "gelu", "geglu", "swiglu")),
    shapes=shapes,
    presets=PRESETS,
    rules=rules,
    data_rules=data_rules,
    generation_rules=generation_rules,
    model_fields=T5Fields,
)
