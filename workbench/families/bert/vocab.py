"""What BERT needs of a tokenizer and of indexed data (torch-free; used by the config's data rules
before launch and by :mod:`workbench.models.bert.data` on the ranks).

- :class:`BertVocab`: the view megatron-core's ``BERTMaskedWordPieceDataset`` reads (``cls``,
  ``sep``, ``mask``, ``pad`` ids and ``inv_vocab``), over a workbench :class:`~workbench.data.tokenizer.Tokenizer`;
- :func:`check_bert_tokenizer`: a vocabulary without ``[CLS]`` / ``[SEP]`` / ``[MASK]`` / ``[PAD]``
  is refused naming the tokenizer and the fix;
- :func:`check_sentence_data`: with the binary head, data must be sentence-split (one sequence per
  sentence) and hold documents of at least two sentences.
"""

from __future__ import annotations

from typing import Any

from workbench.data.errors import DataError
from workbench.data.indexed import _HEADER_BYTES, check_indexed, read_sidecar, strip_prefix
from workbench.data.tokenizer import load_tokenizer

__all__ = ["BertVocab", "check_bert_tokenizer", "check_sentence_data", "SPECIALS"]

#: attribute -> the token BERT's vocabularies use (HF's and Megatron's)
SPECIALS = {"cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]", "pad": "[PAD]"}
_FIX = ("use data.tokenizer: demo-wordpiece, a BERT vocab.txt or a local BERT tokenizer directory "
        "(or train one: workbench tokenizer train --wordpiece ...)")


class BertVocab:
    """The tokenizer as megatron-core's BERT dataset reads it; picklable, like the tokenizer it wraps."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        missing = [tok for tok in SPECIALS.values() if tokenizer.token_to_id(tok) is None]
        if missing:
            raise DataError(f"data.tokenizer ({tokenizer.name})", f"the vocabulary has no {', '.join(missing)}: BERT's inputs are "
                            "[CLS] A [SEP] B [SEP] with [MASK]ed tokens and [PAD] after the text", _FIX)
        for attr, tok in SPECIALS.items():
            setattr(self, attr, int(tokenizer.token_to_id(tok)))
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        self.inv_vocab = {int(i): t for t, i in vocab.items()}
        self.vocab_size = tokenizer.vocab_size
        self.name = tokenizer.name

    @property
    def unique_identifiers(self) -> dict:
        return {**self.tokenizer.unique_identifiers, "bert": {k: getattr(self, k) for k in SPECIALS}}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def check_bert_tokenizer(spec: Any) -> BertVocab:
    """Load ``spec`` and refuse a vocabulary without BERT's special tokens (:class:`DataError`)."""
    return BertVocab(load_tokenizer(spec))


def check_sentence_data(prefix: str, binary_head: bool) -> Any:
    """``PREFIX`` is usable for BERT: with the binary head, sentence-split with >= 2-sentence documents."""
    prefix = strip_prefix(prefix)
    info = check_indexed(prefix)
    if not binary_head:
        return info
    meta = read_sidecar(prefix) or {}
    fix = ("re-run `workbench preprocess --split-sentences ...` on the text (one sequence per sentence), "
           "or set model.add_binary_head: false")
    per_doc = sentences_per_document(prefix, info)
    multi = int((per_doc >= 2).sum())
    if multi == 0:
        how = ("was preprocessed without sentence splitting (one sequence per document)" if not meta.get("split_sentences")
               else "has no document of two or more sentences")
        raise DataError(prefix, f"{how}: the binary (sentence-order) head pairs spans of sentences A / B, so every sample "
                        "needs at least two sentences", fix if not meta.get("split_sentences") else
                        "use longer documents (two or more sentences each), or set model.add_binary_head: false")
    return info


def sentences_per_document(prefix: str, info: Any = None) -> Any:
    """Sequences (sentences, for sentence-split data) of each document, from ``PREFIX.idx`` (numpy only)."""
    import numpy as np

    info = info or check_indexed(prefix)
    seqs, docs = info.sequences, info.documents + 1
    doc_idx = np.fromfile(prefix + ".idx", dtype=np.int64, count=docs, offset=_HEADER_BYTES + seqs * 12)
    return np.diff(doc_idx)
