"""Python's garbage collector on a training rank: one collection at the end of each step, none inside it.

A rank holds hundreds of thousands of Python objects once megatron-core, torch and the model are loaded.  Left to
itself, Python's collector runs dozens of young-generation passes a step (one every 700 allocations: autograd nodes,
the dispatcher's tensors) and, every few steps, a full pass over all of those objects, at whatever point of the step
the allocation count runs out: inside the forward, between two kernel launches of a host-bound step
(``bench/gc_probe.py``, ``bench/results/gc_probe.jsonl``: on a 2-core CPU at ``moe-research``'s depth, 57.7 ms a step,
a full pass of ~250 ms every ~6 steps; the step's collection below, 1.1 ms a step).  Megatron-LM's ``--manual-gc``
and torchtitan's ``GarbageCollection`` switch the automatic collector off for this reason.

:class:`StepCollector` does what they do, with the objects that live for the whole run set aside:

- :meth:`~StepCollector.start` (``with trainer.collector:`` around the training loop): one full collection, then
  ``gc.freeze()`` (everything alive now -- the modules, the optimizer, the imported libraries -- goes to the permanent
  generation, which no later pass walks) and ``gc.disable()``;
- :meth:`~StepCollector.after_step` (the Trainer calls it inside the step, after the optimizer's kernels are queued
  and before anything waits for the device, so it overlaps their work and its time is part of the step time): a
  collection of the young generations (what the step allocated and left alive; its cost does not grow with what
  older steps left); every :data:`FULL_EVERY` steps a full pass of what is not frozen; after each of the first
  :data:`WARM_STEPS` steps a full pass, then the survivors (the compiled kernels' graphs and guards, the first steps'
  caches) frozen too;
- :meth:`~StepCollector.stop`: the automatic collector back as it was, the objects it froze returned to it.

Garbage in reference cycles made within a step goes at the end of that step; a cycle among objects that outlived
their step goes at the next full pass, at most :data:`FULL_EVERY` steps later.  Evaluation and checkpointing between
steps run without collections until the next step's end.
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
    """Collect garbage once a step (:meth:`after_step`) between :meth:`start` and :meth:`stop` (or inside ``with``)."""

    def __init__(self) -> None:
        self.active = False
        self.steps = 0
        self.last_ms = 0.0  #: the last step's collection, milliseconds
        self._was_enabled = True
        self._froze = False

    def start(self) -> "StepCollector":
        """The automatic collector off, what is alive now frozen (idempotent)."""
        if not self.active:
            self._was_enabled = gc.isenabled()
            # objects another caller froze stay frozen at stop(): unfreeze only what this froze
            self._froze = gc.get_freeze_count() == 0
            gc.collect()
            gc.freeze()
            gc.disable()
            self.active, self.steps = True, 0
        return self

    __enter__ = start

    def after_step(self) -> None:
        """Collect the young generations, or every :data:`FULL_EVERY` steps all that is not frozen (a no-op unless
        entered)."""
        if not self.active:
            return
        t0 = time.perf_counter()
        self.steps += 1
        if self.steps <= WARM_STEPS:  # a full pass first: no garbage of these steps is frozen with their survivors
            gc.collect()
            gc.freeze()
        elif self.steps % FULL_EVERY == 0:
            gc.collect()
        else:
            gc.collect(1)
        self.last_ms = (time.perf_counter() - t0) * 1e3

    def stop(self) -> None:
        """The automatic collector as it was before :meth:`start` (idempotent)."""
        if self.active:
            self.active = False
            if self._froze:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    def __exit__(self, *exc: object) -> None:
        self.stop()
