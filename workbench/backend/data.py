"""Training data for the backend: datasets -> per-micro-batch iterators in Megatron's sample order.

Sources: ``demo``/``indexed`` come from the data helper's
``workbench.data.megatron.build_datasets(cfg, run_dir) -> (train, valid, test)``
(megatron-core ``GPTDataset``-like: ``len()`` and items that are dicts with ``tokens``,
``labels``, ``loss_mask``, ``position_ids``); ``synthetic`` is a deterministic, learnable
token stream for tests (never zeros).  Until the data helper's module exists, ``demo`` /
``indexed`` fall back to synthetic with a clear log line.

Sample order follows Megatron's ``MegatronPretrainingSampler``: iteration k covers global
samples ``[k*G, (k+1)*G)``; micro-batch j of DP rank r takes
``k*G + j*mbs*dp + r*mbs + [0, mbs)``.  So every layout (TP/PP/DP) sees the same global
batch per step, and resuming at ``consumed_samples`` continues the data exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from workbench.config import RunConfig, derive

__all__ = ["SyntheticGPTDataset", "build_datasets", "MicroBatchStream", "microbatch_indices"]


def _mix32(*values: int) -> int:
    """splitmix64 over the values, folded to 32 bits (distinct streams for distinct inputs)."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0xFFFFFFFF


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
        # torch's CPU generator keeps only 32 bits of a seed: mix (seed, offset, idx) first
        g = torch.Generator().manual_seed(_mix32(self.seed, self.offset, int(idx)))
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


def build_datasets(cfg: RunConfig, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description). Uses the data helper's builder for demo/indexed when present."""
    m = cfg.model
    if cfg.data.source != "synthetic":
        try:
            from workbench.data.megatron import build_datasets as data_build  # the data helper's module
        except ImportError as e:
            log(f"[workbench] data source '{cfg.data.source}' needs workbench.data.megatron ({e}); "
                "FALLING BACK to the synthetic token stream (tests only)")
        else:
            # Megatron's GPTDataset can build a causal mask per sample; the attention module masks
            # causally by itself (flash path), so a mask is only needed for document-level masking.
            train, valid, _test = data_build(cfg, run_dir, create_attention_mask=bool(cfg.data.reset_attention_mask))
            return train, valid, f"{cfg.data.source} (workbench.data.megatron)"
    train = SyntheticGPTDataset(m.vocab_size, m.seq_length, cfg.train.seed)
    valid = SyntheticGPTDataset(m.vocab_size, m.seq_length, cfg.train.seed, offset=1)
    return train, valid, "synthetic"


def microbatch_indices(iteration: int, microbatch: int, gbs: int, mbs: int, dp: int, dp_rank: int, start_sample: int = 0) -> list[int]:
    base = start_sample + iteration * gbs + microbatch * mbs * dp + dp_rank * mbs
    return list(range(base, base + mbs))


@dataclass
class MicroBatchStream:
    """Iterator of collated micro-batches for one DP rank, starting at ``consumed_samples``."""

    dataset: Any
    cfg: RunConfig
    dp_rank: int
    consumed_samples: int = 0
    device: Optional[torch.device] = None

    def __post_init__(self) -> None:
        d = derive(self.cfg)
        self.mbs = self.cfg.train.micro_batch_size
        self.gbs = self.cfg.train.global_batch_size
        self.dp = d.data_parallel
        self.num_micro = d.num_microbatches
        self._step = 0
        self._micro = 0
        self._ahead: Optional[dict[str, torch.Tensor]] = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def prefetch(self) -> None:
        """Build the next micro-batch now, while the GPU is still busy (same order, same data).

        The trainer calls this once the step's forward/backward work is queued, so the next
        step's first micro-batch is not built on the host while the GPU idles after the
        step-boundary synchronize.
        """
        if self._ahead is None:
            self._ahead = self._build()

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._ahead is not None:
            out, self._ahead = self._ahead, None
            return out
        return self._build()

    def _build(self) -> dict[str, torch.Tensor]:
        idx = microbatch_indices(self._step, self._micro, self.gbs, self.mbs, self.dp, self.dp_rank, self.consumed_samples)
        self._micro += 1
        if self._micro == self.num_micro:
            self._micro = 0
            self._step += 1
        n = len(self.dataset)
        items = [self.dataset[i % n] for i in idx]
        batch = {}
        for key in items[0]:
            vals = [torch.as_tensor(it[key]) for it in items]
            batch[key] = torch.stack(vals)
        for key in ("tokens", "labels", "position_ids"):
            if key in batch:
                batch[key] = batch[key].long()
        if self.device is not None:
            # From pinned memory the copy is asynchronous.  From pageable memory a copy this size
            # returns only once the stream has drained, so the host could never run ahead of the
            # GPU and the GPU idled while the next micro-batch's kernels were launched (H200
            # host profile: most of the host's blocked time in a GPT-2 small step was in .to()).
            pin = torch.device(self.device).type == "cuda"
            batch = {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
