"""BERT's datasets: megatron-core ``BERTMaskedWordPieceDataset`` on sentence-split data; a learnable
synthetic stream for tests.

Items are dicts of ``tokens``, ``labels``, ``loss_mask``, ``padding_mask`` and, when the model has
them, ``tokentype_ids`` and ``is_random`` (see :mod:`.step`).  Real data: the embedded corpus
(``data.source: demo``, split into sentences and tokenized once with ``data.tokenizer``) or
``indexed`` prefixes written by ``workbench preprocess --split-sentences``, blended and split by
megatron-core's builder.  Masking is megatron-core's, with Megatron-LM ``pretrain_bert``'s settings:
15% of the tokens (whole words, n-grams up to 3, probability 1/n), replaced 80% by ``[MASK]``, 10%
by a random token and 10% kept; 10% of the samples shorter than the sequence.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.data.errors import DataError
from workbench.datasets import check_tokenizer_fits, dataset_sizes, resolve_blend
from workbench.families.bert.shapes import MASKED_SHARE
from workbench.families.bert.vocab import check_bert_tokenizer, check_sentence_data
from workbench.models.common.seeds import mix32

__all__ = ["SyntheticBertDataset", "BertSamples", "bert_dataset_config", "build_datasets", "MASKING"]

#: megatron-core masking settings (Megatron-LM pretrain_bert's defaults)
MASKING = dict(masking_probability=MASKED_SHARE, short_sequence_probability=0.10, masking_max_ngram=3, masking_do_full_word=True,
               masking_do_permutation=False, masking_use_longer_ngrams=False, masking_use_geometric_distribution=False)


class SyntheticBertDataset:
    """Deterministic, learnable BERT samples (no tokenizer): ``[CLS] A [SEP] B [SEP] [PAD]...``.

    Sample i: an arithmetic progression (start, stride from (seed, i)) of ``n`` tokens (ids >= 5),
    split into A and B; with probability 1/2 the two are swapped (``is_random`` = 1, the sentence-
    order label).  15% of the text positions are masked (80% ``[MASK]`` = 4, 10% random, 10% kept).
    Masked tokens follow from their neighbours, and the order from the progression, so both losses fall.
    """

    PAD, CLS, SEP, MASK, FIRST = 0, 2, 3, 4, 5

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, offset: int = 0, tokentypes: bool = True,
                 binary_head: bool = True, size: int = 1 << 30):
        self.vocab, self.seq, self.seed, self.offset, self.size = int(vocab_size), int(seq_length), int(seed), int(offset), int(size)
        self.tokentypes, self.binary_head = tokentypes, binary_head

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = np.random.default_rng(mix32(self.seed, self.offset, int(idx)))
        span = self.vocab - self.FIRST
        n = int(g.integers(max(self.seq // 2, 4), self.seq - 3 + 1))  # text tokens; the rest is padding
        start, stride = int(g.integers(0, span)), int(g.integers(1, 4))
        text = self.FIRST + (start + stride * np.arange(n)) % span
        pivot = int(g.integers(1, n))
        a, b = text[:pivot], text[pivot:]
        swapped = bool(self.binary_head and g.random() < 0.5)
        if swapped:
            a, b = b, a
        tokens = np.concatenate([[self.CLS], a, [self.SEP], b, [self.SEP]])
        types = np.concatenate([np.zeros(len(a) + 2, np.int64), np.ones(len(b) + 1, np.int64)])
        labels = np.zeros(self.seq, np.int64)
        loss_mask = np.zeros(self.seq, np.float32)
        positions = [i for i in range(len(tokens)) if tokens[i] >= self.FIRST]
        chosen = g.choice(positions, size=max(1, round(0.15 * len(positions))), replace=False)
        masked = tokens.copy()
        for p in chosen:
            labels[p], loss_mask[p] = tokens[p], 1.0
            r = g.random()
            masked[p] = self.MASK if r < 0.8 else (int(g.integers(self.FIRST, self.vocab)) if r < 0.9 else tokens[p])
        pad = self.seq - len(tokens)
        out = {
            "tokens": torch.from_numpy(np.pad(masked, (0, pad))),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "padding_mask": torch.from_numpy(np.pad(np.ones(len(tokens), np.int64), (0, pad))),
        }
        if self.tokentypes:
            out["tokentype_ids"] = torch.from_numpy(np.pad(types, (0, pad)))
        if self.binary_head:
            out["is_random"] = torch.tensor(int(swapped))
        return out


class BertSamples:
    """A megatron-core BERT dataset's items as the backend's batches (see the module docstring).

    megatron-core marks padding in its ``padding_mask`` with the pad id (0 only for vocabularies
    whose ``[PAD]`` is 0); the mask here is recomputed from the text length (up to the last
    ``[SEP]``), so any pad id works.  Labels outside the masked positions are 0 (never -1).
    """

    def __init__(self, dataset: Any, sep: int, tokentypes: bool, binary_head: bool):
        self.dataset, self.sep, self.tokentypes, self.binary_head = dataset, int(sep), tokentypes, binary_head

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        item = self.dataset[idx]
        text = np.asarray(item["text"], dtype=np.int64)
        loss_mask = np.asarray(item["loss_mask"], dtype=np.float32)
        seps = np.nonzero(text == self.sep)[0]
        length = int(seps[-1]) + 1 if len(seps) else len(text)
        padding = (np.arange(len(text)) < length).astype(np.int64)
        out = {
            "tokens": torch.from_numpy(text),
            "labels": torch.from_numpy(np.where(loss_mask > 0, np.asarray(item["labels"], dtype=np.int64), 0)),
            "loss_mask": torch.from_numpy(loss_mask),
            "padding_mask": torch.from_numpy(padding),
        }
        if self.tokentypes:
            out["tokentype_ids"] = torch.from_numpy(np.asarray(item["types"], dtype=np.int64) * padding)
        if self.binary_head:
            out["is_random"] = torch.tensor(int(item["is_random"]))
        return out


def bert_dataset_config(cfg: Any, prefixes: list[str], weights: list[float] | None, vocab: Any, cache_dir: str | Path):
    """The megatron-core ``BERTMaskedWordPieceDatasetConfig`` for a workbench config."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig

    return BERTMaskedWordPieceDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.model.seq_length,
        blend=(list(prefixes), list(weights) if weights else None),
        split=cfg.data.split.replace("/", ","),
        path_to_cache=str(cache_dir),
        tokenizer=vocab,
        classification_head=bool(cfg.model.add_binary_head),
        num_dataset_builder_threads=1,
        **MASKING,
    )


