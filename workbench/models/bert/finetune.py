"""BERT sequence classification: a fresh head on the pooled first token, fine-tuned from a pretrained checkpoint.

``model.num_labels: N`` (> 0) gives the model a classification head (``classifier``: a linear
layer ``hidden -> N`` on the pooler's output, replicated on every TP rank like the binary head)
and makes it train classification instead of pretraining: the loss is the cross entropy over
the labels, and the report carries ``accuracy`` (train steps and eval; :func:`.step.classification_loss`).  Loading a pretraining
checkpoint with ``checkpoint.load_dir`` + ``checkpoint.finetune: true`` takes the encoder (and the
pooler) from it and leaves the head as initialised (``WorkbenchBertModel.fresh_on_finetune``); the masked-LM head
stays in the model, unused.

Labelled sets (items: ``tokens`` = ``[CLS] text [SEP] [PAD]...``, ``padding_mask``,
``tokentype_ids`` when the model has token types, ``label``):

- ``data.source: demo`` -> :class:`TestamentDataset`: verses of the embedded corpus (KJV) labelled
  by testament (0 Old, 1 New; ``num_labels: 2``), made deterministically offline.  Held-out
  examples come from other chapters (every 10th chapter, offset 7) than the training ones; both
  splits are balanced (the Old Testament verses are subsampled to the New Testament's count), so
  chance is 50%.
- ``data.source: synthetic`` -> :class:`SyntheticLabelledDataset`: random token sequences labelled
  by which of ``num_labels`` vocabulary bands holds most of their tokens (tests).
"""

from __future__ import annotations

import gzip
from typing import Any

import numpy as np
import torch

from workbench.data.demo import DEMO_CORPUS
from workbench.families.bert.vocab import check_bert_tokenizer
from workbench.models.common.seeds import mix32

__all__ = ["TESTAMENT_LABELS", "testament_verses", "TestamentDataset", "SyntheticLabelledDataset", "build_datasets"]

#: the demo labelled set's classes
TESTAMENT_LABELS = ("Old Testament", "New Testament")
_FIRST_NT_BOOK = "Matthew"
_HELD_OUT = (10, 7)  # chapter index % 10 == 7 -> held out


def testament_verses(min_words: int = 6) -> list[tuple[str, int, int]]:
    """Every verse of the embedded corpus of at least ``min_words`` words: ``(text, label, chapter index)``."""
    out: list[tuple[str, int, int]] = []
    label, chapter = 0, -1
    with gzip.open(DEMO_CORPUS, "rt", encoding="utf-8") as f:
        title = True
        for line in f:
            line = line.strip()
            if not line:
                title = True
                continue
            if title:
                title = False
                chapter += 1
                if line.rsplit(" ", 1)[0] == _FIRST_NT_BOOK:
                    label = 1
                continue
            text = line.split(" ", 1)[1] if " " in line else line
            if len(text.split()) >= min_words:
                out.append((text, label, chapter))
    return out


def _balanced(rows: list[tuple[str, int, int]], seed: int) -> list[tuple[str, int]]:
    """Equal counts per label (the larger classes subsampled), in a seeded order."""
    g = np.random.default_rng(seed)
    by = [[r for r in rows if r[1] == c] for c in range(2)]
    n = min(len(b) for b in by)
    picked = [b[i] for b in by for i in sorted(g.choice(len(b), size=n, replace=False))]
    order = g.permutation(len(picked))
    return [(picked[i][0], picked[i][1]) for i in order]


class TestamentDataset:
    """Verses of the embedded corpus labelled by testament (see the module docstring); ``split``: train / valid."""

    def __init__(self, vocab: Any, seq_length: int, split: str = "train", seed: int = 1234, tokentypes: bool = True):
        rows = testament_verses()
        mod, off = _HELD_OUT
        keep = [r for r in rows if (r[2] % mod == off) == (split == "valid")]
        self.rows = _balanced(keep, seed + (1 if split == "valid" else 0))
        self.vocab, self.seq, self.tokentypes = vocab, int(seq_length), tokentypes

    def __len__(self) -> int:
        return len(self.rows)

    def text(self, idx: int) -> tuple[str, int]:
        return self.rows[idx % len(self.rows)]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text, label = self.text(idx)
        ids = [self.vocab.cls] + self.vocab.encode(text)[: self.seq - 2] + [self.vocab.sep]
        return _item(ids, label, self.seq, self.vocab.pad, self.tokentypes)


class SyntheticLabelledDataset:
    """Random ``[CLS] text [SEP]`` sequences labelled by the vocabulary band holding most of their tokens."""

    PAD, CLS, SEP, FIRST = 0, 2, 3, 5

    def __init__(self, vocab_size: int, seq_length: int, num_labels: int, seed: int = 1234, offset: int = 0,
                 tokentypes: bool = True, size: int = 1 << 30):
        self.vocab, self.seq, self.labels = int(vocab_size), int(seq_length), int(num_labels)
        self.seed, self.offset, self.size, self.tokentypes = int(seed), int(offset), int(size), tokentypes

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = np.random.default_rng(mix32(self.seed, self.offset + 7, int(idx)))
        band = (self.vocab - self.FIRST) // self.labels
        label = int(g.integers(0, self.labels))
        n = int(g.integers(max(self.seq // 2, 4), self.seq - 2 + 1))
        own = int(round(0.7 * n))  # 70% from the label's band, the rest anywhere
        text = np.concatenate([self.FIRST + label * band + g.integers(0, band, own), g.integers(self.FIRST, self.FIRST + band * self.labels, n - own)])
        ids = [self.CLS] + [int(t) for t in g.permutation(text)] + [self.SEP]
        return _item(ids, label, self.seq, self.PAD, self.tokentypes)


def _item(ids: list[int], label: int, seq: int, pad: int, tokentypes: bool) -> dict[str, torch.Tensor]:
    n = len(ids)
    out = {
        "tokens": torch.tensor(ids + [pad] * (seq - n), dtype=torch.long),
        "padding_mask": torch.tensor([1] * n + [0] * (seq - n), dtype=torch.long),
        "label": torch.tensor(label, dtype=torch.long),
    }
    if tokentypes:
        out["tokentype_ids"] = torch.zeros(seq, dtype=torch.long)
    return out


def build_datasets(cfg: Any, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, held-out, description) of the labelled set ``data.source`` names (rules refuse the others)."""
    m = cfg.model
    types = m.num_tokentypes > 0
    if cfg.data.source == "synthetic":
        train = SyntheticLabelledDataset(m.vocab_size, m.seq_length, m.num_labels, cfg.train.seed, tokentypes=types)
        valid = SyntheticLabelledDataset(m.vocab_size, m.seq_length, m.num_labels, cfg.train.seed, offset=1, tokentypes=types)
        return train, valid, f"synthetic labelled set ({m.num_labels} vocabulary bands)"
    vocab = check_bert_tokenizer(cfg.data.tokenizer)
    train = TestamentDataset(vocab, m.seq_length, "train", cfg.train.seed, types)
    valid = TestamentDataset(vocab, m.seq_length, "valid", cfg.train.seed, types)
    return train, valid, (f"embedded corpus verses labelled by testament: {len(train)} train, {len(valid)} held-out "
                          "(other chapters), balanced")
