"""Python's garbage collector on a training rank: one collection at the end of each step, none inside it.

A rank holds ~0.5-1 million Python objects once megatron-core, torch and the compiled kernels are loaded.  Left to
itself, Python's collector runs ~50 young-generation passes a step (every 700 allocations: autograd nodes, the
dispatcher's tensors) and, every few steps, a full pass over all of those objects: ~250 ms on a 2-core CPU for a
16-layer MoE every 6th step, at a random point of the step (inside the forward, between two kernel launches of a
host-bound step), so step times jitter and the device waits.  Megatron-LM's ``--manual-gc`` and torchtitan's
``GarbageCollection`` switch the automatic collector off for this reason.

:class:`StepCollector` does what they do, with the objects that live for the whole run set aside:

- on entering (``with trainer.collector:``): one full collection, then ``gc.freeze()`` (everything alive now -- the
  modules, the optimizer, the imported libraries -- goes to the permanent generation, which no later pass walks) and
  ``gc.disable()``;
- :meth:`~StepCollector.after_step` (the Trainer calls it inside the step, before the step's last device sync, so its
  time is part of the step time it reports): a collection of the young generations, what the step allocated and left
  alive (a few milliseconds: its cost does not grow with the objects older steps left, which a full pass would walk
  every step -- 0.5 s a step on one H200 under the torch profiler's records, ``bench/results/moe_profile.jsonl:11``);
  every :data:`FULL_EVERY` steps a full pass of what is not frozen; after each of the first :data:`WARM_STEPS` steps
  the survivors (the compiled kernels' graphs and guards, the first steps' caches) are frozen too;
- on leaving: the automatic collector back as it was, the frozen objects returned to it.

Garbage in reference cycles made within a step goes at the end of that step; a cycle among objects that outlived
their step goes at the next full pass, at most :data:`FULL_EVERY` steps later.
"""

from __future__ import annotations

import gc
import time

__all__ = ["StepCollector", "WARM_STEPS", "FULL_EVERY"]

#: steps after which what survived the step's collection is frozen too (compilation happens in the first steps)
WARM_STEPS = 3
#: steps between full passes (the others collect the young generations only)
FULL_EVERY = 100


class StepCollector:
    """Collect garbage once a step (:meth:`after_step`) while entered; ``enabled=False``: a no-op throughout."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.active = False
        self.steps = 0
        self.last_ms = 0.0  #: the last step's collection, milliseconds
        self._was_enabled = True

    def __enter__(self) -> "StepCollector":
        if self.enabled and not self.active:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
            self.active, self.steps = True, 0
        return self

    def after_step(self) -> None:
        """Collect the young generations, or every :data:`FULL_EVERY` steps all that is not frozen (a no-op unless
        entered)."""
        if not self.active:
            return
        t0 = time.perf_counter()
        self.steps += 1
        gc.collect() if self.steps % FULL_EVERY == 0 else gc.collect(1)
        if self.steps <= WARM_STEPS:
            gc.freeze()
        self.last_ms = (time.perf_counter() - t0) * 1e3

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self.active = False
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