def build_megatron(cfg: Any, run_dir: Any, vocab: Any = None) -> tuple[Any, Any, Any]:
    """(train, valid, test) megatron-core BERT datasets (``None`` for an empty split), unwrapped."""
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    vocab = vocab or check_bert_tokenizer(cfg.data.tokenizer)
    check_tokenizer_fits(cfg, vocab.tokenizer)
    prefixes, weights = resolve_blend(cfg, run_dir, vocab.tokenizer, split_sentences=True)
    for prefix in prefixes:
        check_sentence_data(prefix, cfg.model.add_binary_head)
    cache = Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(run_dir) / "data_cache"
    cache.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Could not determine rank")
        config = bert_dataset_config(cfg, prefixes, weights, vocab, cache)
        builder = BlendedMegatronDatasetBuilder(BERTMaskedWordPieceDataset, dataset_sizes(cfg).as_list(), lambda: True, config)
        try:
            return tuple(builder.build())
        except AssertionError as e:
            raise DataError(", ".join(prefixes), f"megatron-core could not build BERT samples ({e or 'assertion'})",
                            "use documents of at least two sentences, a longer corpus, or model.add_binary_head: false") from None


def build_datasets(cfg: Any, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description): ``synthetic`` only when the config says so, else megatron-core's BERT dataset;
    with ``model.num_labels`` the labelled sets of :mod:`.finetune`."""
    m = cfg.model
    if m.num_labels:  # sequence classification: a labelled set (.finetune)
        from workbench.models.bert import finetune

        return finetune.build_datasets(cfg, run_dir, log)
    types, binary = m.num_tokentypes > 0, bool(m.add_binary_head)
    if cfg.data.source == "synthetic":
        train = SyntheticBertDataset(m.vocab_size, m.seq_length, cfg.train.seed, tokentypes=types, binary_head=binary)
        valid = SyntheticBertDataset(m.vocab_size, m.seq_length, cfg.train.seed, offset=1, tokentypes=types, binary_head=binary)
        return train, valid, "synthetic (BERT)"
    vocab = check_bert_tokenizer(cfg.data.tokenizer)
    train, valid, _test = build_megatron(cfg, run_dir, vocab)
    wrap = lambda ds: None if ds is None else BertSamples(ds, vocab.sep, types, binary)  # noqa: E731
    return wrap(train), wrap(valid), f"{cfg.data.source} (megatron-core BERTMaskedWordPieceDataset, sentence-split)"
