"""Every valid parallel layout of one model, global batch and sequence on a number of GPUs.

A :class:`Layout` is one choice of tensor (TP), pipeline (PP), virtual pipeline (VPP), context (CP) and data (DP)
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
nodes it is valid but never pays, as Megatron's own guidance says), and so does context parallelism (TP x CP
ranks of one node: the ring's K/V blocks travel every layer, and its cost model times them on the node's link).

Context parallelism is enumerated where the config allows it: :func:`cp_sizes` asks
:func:`workbench.config_cp.context_parallel_problems` (the validator's own CP rules: the family's
``Supports.context_parallel``, the sequence divisible by 2*CP [*TP under SP], ...) and
:func:`cp_refusal` says why a config gets none.  DP counts over the world left after TP x CP x PP; the
distributed optimizer and the gradient reduce span DP x CP (megatron's ``intra_dp_cp_group``), so both are
choices wherever DP x CP > 1.

Torch-free; each candidate config is built with :func:`dataclasses.replace` (no re-parsing), so a
few thousand candidates take about half a second (most of it the validator).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

from workbench.config import RunConfig, validate
from workbench.config_cp import context_parallel_problems
from workbench.families import family_of
from workbench.kernel_rule import FP8_RECIPES
from workbench.layout import Layout as ParallelLayout

__all__ = ["Layout", "layout_of", "apply_layout", "canonical", "grid", "enumerate_layouts", "RECOMPUTE_MODES", "fp8_recipes",
           "cp_sizes", "cp_refusal"]

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
    #: context-parallel size (each sequence split over this many ranks; 1: none)
    cp: int = 1
    #: ``parallel.optimizer_cpu_offload``: the share of the distributed optimizer's state in host memory (0: none).
    #: Not enumerated: :func:`workbench.advisor.advise` tries 1.0 (with the distributed optimizer) for each evaluated
    #: layout that does not fit.
    offload: float = 0.0

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def label(self) -> str:
        """Short human name, e.g. ``tp2 pp2 vpp2 cp2 dp2 sp dopt sel mbs4 fp8:tensorwise`` (``cp`` only above 1)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
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
        if self.offload:
            parts.append("offload" if self.offload == 1 else f"offload{self.offload:g}")
        return " ".join(parts)

    def overrides(self, gpus_per_node: int, nodes: int = 1) -> dict[str, Any]:
        """Dotted config overrides that set this layout (``RunConfig.replace`` / the config form take them)."""
        dp_overlap = self.dp * self.cp > 1  # the gradient reduce spans DP x CP
        return {
            "parallel.tensor_parallel": self.tp,
            "parallel.pipeline_parallel": self.pp,
            "parallel.context_parallel": self.cp,
            "parallel.virtual_pipeline_parallel": self.vpp if self.vpp > 1 else None,
            "parallel.sequence_parallel": self.sp,
            "parallel.distributed_optimizer": self.distributed_optimizer,
            "parallel.recompute": self.recompute,
            "parallel.nnodes": nodes,
            "parallel.nproc_per_node": gpus_per_node,
            "parallel.device": "cuda",
            "parallel.overlap_grad_reduce": dp_overlap,
            "parallel.overlap_param_gather": dp_overlap and self.distributed_optimizer,
            "parallel.optimizer_cpu_offload": self.offload,
            "train.micro_batch_size": self.micro_batch_size,
            "train.fp8": self.fp8,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def layout_of(cfg: RunConfig) -> Layout:
    """The layout a config already has."""
    p, t = cfg.parallel, cfg.train
    lay = ParallelLayout.of(cfg)
    return Layout(p.tensor_parallel, p.pipeline_parallel, p.vpp, lay.dp, bool(p.sequence_parallel),
                  bool(p.distributed_optimizer), p.recompute, t.micro_batch_size, t.fp8, lay.cp, float(p.optimizer_cpu_offload))


def apply_layout(cfg: RunConfig, layout: Layout, gpus_per_node: int, nodes: int = 1) -> RunConfig:
    """``cfg`` with ``layout`` set (``RunConfig.replace``'s meaning, built without re-parsing), its context parallelism
    included (a base config's ``context_parallel`` is replaced by the layout's)."""
    grads = layout.dp * layout.cp > 1  # the gradient reduce (and the distributed optimizer's shards) span DP x CP
    p = dataclasses.replace(
        cfg.parallel, tensor_parallel=layout.tp, pipeline_parallel=layout.pp, context_parallel=layout.cp,
        virtual_pipeline_parallel=layout.vpp if layout.vpp > 1 else None, sequence_parallel=layout.sp,
        distributed_optimizer=layout.distributed_optimizer, recompute=layout.recompute, nnodes=nodes,
        nproc_per_node=gpus_per_node, device="cuda", overlap_grad_reduce=grads,
        overlap_param_gather=grads and layout.distributed_optimizer, optimizer_cpu_offload=layout.offload)
    t = dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch_size, fp8=layout.fp8)
    return dataclasses.replace(cfg, parallel=p, train=t)


