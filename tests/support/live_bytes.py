"""Test helper: counts the bytes of tensor storages alive during a region (CPU peak-memory probe).

Used by the planner's CPU checks in-process and inside torchrun ranks (imported by path there).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Tracks storages created by ops; ``known`` tensors (parameters) are not counted as activations."""

    def __init__(self, known: list[torch.Tensor] = ()):
        super().__init__()
        self.live: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in known}
        self.cur = 0
        self.peak = 0

    def _free(self, key: int, n: int) -> None:
        if self.live.pop(key, None) is not None:
            self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    n = st.nbytes()
                    self.live[key] = n
                    self.cur += n
                    self.peak = max(self.peak, self.cur)
                    weakref.finalize(st, self._free, key, n)
        return out
