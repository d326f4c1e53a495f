"""A forward-step hook that fails on one rank after a few micro-batches (GPU failure proof).

The other ranks are then blocked in the data-parallel gradient all-reduce: the launcher must
surface the failing rank's traceback and tear every rank down, not hang.
"""

from __future__ import annotations

from typing import Any

from workbench.hooks import default_forward_step

_calls = 0


def forward_step(batch: Any, model: Any, fail_rank: int = 1, fail_after: int = 3, **kwargs: Any) -> Any:
    """The default GPT forward, except on ``fail_rank`` past its ``fail_after``-th micro-batch."""
    global _calls
    import torch.distributed as dist

    _calls += 1
    if dist.get_rank() == fail_rank and _calls > fail_after:
        raise RuntimeError(f"injected failure on rank {fail_rank} at micro-batch {_calls}")
    return default_forward_step(batch, model, **kwargs)
