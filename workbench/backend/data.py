"""Training data for the backend: datasets -> per-micro-batch iterators in Megatron's sample order.

Datasets come from the config's model family (``workbench/models/<family>/data.py``): for
GPT, ``demo``/``indexed`` are megatron-core ``GPTDataset`` s built by
:func:`workbench.data.megatron.build_datasets` (items are dicts with ``tokens``, ``labels``,
``loss_mask``, ``position_ids``) and ``synthetic`` is a deterministic, learnable token stream
for tests (never zeros), only when the config says so.

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
from workbench.models.parts import parts_of

__all__ = ["build_datasets", "MicroBatchStream", "microbatch_indices"]


def build_datasets(cfg: RunConfig, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description) from the config's model family (``models/<family>/data.py``).

    ``data.source: synthetic`` is the family's deterministic token stream; every other source
    reads real data, and a failure to import or build it is an error, never a silent fallback.
    """
    return parts_of(cfg).data().build_datasets(cfg, run_dir, log=log)


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