def canonical(layout: Layout) -> Layout:
    """The listed form of an equivalent layout: the distributed optimizer over DP x CP = 1 is listed without it."""
    if layout.dp * layout.cp == 1 and layout.distributed_optimizer:
        return dataclasses.replace(layout, distributed_optimizer=False)
    return layout


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _cp_problems(cfg: RunConfig, gpus: int, tp: int, cp: int, sp: bool) -> list:
    """The validator's context-parallel rules (:func:`workbench.config_cp.context_parallel_problems`) for ``cfg`` at
    TP ``tp``, CP ``cp`` and SP ``sp`` on ``gpus`` GPUs (none at cp = 1)."""
    p = dataclasses.replace(cfg.parallel, tensor_parallel=tp, context_parallel=cp, sequence_parallel=sp)
    c = dataclasses.replace(cfg, parallel=p)
    return context_parallel_problems(c, ParallelLayout(world=gpus, tp=tp, cp=cp), family_of(cfg).supports)


def cp_sizes(cfg: RunConfig, gpus: int, nodes: int = 1, tp: int = 1, sp: bool = False) -> list[int]:
    """The context-parallel sizes to try at TP ``tp`` (and SP ``sp``): 1, and every CP > 1 with TP x CP dividing a
    node's GPUs that the config's CP rules accept."""
    per_node = gpus // nodes
    return [1] + [cp for cp in _divisors(per_node // tp) if cp > 1 and not _cp_problems(cfg, gpus, tp, cp, sp)]


def cp_refusal(cfg: RunConfig, gpus: int, nodes: int = 1) -> str | None:
    """Why no context-parallel layout is listed for ``cfg`` on ``gpus`` GPUs (None when some is): the config's CP
    rules at CP = 2 (the family, the sequence, ... each with its field), or a node of one GPU."""
    if gpus // nodes < 2:
        return "one GPU per node: the ring stays inside a node"
    if any(len(cp_sizes(cfg, gpus, nodes, tp, sp)) > 1 for tp in _divisors(gpus // nodes) for sp in {False, tp > 1}):
        return None
    return "; ".join(f"{q.field}: {q.rule}" for q in _cp_problems(cfg, gpus, 1, 2, False)) or \
        "no CP size that a node's GPUs and the sequence both divide"


def grid(cfg: RunConfig, gpus: int, nodes: int = 1, fp8: bool = True) -> Iterator[Layout]:
    """Candidate layouts (a superset of the valid ones, in canonical form): TP divides the GPUs of a node, CP (where
    the config's CP rules allow it, :func:`cp_sizes`) the rest of the node, PP the rest, VPP up to the layers per
    stage, every micro-batch size dividing the global batch per DP rank."""
    for tp in _divisors(gpus // nodes):
        for sp in ((False, True) if tp > 1 else (False,)):
            for cp in cp_sizes(cfg, gpus, nodes, tp, sp):
                yield from _grid_at(cfg, gpus, tp, cp, sp, fp8)


def _grid_at(cfg: RunConfig, gpus: int, tp: int, cp: int, sp: bool, fp8: bool) -> Iterator[Layout]:
    """:func:`grid`'s candidates at one TP, CP and SP."""
    layers = cfg.model.num_layers
    gbs = cfg.train.global_batch_size
    for pp in _divisors(gpus // (tp * cp)):
        if pp > layers:
            continue
        dp = ParallelLayout(world=gpus, tp=tp, pp=pp, cp=cp).dp
        if gbs % dp:
            continue
        # interleaving needs pp * vpp to divide the layers (the validator's rule, here only to bound the grid)
        vpps = [1] + ([v for v in _divisors(layers // pp) if v > 1] if pp > 1 and layers % pp == 0 else [])
        for vpp in vpps:
            for dopt in ((False, True) if dp * cp > 1 else (False,)):
                for rc in RECOMPUTE_MODES:
                    for mbs in _divisors(gbs // dp):
                        for recipe in (fp8_recipes() if fp8 else ("off",)):
                            yield Layout(tp, pp, vpp, dp, sp, dopt, rc, mbs, recipe, cp)


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
