"""BERT: encoder-only pretraining (masked LM + sentence order) on megatron-core's ``BertModel``.

The declaration: :mod:`.shapes` (counts, FLOPs, planner terms), :mod:`.presets`, :mod:`.vocab` (the
tokenizer's and the sentence-split data's checks), the config and data rules.  The rank side,
:mod:`workbench.models.bert`: ``model`` (spec and builder), ``step`` (default forward step; MLM +
sentence-order loss; masked-token accuracy), ``data`` (megatron-core ``BERTMaskedWordPieceDataset`` on
sentence-split data, a learnable synthetic stream for tests), ``hf`` (HF ``MegatronBertForPreTraining``
adapter), ``finetune`` (``model.num_labels``: sequence classification on the pooled output, the labelled sets).

The layout is Megatron's pre-LN BERT, which is HF's ``megatron-bert``; HF's original ``bert``
(post-LN) is refused by the converter with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config_fields import bounded
from workbench.data.errors import DataError
from workbench.families.bert import shapes
from workbench.families.bert.presets import PRESETS
from workbench.families.family import Family, Supports

__all__ = ["FAMILY", "BertFields", "rules", "field_rules", "data_rules", "BYTE_LEVEL_HINT"]

BYTE_LEVEL_HINT = ("set data.tokenizer: demo-wordpiece (the WordPiece vocabulary trained on the embedded corpus), "
                   "a local BERT tokenizer directory or a vocab.txt")
_POST_LN = ("HF 'bert' (BertForPreTraining) is post-LN: its layer norms follow each residual sum, while megatron-core's "
            "BERT (and HF 'megatron-bert') normalise before attention and MLP, so no weight mapping gives the same "
            "function -> convert a MegatronBertForPreTraining checkpoint (model_type 'megatron-bert')")


@dataclass
class BertFields:
    """The model-config fields BERT reads (``model.<field>``, mounted on :class:`workbench.config.ModelConfig`)."""

    #: token-type (segment) embeddings, e.g. BERT's sentence A / B (2); 0: none
    num_tokentypes: int = bounded(0, 0, 1024, why="BERT uses 2", fix="use 2 (sentences A / B) or 0")
    #: encoders (BERT): the binary (sentence-order) head on the pooled first token, a second pretraining loss
    add_binary_head: bool = False
    #: encoders (BERT): the pooler (dense + tanh on the first token) also without the binary head (classification fine-tuning)
    add_pooler: bool = False
    #: encoders (BERT): > 0 adds a sequence-classification head with this many classes on the pooled output and trains
    #: classification (cross entropy, accuracy) instead of pretraining; fine-tune with checkpoint.load_dir + finetune
    num_labels: int = bounded(0, 0, 1 << 20, why="a classifier over more classes than the largest vocabularies",
                              fix="use 0 (pretraining) or the number of classes")


def field_rules(cfg: Any, supports: Supports) -> list[tuple[str, ...]]:
    """BERT's fields on a config of any family: a classification head only where the family builds one."""
    m = cfg.model
    if m.num_labels and not supports.classification:
        return [("model.num_labels", f"the {m.arch} family has no sequence-classification head",
                 "set num_labels: 0 (classification: a bert model)", "model.arch")]
    return []


def rules(cfg: Any) -> list[tuple[str, str, str]]:
    """BERT's config rules: (field, rule, fix)."""
    m, t, d = cfg.model, cfg.train, cfg.data
    out: list[tuple[str, str, str]] = []
    if m.position_embedding == "alibi":
        out.append(("model.position_embedding", "megatron-core's BertModel has learned or rotary positions, not ALiBi",
                    "set position_embedding: learned"))
    if m.num_tokentypes < 0:
        out.append(("model.num_tokentypes", f"must be >= 0 (got {m.num_tokentypes})", "use 2 (sentences A / B) or 0"))
    elif m.add_binary_head and m.num_tokentypes < 2:
        out.append(("model.num_tokentypes", f"the binary (sentence-order) head feeds sentences A and B as token types 0 and 1, "
                    f"but num_tokentypes is {m.num_tokentypes}", "set num_tokentypes: 2, or add_binary_head: false"))
    if m.seq_length < 8:
        out.append(("model.seq_length", f"{m.seq_length} leaves no room for text besides [CLS] and two [SEP]",
                    "use seq_length >= 8 (BERT: 128 or 512)"))
    if t.return_logits:
        out.append(("train.return_logits", "BERT's default train step returns the per-token MLM losses and the binary "
                    "logits, not the vocabulary logits", "leave return_logits off; a train.loss_func hook receives "
                    "(MLM losses, binary logits)"))
    if m.num_labels < 0:
        out.append(("model.num_labels", f"must be >= 0 (got {m.num_labels})", "use 0 (pretraining) or the number of classes"))
    elif m.num_labels:
        if d.source == "indexed":
            out.append(("data.source", "classification (model.num_labels > 0) reads a labelled set, and indexed data has no labels",
                        "use source: demo (the embedded corpus's verses labelled by testament) or synthetic"))
        elif d.source == "demo" and m.num_labels != 2:
            out.append(("model.num_labels", f"the demo labelled set has 2 classes (Old / New Testament), not {m.num_labels}",
                        "set num_labels: 2"))
        if cfg.parallel.overlap_grad_reduce:
            out.append(("parallel.overlap_grad_reduce", "classification leaves the masked-LM head in the model unused, and "
                        "megatron's overlapped gradient reduction waits for a gradient of every parameter", "set overlap_grad_reduce: false"))
        if m.add_binary_head:
            out.append(("model.add_binary_head", "classification trains the head on the pooled output; the sentence-order "
                        "head would sit unused", "set add_binary_head: false (the pooler is kept and loaded from the checkpoint)"))
    if d.source != "synthetic" and d.tokenizer == "demo":
        out.append(("data.tokenizer", "'demo' is the byte-level BPE of the GPT presets: it has no [CLS], [SEP] or [MASK] "
                    "token, which BERT's masking and sentence pairs need", BYTE_LEVEL_HINT))
    return out


def data_rules(cfg: Any) -> list[tuple[str, str, str]]:
    """Before launch: the tokenizer has BERT's special tokens; indexed data is sentence-split when the
    binary head is on, with documents of >= 2 sentences (light: tokenizer files and .idx headers)."""
    if cfg.data.source == "synthetic":
        return []
    from workbench.families.bert.vocab import check_bert_tokenizer, check_sentence_data

    try:
        check_bert_tokenizer(cfg.data.tokenizer)
    except DataError as e:
        return [("data.tokenizer", f"{e.where}: {e.problem}", e.fix or BYTE_LEVEL_HINT)]
    out = []
    if cfg.data.source == "indexed":
        for i, entry in enumerate(cfg.data.datasets):
            try:
                check_sentence_data(entry.prefix, cfg.model.add_binary_head)
            except DataError as e:
                out.append((f"data.datasets[{i}].prefix", f"{e.where}: {e.problem}", e.fix or ""))
    return out


FAMILY = Family(
    name="bert",
    title="BERT (encoder-only: masked LM + sentence order)",
    supports=Supports(pipeline=True, interleaved=True, sequence_parallel=True, generation=False, classification=True,
                      context_parallel=True, key_padding=True, hf_classes=(("megatron-bert", "MegatronBertForPreTraining"),),
                      hf_refused=(("bert", _POST_LN),)),
    shapes=shapes,
    presets=PRESETS,
    rules=rules,
    data_rules=data_rules,
    model_fields=BertFields,
    field_rules=field_rules,
    variant=lambda model: "classifier" if int(model.get("num_labels") or 0) > 0 else "",
)
