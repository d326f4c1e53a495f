"""Every valid parallel layout of one model, global batch and sequence on a number of GPUs.

A :class:`Layout` is one choice of tensor (TP), pipeline (PP), virtual pipeline (VPP) and data (DP)
parallel sizes, sequence parallelism (SP), the distributed optimizer, the recompute mode, the
micro-batch size and the FP8 recipe.  :func:`enumerate_layouts` walks a grid wide enough to hold
every layout the config validator accepts and keeps exactly those it accepts
(:func:`workbench.config.validate`, which asks the model family what it supports and the kernel rule
which FP8 recipes run): validity is the validator's, never restated here.

Two choices are fixed rather than enumerated, because they change no memory and only help:
``overlap_grad_reduce`` is on where DP > 1 and ``overlap_param_gather`` where the distributed
optimizer shards over DP > 1.  Two equivalences keep the list short (:func:`canonical`): the
distributed optimizer at DP = 1 shards over one rank (the same state as without it), and is listed
once, without; tensor parallelism stays inside one node (its collectives run every layer; across
nodes it is valid but never pays, as Megatron's own guidance says).

Torch-free; each candidate config is built with :func:`dataclasses.replace` (no re-parsing), so a
few thousand candidates take about half a second (most of it the validator).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

from workbench.config import RunConfig, validate
from workbench.kernel_rule import FP8_RECIPES
from workbench.layout import Layout as ParallelLayout

__all__ = ["Layout", "layout_of", "apply_layout", "canonical", "grid", "enumerate_layouts", "RECOMPUTE_MODES", "fp8_recipes"]

RECOMPUTE_MODES = ("none", "selective", "full")


def fp8_recipes() -> tuple[str, ...]:
    """``train.fp8`` values to try: off and every recipe some FP8 implementation has (the validator keeps those
    the kernel rule runs for a layout)."""
    return ("off", *dict.fromkeys(r for impl in FP8_RECIPES.values() for r in impl))


@dataclass(frozen=True, order=True)
class Layout:
    """One layout: the fields of ``parallel`` and ``train`` that the advisor chooses."""

    tp: int
    pp: int
    vpp: int
    dp: int
    sp: bool
    distributed_optimizer: bool
    recompute: str
    micro_batch_size: int
    fp8: str = "off"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        """Short human name, e.g. ``tp2 pp2 vpp2 dp2 sp dopt sel mbs4 fp8:tensorwise``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        parts.append(f"dp{self.dp}")
        if self.sp:
            parts.append("sp")
        if self.distributed_optimizer:
            parts.append("dopt")
        if self.recompute != "none":
            parts.append({"selective": "sel", "full": "full"}[self.recompute])
        parts.append(f"mbs{self.micro_batch_size}")
        if self.fp8 != "off":
            parts.append(f"fp8:{self.fp8}")
        return " ".join(parts)

    def overrides(self, gpus_per_node: int, nodes: int = 1) -> dict[str, Any]:
        """Dotted config overrides that set this layout (``RunConfig.replace`` / the config form take them)."""
        dp_overlap = self.dp > 1
        return {
            "parallel.tensor_parallel": self.tp,
            "parallel.pipeline_parallel": self.pp,
            "parallel.virtual_pipeline_parallel": self.vpp if self.vpp > 1 else None,
            "parallel.sequence_parallel": self.sp,
            "parallel.distributed_optimizer": self.distributed_optimizer,
            "parallel.recompute": self.recompute,
            "parallel.nnodes": nodes,
            "parallel.nproc_per_node": gpus_per_node,
            "parallel.device": "cuda",
            "parallel.overlap_grad_reduce": dp_overlap,
            "parallel.overlap_param_gather": dp_overlap and self.distributed_optimizer,
            "train.micro_batch_size": self.micro_batch_size,
            "train.fp8": self.fp8,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def layout_of(cfg: RunConfig) -> Layout:
    """The layout a config already has."""
    p, t = cfg.parallel, cfg.train
    dp = ParallelLayout.of(cfg).dp
    return Layout(p.tensor_parallel, p.pipeline_parallel, p.vpp, dp, bool(p.sequence_parallel),
                  bool(p.distributed_optimizer), p.recompute, t.micro_batch_size, t.fp8)


def apply_layout(cfg: RunConfig, layout: Layout, gpus_per_node: int, nodes: int = 1) -> RunConfig:
    """``cfg`` with ``layout`` set (``RunConfig.replace``'s meaning, built without re-parsing).  The candidates have no
    context parallelism (the advisor does not enumerate it yet): a base config's ``context_parallel`` is set to 1."""
    p = dataclasses.replace(
        cfg.parallel, tensor_parallel=layout.tp, pipeline_parallel=layout.pp, context_parallel=1,
        virtual_pipeline_parallel=layout.vpp if layout.vpp > 1 else None, sequence_parallel=layout.sp,
        distributed_optimizer=layout.distributed_optimizer, recompute=layout.recompute, nnodes=nodes,
        nproc_per_node=gpus_per_node, device="cuda", overlap_grad_reduce=layout.dp > 1,
        overlap_param_gather=layout.dp > 1 and layout.distributed_optimizer)
    t = dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch_size, fp8=layout.fp8)
    return dataclasses.replace(cfg, parallel=p, train=t)


def canonical(layout: Layout) -> Layout:
    """The listed form of an equivalent layout: the distributed optimizer over DP = 1 is listed without it."""
    if layout.dp == 1 and layout.distributed_optimizer:
        return dataclasses.replace(layout, distributed_optimizer=False)
    return layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grid(cfg: RunConfig, gpus: int, nodes: int = 1, fp8: bool = True) -> Iterator[Layout]:
    """Candidate layouts (a superset of the valid ones, in canonical form): TP divides the GPUs of a node,
    PP the rest, VPP up to the layers per stage, every micro-batch size dividing the global batch per DP rank."""
    per_node = gpus // nodes
    layers = cfg.model.num_layers
    gbs = cfg.train.global_batch_size
    for tp in _divisors(per_node):
        for pp in _divisors(gpus // tp):
            if pp > layers:
                continue
            dp = ParallelLayout(world=gpus, tp=tp, pp=pp).dp
            if gbs % dp:
                continue
            # interleaving needs pp * vpp to divide the layers (the validator's rule, here only to bound the grid)
            vpps = [1] + ([v for v in _divisors(layers // pp) if v > 1] if pp > 1 and layers % pp == 0 else [])
            for vpp in vpps:
                for sp in ((False, True) if tp > 1 else (False,)):
                    for dopt in ((False, True) if dp > 1 else (False,)):
                        for rc in RECOMPUTE_MODES:
                            for mbs in _divisors(gbs // dp):
                                for recipe in (fp8_recipes() if fp8 else ("off",)):
                                    yield Layout(tp, pp, vpp, dp, sp, dopt, rc, mbs, recipe)


def enumerate_layouts(cfg: RunConfig, gpus: int, nodes: int = 1, fp8: bool = True) -> list[tuple[Layout, RunConfig]]:
    """Every valid layout of ``cfg``'s model, global batch and sequence on ``gpus`` GPUs over ``nodes`` nodes,
    with its config: those of :func:`grid` the config validator accepts (``fp8=False``: bf16 / the config's precision only)."""
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ValueError(f"--gpus {gpus} over --nodes {nodes}: the GPUs must split evenly over the nodes")
    per_node = gpus // nodes
    out = []
    for layout in grid(cfg, gpus, nodes, fp8):
        c = apply_layout(cfg, layout, per_node, nodes)
        if not validate(c):
            out.append((layout, c))
    return out
