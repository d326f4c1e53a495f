"""T5's datasets: span corruption (:mod:`workbench.families.t5.spans`) over megatron-core ``GPTDataset`` token windows of
``.bin/.idx`` data (the embedded corpus or ``indexed`` prefixes), and a learnable synthetic stream.

Each sample takes ``raw`` consecutive tokens (megatron-core's GPT sample index: documents
concatenated with their end-of-document tokens, shuffled windows, blends and splits), where ``raw``
is T5's ``compute_input_and_target_lengths`` for ``model.seq_length`` and the noise settings
(``data.noise_density``, ``data.mean_noise_span_length``), so a corrupted sample fills the encoder.
The noise mask is drawn from a generator seeded by (seed, split, index): every layout sees the same
samples.  Items: ``tokens`` (encoder input), ``enc_mask``, ``dec_tokens`` (start token + targets
shifted right), ``labels`` (targets, pad at padding) and ``loss_mask`` (see :mod:`.step`).

megatron-core's ``T5MaskedWordPieceDataset`` is not used: it masks whole WordPiece words as n-grams
(Megatron's BERT masking, ``[MASK]`` id required) rather than T5's span corruption, so its noise
density and span lengths are not the configured ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from workbench.datasets import build_datasets as megatron_datasets
from workbench.models.common.seeds import mix32
from workbench.families.t5.spans import T5Vocab, check_t5_tokenizer, corrupt, input_and_target_lengths, random_spans_noise_mask

__all__ = ["t5_sample", "SpanCorruptedDataset", "SyntheticT5Dataset", "build_datasets", "synthetic_vocab"]


def t5_sample(raw: Any, rng: Any, vocab: T5Vocab, enc_len: int, dec_len: int, noise_density: float,
              mean_span: float) -> dict[str, torch.Tensor]:
    """One training item from ``raw`` tokens (see the module docstring)."""
    raw = np.asarray(raw, dtype=np.int64)
    mask = random_spans_noise_mask(len(raw), noise_density, mean_span, rng)
    inp, tgt = corrupt(raw, mask, vocab.sentinels, vocab.eos)
    inp, tgt = inp[:enc_len], tgt[:dec_len]
    tokens = np.full(enc_len, vocab.pad, np.int64)
    tokens[: len(inp)] = inp
    labels = np.full(dec_len, vocab.pad, np.int64)
    labels[: len(tgt)] = tgt
    dec = np.full(dec_len, vocab.pad, np.int64)
    dec[0] = vocab.decoder_start
    dec[1: len(tgt)] = tgt[:-1][: dec_len - 1]
    return {
        "tokens": torch.from_numpy(tokens),
        "enc_mask": torch.from_numpy((np.arange(enc_len) < len(inp)).astype(np.int64)),
        "dec_tokens": torch.from_numpy(dec),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy((np.arange(dec_len) < len(tgt)).astype(np.float32)),
    }


class SpanCorruptedDataset:
    """Span corruption over a dataset of raw token windows (a megatron-core GPTDataset's ``tokens``)."""

    def __init__(self, windows: Any, vocab: T5Vocab, cfg: Any, offset: int = 0):
        m, d = cfg.model, cfg.data
        self.windows, self.vocab, self.offset, self.seed = windows, vocab, int(offset), int(cfg.train.seed)
        self.enc, self.dec = m.seq_length, m.decoder_seq
        self.density, self.mean = d.noise_density, d.mean_noise_span_length
        self.raw = input_and_target_lengths(self.enc, self.density, self.mean)[0]

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        raw = np.asarray(self.windows[idx]["tokens"], dtype=np.int64)[: self.raw]
        rng = np.random.default_rng(mix32(self.seed, self.offset, int(idx)))
        return t5_sample(raw, rng, self.vocab, self.enc, self.dec, self.density, self.mean)


def synthetic_vocab(vocab_size: int) -> T5Vocab:
    """Synthetic data's ids: pad 0, eos 1, sentinels the top 100 ids (``<extra_id_0>`` = vocab - 1, as T5)."""
    return T5Vocab(None, [vocab_size - 1 - i for i in range(100)], eos=1, pad=0)


class SyntheticT5Dataset:
    """Deterministic, learnable T5 samples without a tokenizer: span corruption of arithmetic
    progressions (ids 2 .. vocab - 101; start and stride from (seed, i)), so masked spans follow
    from their neighbours and the loss falls."""

    def __init__(self, cfg: Any, offset: int = 0, size: int = 1 << 30):
        m, d = cfg.model, cfg.data
        self.vocab = synthetic_vocab(m.vocab_size)
        self.span = m.vocab_size - 102
        self.seed, self.offset, self.size = int(cfg.train.seed), int(offset), int(size)
        self.enc, self.dec = m.seq_length, m.decoder_seq
        self.density, self.mean = d.noise_density, d.mean_noise_span_length
        self.raw = input_and_target_lengths(self.enc, self.density, self.mean)[0]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng(mix32(self.seed, self.offset, int(idx)))
        start, stride = int(rng.integers(0, self.span)), int(rng.integers(1, 4))
        raw = 2 + (start + stride * np.arange(self.raw)) % self.span
        return t5_sample(raw, rng, self.vocab, self.enc, self.dec, self.density, self.mean)


def build_datasets(cfg: Any, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description): ``synthetic`` only when the config says so, else span corruption over
    megatron-core GPT windows of the configured data."""
    if cfg.data.source == "synthetic":
        return SyntheticT5Dataset(cfg), SyntheticT5Dataset(cfg, offset=1), "synthetic (T5 span corruption)"
    vocab = check_t5_tokenizer(cfg.data.tokenizer, cfg)
    raw = input_and_target_lengths(cfg.model.seq_length, cfg.data.noise_density, cfg.data.mean_noise_span_length)[0]
    window_cfg = cfg.replace(**{"model.seq_length": raw, "model.max_position_embeddings": max(raw, cfg.model.max_position_embeddings)})
    train, valid, _test = megatron_datasets(window_cfg, run_dir, create_attention_mask=False, tokenizer=vocab.tokenizer)
    wrap = lambda ds, off: None if ds is None else SpanCorruptedDataset(ds, vocab, cfg, offset=off)  # noqa: E731
    d = cfg.data
    return (wrap(train, 0), wrap(valid, 1),
            f"{d.source} (T5 span corruption: noise density {d.noise_density}, mean span {d.mean_noise_span_length}, "
            f"{raw} raw tokens -> {cfg.model.seq_length} encoder tokens)")
