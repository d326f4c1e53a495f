"""A supervisor's watch over its ranks' progress: a rank that makes none for too long is stalled.

A rank stopped by a signal (SIGSTOP), deadlocked, or stuck in a collective whose peer is gone never
raises, so nothing else ends its run: gloo and NCCL wait for their whole timeout (600 s and more),
and the run stays ``running``.  The supervisor feeds :class:`StallWatch` every event it reads; a
rank makes **progress** when it writes an event (a step, an eval, a checkpoint, ...; an evaluation writes
``eval_progress`` events while it runs), and while a
checkpoint is being saved (which writes its event only when done) files under the checkpoint
directory keep changing.  A rank is **stalled** when it has made no progress for longer than:

- before any rank's first step (starting, loading data, compiling, capturing CUDA graphs):
  ``max(startup, floor)`` seconds; the launch derives ``startup`` from the config
  (:func:`startup_limit`: a base, seconds per billion parameters each rank builds, compilation and
  CUDA graphs, a checkpoint to load, the first step's own compute): about a minute for the tiny CPU preset (so
  the floor's 5 minutes), 26 minutes for Llama-3.1-8B on one GPU, hours for Mixtral-8x7B on one; where 30 minutes
  were once the limit for all.  ``--startup-timeout`` / ``startup_timeout=`` replaces it;
- after it: ``max(floor, 20 x the median time between a rank's step events, 2 x the longest
  time between two of its events seen so far)``, so a run's own rhythm (its log interval, its
  evals and saves once seen) never looks like a stall.  ``floor`` defaults to
  :data:`DEFAULT_STALL_FLOOR` (5 minutes: above the first checkpoint save or evaluation of the
  models the workbench trains, which the rhythm has not measured yet).

``floor`` 0 turns the watch off.  Which rank is named: one whose process is stopped (it cannot
print its stack), else the one that has been silent longest.  Stdlib only.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from workbench.config import derive

__all__ = ["DEFAULT_STALL_FLOOR", "DEFAULT_STARTUP_TIMEOUT", "STALL_FACTOR", "Stall", "StallWatch", "startup_limit"]

#: seconds without progress after a run's first step before a rank counts as stalled, at the least
DEFAULT_STALL_FLOOR = 300.0
#: seconds a rank may take to its first step when no config says more (the supervisor's own default;
#: a launch passes :func:`startup_limit` of its config instead)
DEFAULT_STARTUP_TIMEOUT = 1800.0
#: :func:`startup_limit`'s terms, in seconds: every run (process start, imports, process groups, data) ...
STARTUP_BASE_S = 60.0
#: ... per billion parameters one rank builds, initialises or loads (the model divided by TP x PP), by device
STARTUP_S_PER_BILLION = {"cuda": 120.0, "cpu": 600.0}
#: ... compiling the fused layer pieces (CUDA with ``train.compile_kernels``) and capturing them as CUDA graphs
STARTUP_COMPILE_S, STARTUP_CUDA_GRAPHS_S = 240.0, 120.0
#: ... per billion parameters a rank reads from ``checkpoint.load_dir``
STARTUP_LOAD_S_PER_BILLION = 60.0
#: the first step's own compute (its FLOPs per rank, sequence and batch included) at this rate, times 3
STARTUP_FLOPS_PER_S = {"cuda": 1e14, "cpu": 1e10}
#: the bound is at least this many times the median time between a rank's step events
STALL_FACTOR = 20.0
#: ... and at least this many times the longest time between two events of a rank seen after its first step
LONGEST_FACTOR = 2.0


@dataclass
class Stall:
    """The verdict: ``rank`` made no progress for ``idle`` seconds, over ``bound``."""

    rank: int
    idle: float
    bound: float
    stopped: list[int] = field(default_factory=list)  # ranks whose processes are stopped (SIGSTOP)
    idle_ranks: list[int] = field(default_factory=list)  # every rank past the bound
    startup: bool = False  # judged by the startup bound (no step yet)

    @property
    def message(self) -> str:
        if self.startup:
            msg = (f"rank {self.rank} made no progress for {self.idle:.0f} s before its first step (waited for its start, "
                   f"data, compilation and first step; start-up limit {self.bound:.0f} s for this model: raise it with "
                   f"--startup-timeout SECONDS or Run.launch(startup_timeout=...))")
        else:
            msg = f"rank {self.rank} made no progress for {self.idle:.0f} s since its last event (bound {self.bound:.0f} s)"
        if self.rank in self.stopped:
            msg += ": its process is stopped (SIGSTOP or a debugger)"
        elif len(self.idle_ranks) > 1:
            msg += f"; ranks {', '.join(map(str, self.idle_ranks))} all stalled (it has been silent longest): see the stacks"
        return msg

    def to_dict(self) -> dict:
        return {"rank": self.rank, "idle_s": round(self.idle, 3), "bound_s": round(self.bound, 3), "stopped": self.stopped,
                "idle_ranks": self.idle_ranks, "before_first_step": self.startup}


def startup_limit(cfg) -> float:
    """Seconds a rank of ``cfg`` may take to its first step (the start-up watch's limit): the sum of
    :data:`STARTUP_BASE_S`; :data:`STARTUP_S_PER_BILLION` (by device) x the billions of parameters one rank
    builds (all of them / (TP x PP)); :data:`STARTUP_COMPILE_S` and :data:`STARTUP_CUDA_GRAPHS_S` when a CUDA
    run compiles (and captures); :data:`STARTUP_LOAD_S_PER_BILLION` x those billions when it loads a
    checkpoint; 3 x the first step's FLOPs per rank over :data:`STARTUP_FLOPS_PER_S` (so sequence length
    and batch count).  Rounded up to whole seconds."""
    import math

    d = derive(cfg)
    p, t = cfg.parallel, cfg.train
    device = "cuda" if p.device == "cuda" else "cpu"
    billions = d.params.total / max(p.tensor_parallel, 1) / max(p.pipeline_parallel, 1) / 1e9
    limit = STARTUP_BASE_S + STARTUP_S_PER_BILLION[device] * billions
    if device == "cuda" and t.compile_kernels:
        limit += STARTUP_COMPILE_S + (STARTUP_CUDA_GRAPHS_S if t.cuda_graphs else 0.0)
    if cfg.checkpoint.load_dir:
        limit += STARTUP_LOAD_S_PER_BILLION * billions
    limit += 3 * d.flops_per_step / max(d.world_size, 1) / STARTUP_FLOPS_PER_S[device]
    return float(math.ceil(limit))


class StallWatch:
    """See the module docstring.  ``ranks``: the global ranks to watch (this node's); ``activity``:
    directories whose changing files count as progress (the checkpoint directory)."""

    def __init__(self, ranks: Iterable[int], *, floor: float = DEFAULT_STALL_FLOOR,
                 startup: float = DEFAULT_STARTUP_TIMEOUT, factor: float = STALL_FACTOR,
                 activity: Iterable[str | Path] = (), now: float | None = None):
        self.ranks = sorted(int(r) for r in ranks)
        self.floor, self.startup, self.factor = float(floor), float(startup), float(factor)
        self.activity = [Path(a) for a in activity]
        self.started = time.time() if now is None else now
        self.last: dict[int, float] = {}  # rank -> time of its last event (the rank's clock: this machine's)
        self.last_step: dict[int, float] = {}
        self.step_gaps: deque[float] = deque(maxlen=200)
        self.longest = 0.0
        self.ended: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.floor > 0 and bool(self.ranks)

    def feed(self, events: Iterable) -> None:
        """Take the events just read (every rank's; other nodes' are ignored)."""
        for e in events:
            r = e.get("rank")
            t = e.get("time")
            if r not in self.ranks or not isinstance(t, (int, float)):
                continue
            prev = self.last.get(r)
            if prev is not None and r in self.last_step and t > prev:
                self.longest = max(self.longest, t - prev)
            self.last[r] = max(t, prev or t)
            if e.event == "step":
                if r in self.last_step and t > self.last_step[r]:
                    self.step_gaps.append(t - self.last_step[r])
                self.last_step[r] = t
            elif e.event == "run_end":
                self.ended.add(r)

    def bound(self) -> float:
        """Seconds of silence that make a rank stalled now (the startup bound until a rank has stepped)."""
        if not self.last_step:
            return max(self.startup, self.floor)
        rhythm = self.factor * statistics.median(self.step_gaps) if self.step_gaps else 0.0
        return max(self.floor, rhythm, LONGEST_FACTOR * self.longest)

    def check(self, now: float | None = None, stopped: Callable[[], Iterable[int]] = lambda: ()) -> Stall | None:
        """The stall, if a watched rank that has not ended has been silent past :meth:`bound`; ``stopped``
        (asked only then) gives the ranks whose processes are stopped."""
        if not self.enabled:
            return None
        now = time.time() if now is None else now
        bound = self.bound()
        idle = {r: now - self.last.get(r, self.started) for r in self.ranks if r not in self.ended}
        late = sorted((r for r, s in idle.items() if s > bound), key=lambda r: (-idle[r], r))
        if not late:
            return None
        busy = self._activity_since(now - bound)
        if busy:
            return None  # a checkpoint is being written: progress without events
        halted = sorted(set(stopped()) & set(self.ranks))
        rank = next((r for r in late if r in halted), late[0])
        return Stall(rank, idle[rank], bound, halted, sorted(late), startup=not self.last_step)

    def _activity_since(self, since: float, limit: int = 5000) -> bool:
        """Whether a file under the activity directories changed after ``since`` (a save in flight: it
        writes into the newest entries of the checkpoint directory)."""
        seen = 0
        for root in self.activity:
            try:
                entries = sorted(root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)[:2]
            except OSError:
                continue
            for top in entries:
                walk = os.walk(top) if top.is_dir() else [(str(root), [], [top.name])]
                for dirpath, _dirs, files in walk:
                    for name in files:
                        seen += 1
                        if seen > limit:
                            return False
                        try:
                            if os.stat(os.path.join(dirpath, name)).st_mtime > since:
                                return True
                        except OSError:
                            continue
        return False
