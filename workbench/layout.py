"""The parallel layout of a run: its dimensions, their groups' sizes, and each rank's coordinates, derived once.

One :class:`Layout` answers what used to be recomputed wherever it was needed (``world // (tp * pp)``): the data
parallel size, the model-parallel size, megatron's expert grid (expert data parallel = world / (ETP x EP x PP)),
the divisibility rules between them, and where a global rank sits in each process group.  Config validation,
:func:`workbench.config.derive`, the planner, the advisor, the backend and the MoE rules read it; context
parallelism (``cp``) and a sharded data-parallel dimension (FSDP) plug in here.

Ranks are laid out as megatron-core lays them out: its default order ``"tp-cp-ep-dp-pp"``
(``parallel_state.initialize_model_parallel(order=...)``), the first dimension fastest.  The dense grid is
(tp, cp, dp, pp) with ep = 1 (megatron's decoder ``RankGenerator``); the expert grid is (etp, ep, edp, pp)
with cp = 1 (its expert ``RankGenerator``).  Both put pipeline stages outermost, so a rank's pipeline stage is
the same in both.

Pure Python: no torch, no megatron-core, no other workbench module (``config`` imports this one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

__all__ = ["MEGATRON_ORDER", "Coords", "Layout", "LayoutProblem"]

#: megatron-core's default rank order (``initialize_model_parallel(order=...)``): the first dimension varies fastest
MEGATRON_ORDER = "tp-cp-ep-dp-pp"

_DENSE = ("tp", "cp", "dp", "pp")  # dimensions of the dense grid (ep = 1 there)
_EXPERT = ("etp", "ep", "edp", "pp")  # dimensions of the expert grid (cp = 1 there)


def _size(v: Any) -> int:
    """A size as :func:`workbench.config.derive` reads it: below 1 (or not a number) counts as 1."""
    return v if isinstance(v, int) and v >= 1 else 1


class Coords(NamedTuple):
    """Where one global rank sits: its rank in each process group (megatron's ``get_*_rank()``)."""

    #: tensor-parallel rank (``get_tensor_model_parallel_rank``)
    tp: int
    #: context-parallel rank (``get_context_parallel_rank``)
    cp: int
    #: data-parallel rank (``get_data_parallel_rank``)
    dp: int
    #: pipeline stage (``get_pipeline_model_parallel_rank``)
    pp: int
    #: expert tensor-parallel rank (``get_expert_tensor_parallel_rank``)
    etp: int
    #: expert-parallel rank (``get_expert_model_parallel_rank``)
    ep: int
    #: expert data-parallel rank (``get_expert_data_parallel_rank``)
    edp: int


class LayoutProblem(NamedTuple):
    """A layout rule the sizes break, in :func:`workbench.config.validate`'s terms."""

    field: str  # the config field to change
    rule: str  # what is wrong
    fix: str  # how to fix it
    reads: tuple[str, ...]  # the other fields the rule reads


@dataclass(frozen=True)
class Layout:
    """The parallel dimensions of a run (megatron-core's ``initialize_model_parallel`` arguments, and the sizes it
    derives).  Build it from a config with :meth:`of`, or from sizes directly (``dp`` is derived)."""

    #: world size: every rank of the run (``nnodes * nproc_per_node``)
    world: int
    #: tensor-parallel size: each layer's weights split over this many ranks (megatron's ``tensor_model_parallel_size``)
    tp: int = 1
    #: pipeline-parallel size: the layers split into this many stages (``pipeline_model_parallel_size``)
    pp: int = 1
    #: model chunks per pipeline rank for interleaved 1F1B (``virtual_pipeline_model_parallel_size``); None: plain 1F1B
    vpp: int | None = None
    #: expert-parallel size: each MoE layer's experts split over this many ranks (``expert_model_parallel_size``)
    ep: int = 1
    #: expert tensor-parallel size (``expert_tensor_parallel_size``); None on input: the tensor-parallel size
    etp: int | None = None
    #: context-parallel size: each sequence split over this many ranks (``context_parallel_size``; GPT and BERT on the
    #: workbench SDPA attention's ring, :mod:`workbench.backend.context_parallel`; GPT also on TE's)
    cp: int = 1
    #: nodes of the launch (``parallel.nnodes``)
    nnodes: int = 1
    #: processes per node (``parallel.nproc_per_node``); None: the whole world on one node
    nproc_per_node: int | None = None
    #: data-parallel size: ``world / (tp * pp * cp)`` (at least 1, rounded down where the world does not divide;
    #: :meth:`problems` says so)
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.nproc_per_node is None:
            object.__setattr__(self, "nproc_per_node", max(self.world // max(self.nnodes, 1), 1))
        object.__setattr__(self, "dp", max(self.world // max(self.model_parallel, 1), 1))

    @classmethod
    def of(cls, cfg: Any) -> "Layout":
        """The layout of a :class:`workbench.config.RunConfig` (or anything with its ``parallel`` section).  Sizes
        below 1 count as 1, as :func:`workbench.config.derive` reads them (validation refuses them first)."""
        p = cfg.parallel
        tp = _size(p.tensor_parallel)
        return cls(
            world=_size(p.world_size), tp=tp, pp=_size(p.pipeline_parallel), vpp=p.virtual_pipeline_parallel,
            ep=_size(p.expert_parallel), etp=_size(p.expert_tensor_parallel or tp), cp=_size(getattr(p, "context_parallel", 1)),
            nnodes=_size(p.nnodes), nproc_per_node=_size(p.nproc_per_node),
        )

    # ------------------------------------------------------------------ derived sizes

    @property
    def model_chunks(self) -> int:
        """Model chunks per pipeline rank: ``vpp``, 1 without interleaving."""
        return self.vpp or 1

    @property
    def model_parallel(self) -> int:
        """Ranks holding one copy of the model between them: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    @property
    def divisible(self) -> bool:
        """Whether the world splits into whole data-parallel replicas (``world % (tp * pp * cp) == 0``)."""
        return self.world % self.model_parallel == 0

    @property
    def expert_model_parallel(self) -> int:
        """Ranks of megatron's expert grid other than expert data parallel: ``etp * ep * pp``."""
        return self.etp * self.ep * self.pp

    @property
    def expert_data_parallel(self) -> int:
        """Expert data-parallel size: ``world / (etp * ep * pp)``, megatron 0.19's definition (1 when it does not
        divide)."""
        grid = self.expert_model_parallel
        return max(self.world // grid, 1) if self.world % grid == 0 else 1

    # ------------------------------------------------------------------ rules

    def problems(self) -> list[LayoutProblem]:
        """The dense grid's problems: the world must split into ``tp * cp * pp`` blocks (data parallel =
        world / (tp * cp * pp)).  The expert grid's are :meth:`expert_problems` (they apply to MoE models only);
        the rules context parallelism puts on the model (sequence length, family, attention) are
        :func:`workbench.config.validate`'s."""
        out = []
        mp = self.model_parallel
        if self.world % mp:
            mp_text = f"tp*pp = {mp}" if self.cp == 1 else f"tp*cp*pp = {mp}"
            reads = ("parallel.nnodes", "parallel.nproc_per_node", "parallel.tensor_parallel", "parallel.pipeline_parallel")
            out.append(LayoutProblem("parallel.nproc_per_node", f"world size {self.world} (nnodes*nproc_per_node) is not divisible "
                                     f"by {mp_text}", f"use a world size that is a multiple of {mp}",
                                     reads + (("parallel.context_parallel",) if self.cp != 1 else ())))
        return out

    def expert_problems(self) -> list[LayoutProblem]:
        """The expert grid's problems (MoE models): the world must split into ``etp * ep * pp`` blocks."""
        grid = self.expert_model_parallel
        if not self.world % grid:
            return []
        return [LayoutProblem("parallel.expert_parallel", f"world size {self.world} is not divisible by expert_tensor_parallel x "
                              f"expert_parallel x pipeline_parallel = {self.etp} x {self.ep} x {self.pp} (megatron's expert grid: "
                              f"expert data parallel = world / (ETP x EP x PP))",
                              f"use a world size that is a multiple of {grid}, or a smaller expert_parallel",
                              ("parallel.nnodes", "parallel.nproc_per_node", "parallel.tensor_parallel",
                               "parallel.pipeline_parallel", "parallel.expert_tensor_parallel"))]

    # ------------------------------------------------------------------ ranks

    @cached_property
    def _sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        """(dense sizes by dimension, expert sizes by dimension), each in megatron's order."""
        dense = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        expert = {"etp": self.etp, "ep": self.ep, "edp": self.expert_data_parallel, "pp": self.pp}
        return dense, expert

    @cached_property
    def _whole(self) -> bool:
        return self.divisible and not self.world % self.expert_model_parallel

    def _check(self, rank: int) -> None:
        if not self._whole:
            raise ValueError(f"no rank coordinates: {'; '.join(q.rule for q in self.problems() + self.expert_problems())}")
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the world of {self.world}")

    @staticmethod
    def _digits(rank: int, sizes: dict[str, int]) -> dict[str, int]:
        out = {}
        for name, size in sizes.items():  # megatron's order: the first dimension varies fastest
            rank, out[name] = divmod(rank, size)
        return out

    def coords(self, rank: int) -> Coords:
        """Global ``rank``'s rank in each process group, as megatron-core assigns them (order ``tp-cp-ep-dp-pp``)."""
        self._check(rank)
        rest, tp = divmod(rank, self.tp)  # the first dimension varies fastest
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        rest, etp = divmod(rank, self.etp)
        edp, ep = divmod(rest, self.ep)
        return Coords(tp=tp, cp=cp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp % self.expert_data_parallel)

    def rank_label(self, rank: int, short: bool = False) -> str:
        """Where global ``rank`` sits, for per-rank views: ``dp0 cp1 tp0 pp0`` (``short``: ``d0 c1 t0 p0``), from
        :meth:`coords`; the CP coordinate only where ``cp`` > 1 (``dp0 tp1 pp0``).  A world that does not split into
        whole replicas has no coordinates: ``rank N``."""
        try:
            c = self.coords(rank)
        except ValueError:
            return f"rank {rank}"
        dims = [("dp", "d", c.dp)] + ([("cp", "c", c.cp)] if self.cp > 1 else []) + [("tp", "t", c.tp), ("pp", "p", c.pp)]
        return " ".join(f"{s if short else name}{v}" for name, s, v in dims)

    def ranks_of(self, dims: str, rank: int) -> tuple[int, ...]:
        """The global ranks of ``rank``'s process group over ``dims``, in megatron's order: one dimension (``"tp"``,
        ``"cp"``, ``"dp"``, ``"pp"``, or the expert grid's ``"etp"``, ``"ep"``, ``"edp"``) or several joined by
        ``-`` within one grid (``"tp-pp"``: the model-parallel group; ``"etp-ep"``).  The group's own rank of
        ``rank`` is its index here."""
        self._check(rank)
        names = dims.split("-")
        dense, expert = self._sizes
        sizes = expert if any(n in ("etp", "ep", "edp") for n in names) else dense
        unknown = [n for n in names if n not in sizes]
        if unknown:
            raise ValueError(f"unknown dimension(s) {', '.join(unknown)} for this grid: use {', '.join(_DENSE)} "
                             f"or {', '.join(_EXPERT)}")
        digits = self._digits(rank, sizes)
        strides, s = {}, 1
        for name, size in sizes.items():
            strides[name] = s
            s *= size
        base = rank - sum(digits[n] * strides[n] for n in names)
        group = [base]
        for name in sizes:  # the group's first dimension fastest, as megatron's masked rank groups
            if name in names:
                group = [g + i * strides[name] for i in range(sizes[name]) for g in group]
        return tuple(group)

    def as_dict(self) -> dict[str, Any]:
        """The sizes, for records and reports."""
        return {"world": self.world, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "cp": self.cp, "dp": self.dp,
                "ep": self.ep, "etp": self.etp, "edp": self.expert_data_parallel, "nnodes": self.nnodes,
                "nproc_per_node": self.nproc_per_node}
