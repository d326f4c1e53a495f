"""Memory planner: per-rank peak GPU memory of a training layout, before anything launches.

Why: an OOM after a multi-minute start-up (or after the first optimizer step, when Adam's moments appear) is the most
expensive way to learn that a layout does not fit.  :func:`predict` plans every rank (its tp, pp, dp, cp
coordinates): the peak of ``torch.cuda.max_memory_allocated`` during training, the device memory that peak really
needs, and a breakdown by component.  Pure arithmetic (no torch, no megatron import): well under 50 ms a plan.

One module per concern:

- :mod:`~workbench.planner.stage`: the memory model of one pipeline stage, term by term (what is modelled and how
  it was validated is that module's docstring);
- :mod:`~workbench.planner.predict`: the plan of a config: ranks, fits, largest micro-batch, suggestions;
- :mod:`~workbench.planner.gpus`, :mod:`~workbench.planner.assumptions`, :mod:`~workbench.planner.plan`: the GPU
  catalogue, what the planner cannot read from a config (and the kernel path), the plan's structure;
- :mod:`~workbench.planner.megatron`: megatron's own formula, for comparison; :mod:`~workbench.planner.measured`:
  a run's measured peaks beside a plan; :mod:`~workbench.planner.evidence`: the committed GPU measurements
  re-planned; :mod:`~workbench.planner.text` and :mod:`~workbench.planner.cli`: the table and ``workbench plan``.
"""

from __future__ import annotations

from workbench.planner.assumptions import KernelPath, PlannerAssumptions, kernel_path
from workbench.planner.cli import add_cli, format_plan
from workbench.planner.gpus import GPUS, GPUSpec, GiB, MiB, gpu_spec
from workbench.planner.measured import compare, measured_peaks, measured_reserved
from workbench.planner.megatron import megatron_theoretical_memory
from workbench.planner.plan import COMPONENTS, OVERHEADS, MegatronEstimate, Plan, RankPlan, StagePlan, Suggestion
from workbench.planner.predict import largest_micro_batch, predict
from workbench.planner.stage import ring_buffers, ring_flash

__all__ = ["GiB", "MiB", "GPUSpec", "GPUS", "gpu_spec", "PlannerAssumptions", "KernelPath", "kernel_path",
           "COMPONENTS", "OVERHEADS", "StagePlan", "RankPlan", "Suggestion", "MegatronEstimate", "Plan", "predict",
           "megatron_theoretical_memory", "largest_micro_batch", "compare", "measured_peaks", "measured_reserved",
           "format_plan", "add_cli", "ring_buffers", "ring_flash"]
