"""Training data for the backend: datasets -> per-micro-batch iterators in Megatron's sample order.

Datasets come from the config's model family (``workbench/models/<family>/data.py``): for
GPT, ``demo``/``indexed`` are megatron-core ``GPTDataset`` s built by
:func:`workbench.datasets.build_datasets` (items are dicts with ``tokens``, ``labels``,
``loss_mask``, ``position_ids``) and ``synthetic`` is a deterministic, learnable token stream
for tests (never zeros), only when the config says so.

Sample order follows Megatron's ``MegatronPretrainingSampler``: iteration k covers global
samples ``[k*G, (k+1)*G)``; micro-batch j of DP rank r takes
``k*G + j*mbs*dp + r*mbs + [0, mbs)``.  The data-parallel rank and size exclude context parallelism
(megatron's ``get_data_parallel_rank()``): the ranks of one CP group read the same samples, and the trainer keeps each
CP rank's load-balanced slice of the sequence (:func:`shard_batch`).  So every layout (TP/CP/PP/DP) sees the same global
batch per step, and resuming at ``consumed_samples`` continues the data exactly.

On a GPU, ``data.num_workers`` processes build the micro-batches ahead of the step (torch's ``DataLoader``, in
order, pinned): a BERT sample is masked in Python (~1 ms each, 64 a BERT-base step), which the training process
would otherwise do between kernel launches while the GPU waits.  CPU mode builds them inline (:func:`loader_workers`).
"""

from __future__ import annotations

import multiprocessing.util
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from workbench.backend.context_parallel import shard_sequence
from workbench.config import RunConfig, derive
from workbench.models.parts import parts_of

__all__ = ["build_datasets", "MicroBatchStream", "microbatch_indices", "loader_workers", "SEQUENCE_KEYS", "shard_batch"]

#: the per-token keys of a micro-batch ``[b, s]`` that context parallelism cuts along the sequence
SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def build_datasets(cfg: RunConfig, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]:
    """(train, valid, description) from the config's model family (``models/<family>/data.py``).

    ``data.source: synthetic`` is the family's deterministic token stream; every other source
    reads real data, and a failure to import or build it is an error, never a silent fallback.
    """
    return parts_of(cfg).data().build_datasets(cfg, run_dir, log=log)


def microbatch_indices(iteration: int, microbatch: int, gbs: int, mbs: int, dp: int, dp_rank: int, start_sample: int = 0) -> list[int]:
    base = start_sample + iteration * gbs + microbatch * mbs * dp + dp_rank * mbs
    return list(range(base, base + mbs))


