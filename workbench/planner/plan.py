"""A plan's structure: per stage (:class:`StagePlan`), per rank (:class:`RankPlan`), the suggestions, megatron's
estimate and the whole :class:`Plan`; :data:`COMPONENTS` is the allocated peak's breakdown in stacking order."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from workbench.planner.assumptions import KernelPath, PlannerAssumptions
from workbench.planner.gpus import GPUSpec

__all__ = ["COMPONENTS", "OVERHEADS", "StagePlan", "RankPlan", "Suggestion", "MegatronEstimate", "Plan"]

# Components of the allocated peak, in stacking order (the widget and the table use it).
COMPONENTS = (
    "weights",
    "gradients",
    "master_weights",
    "optimizer_moments",
    "activations",
    "logits_loss",
    "pipeline_buffers",
    "workspace",
)
# What max_memory_allocated cannot see, but the device must still hold.
OVERHEADS = ("cuda_context", "nccl", "reserved_over_allocated")


@dataclass
class StagePlan:
    """One pipeline stage (all its TP x DP ranks hold the same bytes)."""

    pp_rank: int
    layers: int
    params: int  # parameters on one TP rank of this stage
    inflight_microbatches: float  # stage-equivalent micro-batches of activations held at peak
    components: dict[str, int]  # at the peak moment; sums to peak_allocated
    peak_allocated: int
    peak_phase: Literal["forward_backward", "optimizer_step", "cuda_graph_warmup"]
    phases: dict[str, int]  # allocated peak of each phase
    overheads: dict[str, int]
    total: int  # peak_reserved + CUDA context + NCCL: what the device must hold
    detail: dict[str, Any]
    peak_reserved: int = 0  # torch.cuda.max_memory_reserved: the allocator's segments (graph pool included)
    reserved_terms: dict[str, int] = field(default_factory=dict)  # peak_reserved - peak_allocated, by cause


@dataclass
class RankPlan:
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    peak_allocated: int
    total: int
    fits: bool | None  # None when no GPU was chosen
    peak_reserved: int = 0


@dataclass
class Suggestion:
    """A change that lowers the worst rank's memory; ``fits`` says whether it is enough alone."""

    text: str
    overrides: dict[str, Any]
    worst_total: int
    fits: bool | None


@dataclass
class MegatronEstimate:
    """Megatron-LM's ``theoretical_memory_usage`` numbers (bytes; it models the first stage only)."""

    weight_and_optimizer: int
    activation: int
    total: int
    formula: str  # which activation formula megatron picks for this config


@dataclass
class Plan:
    config_name: str
    gpu: GPUSpec | None
    kernel_path: KernelPath
    stages: list[StagePlan]
    ranks: list[RankPlan]
    largest_micro_batch: int | None  # None when no GPU was chosen; 0 = not even 1 fits
    suggestions: list[Suggestion]
    megatron: MegatronEstimate
    assumptions: PlannerAssumptions
    layout: dict[str, Any]  # tp, pp, dp, vpp, micro-batch, micro-batches; device and recompute (str)

    @property
    def fits(self) -> bool | None:
        if self.gpu is None:
            return None
        return all(r.fits for r in self.ranks)

    @property
    def decides(self) -> str:
        """Which peak decides whether the run fits: the reserved one (the allocator's segments,
        CUDA-graph pool included, plus context and NCCL must fit the device); allocated is
        what ``max_memory_allocated`` reports and can be far lower with CUDA graphs."""
        return "peak_reserved"

    @property
    def worst(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total)

    def stage_of(self, rank: int) -> StagePlan:
        return self.stages[self.ranks[rank].pp_rank]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        d["decides"] = self.decides
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)
