"""GPT's datasets: megatron-core ``GPTDataset`` s for real data, a learnable token stream for tests.

Items are dicts of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (and
``attention_mask`` with document-level masking), one sample of ``seq_length`` tokens each.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.datasets import build_datasets as megatron_datasets
from workbench.models.common.seeds import mix32

__all__ = ["SyntheticGPTDataset", "build_datasets"]


class SyntheticGPTDataset:
    """Deterministic, learnable sequences: arithmetic progressions modulo the vocab (ids >= 1).

    Sample i: start and stride drawn from a generator seeded by (seed, i); token t =
    1 + (start + stride * t) mod (vocab - 1).  A model can learn to continue them, so the
    loss falls, and no token is ever 0.
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234, offset: int = 0, size: int = 1 << 30):
        self.vocab = int(vocab_size)
        self.seq = int(seq_length)
        self.seed = int(seed)
        self.offset = int(offset)
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(mix32(self.seed, self.offset, int(idx)))
        start = int(torch.randint(0, self.vocab - 1, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        t = torch.arange(self.seq + 1)
        seq = 1 + (start + stride * t) % (self.vocab - 1)
        return {
            "tokens": seq[:-1].clone(),
            "labels": seq[1:].clone(),
            "loss_mask": torch.ones(self.seq, dtype=torch.float32),
            "position_ids": torch.arange(self.seq),
        }


def build_datasets(cfg: Any, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description): ``synthetic`` only when the config says so, else megatron's GPTDataset."""
    m = cfg.model
    if cfg.data.source == "synthetic":
        train = SyntheticGPTDataset(m.vocab_size, m.seq_length, cfg.train.seed)
        valid = SyntheticGPTDataset(m.vocab_size, m.seq_length, cfg.train.seed, offset=1)
        return train, valid, "synthetic"
    # Megatron's GPTDataset can build a causal mask per sample; the attention module masks
    # causally by itself (flash path), so a mask is only needed for document-level masking.
    train, valid, _test = megatron_datasets(cfg, run_dir, create_attention_mask=bool(cfg.data.reset_attention_mask))
    return train, valid, f"{cfg.data.source} (workbench.datasets)"