def shard_batch(batch: dict[str, Any], cp_rank: int, cp: int, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Context parallelism: this CP rank's load-balanced slice (:func:`workbench.backend.context_parallel.shard_sequence`:
    chunks ``r`` and ``2cp-1-r`` of ``2cp``) of the per-token keys (:data:`SEQUENCE_KEYS` and the family's own
    ``keys``, e.g. BERT's padding mask and token types; each ``[b, s]``) along the sequence.
    Every rank of a CP group reads the same samples (its data-parallel rank excludes CP); position ids are cut like the
    tokens, so learned positions see each token's own position (RoPE slices its table the same way in megatron).  An
    explicit attention mask is refused (validation refuses per-document masks under CP; GPT's causal mask is implicit)."""
    if cp <= 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism: a micro-batch with an explicit attention mask (per-document masks) is not wired")
    out = dict(batch)
    for key in SEQUENCE_KEYS + tuple(keys):
        x = out.get(key)
        if x is not None and x.dim() >= 2:
            out[key] = shard_sequence(x, cp_rank, cp, seq_dim=1)
    return out


def loader_workers(cfg: RunConfig) -> int:
    """How many processes build a training stream's micro-batches: ``data.num_workers`` on a GPU; 0 in CPU mode,
    whose cores are the ranks' compute (workers there only add processes that compete for them)."""
    return int(cfg.data.num_workers) if cfg.parallel.device == "cuda" else 0


def collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Dataset items -> one micro-batch: every key stacked; token-like keys as int64."""
    batch = {key: torch.stack([torch.as_tensor(it[key]) for it in items]) for key in items[0]}
    for key in ("tokens", "labels", "position_ids"):
        if key in batch:
            batch[key] = batch[key].long()
    return batch


class _MicroBatches(torch.utils.data.Dataset):
    """Micro-batch k of the stream (k counts from the stream's start) as one item: what a loader worker builds."""

    def __init__(self, dataset: Any, at: Any):
        self.dataset, self.at = dataset, at

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        n = len(self.dataset)
        return collate([self.dataset[i % n] for i in self.at(k)])


def _quiet_worker(_worker_id: int) -> None:
    """A loader worker forked from a rank drops the rank's signal handlers: a SIGINT / SIGTERM to the process group
    is the rank's to handle (it stops at a step boundary, its worker then ended by the loader or by its death), and
    faulthandler's SIGUSR1 stack dump is the rank's too.  SIGKILL still ends a worker."""
    import faulthandler
    import signal

    faulthandler.unregister(signal.SIGUSR1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _end_workers(loader: Any) -> None:
    """Stop a loader's workers: torch's own request, then a kill for any still alive.

    The workers ignore SIGTERM (:func:`_quiet_worker`), so neither the loader's nor multiprocessing's exit path
    (``terminate()``, then an unbounded ``join()``) can end one that did not stop on the loader's request: a process
    that never closed its stream hung at exit (every bench worker, 200 s a repeat until its timeout)."""
    workers = list(getattr(loader, "_workers", ()))
    try:
        if hasattr(loader, "_shutdown_workers"):
            loader._shutdown_workers()
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
            w.join(5)


class _Count(torch.utils.data.Sampler):
    """0, 1, 2, ... without end (a training stream has no length)."""

    def __iter__(self):
        import itertools

        return itertools.count()


@dataclass
class MicroBatchStream:
    """Iterator of collated micro-batches for one DP rank, starting at ``consumed_samples``."""

    dataset: Any
    cfg: RunConfig
    dp_rank: int
    consumed_samples: int = 0
    device: Optional[torch.device] = None
    #: loader processes building micro-batches ahead (0: built here, when asked for)
    workers: int = 0
    #: micro-batches each worker keeps built ahead (torch's ``prefetch_factor``)
    ahead: int = 2

    def __post_init__(self) -> None:
        d = derive(self.cfg)
        self.mbs = self.cfg.train.micro_batch_size
        self.gbs = self.cfg.train.global_batch_size
        self.dp = d.data_parallel
        self.num_micro = d.num_microbatches
        self._step = 0
        self._micro = 0
        self._ahead: Optional[dict[str, torch.Tensor]] = None
        self._loader: Optional[Iterator[dict[str, torch.Tensor]]] = None
        self._finalizer: Optional[multiprocessing.util.Finalize] = None
        if self.workers > 0:
            pin = self.device is not None and torch.device(self.device).type == "cuda"
            # fork: the workers inherit the dataset (megatron's index arrays, memory-mapped) without pickling it
            # ``ahead`` micro-batches a worker in flight (2: torch's and megatron-LM's default; a worker builds one in a
            # few ms, far ahead of a step's launches; more would only hold /dev/shm, s x s masks are MBs each), a
            # whole step under the step graph, which reads a step's micro-batches before it replays it
            self._loader = iter(torch.utils.data.DataLoader(
                _MicroBatches(self.dataset, self._indices), batch_size=None, sampler=_Count(), num_workers=self.workers,
                pin_memory=pin, prefetch_factor=self.ahead, multiprocessing_context="fork", persistent_workers=True,
                worker_init_fn=_quiet_worker))
            # multiprocessing's exit handler runs finalizers with an exit priority before it terminates and joins its
            # children, which would wait for ever on these (they ignore SIGTERM)
            self._finalizer = multiprocessing.util.Finalize(self, _end_workers, args=(self._loader,), exitpriority=10)

    def _indices(self, k: int) -> list[int]:
        """Sample indices of the stream's micro-batch k."""
        step, micro = divmod(k, self.num_micro)
        return microbatch_indices(step, micro, self.gbs, self.mbs, self.dp, self.dp_rank, self.consumed_samples)

    def close(self) -> None:
        """End the loader's worker processes (:func:`_end_workers`); also when the stream is collected or this
        process exits, whichever comes first, if nobody did."""
        self._loader = None
        if self._finalizer is not None:
            self._finalizer()  # runs once

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def prefetch(self) -> None:
        """Build the next micro-batch now, while the GPU is still busy (same order, same data).

        The trainer calls this once the step's forward/backward work is queued, so the next
        step's first micro-batch is not built on the host while the GPU idles after the
        step-boundary synchronize.
        """
        if self._ahead is None and self._loader is None:  # (the loader's workers are ahead already)
            self._ahead = self._build()

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._ahead is not None:
            out, self._ahead = self._ahead, None
            return out
        return self._build()

    def _build(self) -> dict[str, torch.Tensor]:
        k = self._step * self.num_micro + self._micro
        self._micro += 1
        if self._micro == self.num_micro:
            self._micro = 0
            self._step += 1
        if self._loader is not None:  # built (and pinned) by a worker; micro-batch k is the loader's k-th
            batch = next(self._loader)
            return {k_: v.to(self.device, non_blocking=True) for k_, v in batch.items()} if self.device is not None else batch
        n = len(self.dataset)
        batch = collate([self.dataset[i % n] for i in self._indices(k)])
        if self.device is not None:
            # From pinned memory the copy is asynchronous.  From pageable memory a copy this size
            # returns only once the stream has drained, so the host could never run ahead of the
            # GPU and the GPU idled while the next micro-batch's kernels were launched (H200
            # host profile: most of the host's blocked time in a GPT-2 small step was in .to()).
            pin = torch.device(self.device).type == "cuda"
            batch = {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}
        return batch
