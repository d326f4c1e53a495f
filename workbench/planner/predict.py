"""The plan of a config: every rank's stage plan, whether it fits a GPU, the largest micro-batch that does, and
the changes that would make it fit (:func:`predict`)."""

from __future__ import annotations

from typing import Any, Iterable

from workbench.config import ConfigError, RunConfig, derive
from workbench.layout import Layout
from workbench.planner.assumptions import PlannerAssumptions, kernel_path
from workbench.planner.gpus import GPUSpec, gpu_spec
from workbench.planner.megatron import megatron_theoretical_memory
from workbench.planner.plan import Plan, RankPlan, Suggestion
from workbench.planner.stage import stages_of

__all__ = ["predict", "largest_micro_batch"]


def _rank_coords(tp: int, pp: int, dp: int, cp: int = 1) -> Iterable[tuple[int, int, int, int]]:
    """(global rank, tp, pp, dp) of a tp x cp x pp x dp world, in megatron-core's order
    (:meth:`workbench.layout.Layout.coords`); the CP ranks of a stage share its plan."""
    lay = Layout(world=tp * pp * dp * cp, tp=tp, pp=pp, cp=cp)
    for g in range(lay.world):
        c = lay.coords(g)
        yield g, c.tp, c.pp, c.dp


def _fits(total: int, gpu: GPUSpec | None) -> bool | None:
    return None if gpu is None else total <= gpu.capacity_bytes


def largest_micro_batch(cfg: RunConfig, gpu: str | int | GPUSpec, assumptions: PlannerAssumptions | None = None,
                        limit: int = 4096) -> int:
    """Largest micro-batch size whose every rank fits (same number of micro-batches per step); 0 if none."""
    spec = gpu_spec(gpu)
    a = assumptions or PlannerAssumptions()
    kp = kernel_path(cfg, a)
    d = derive(cfg)

    def ok(mbs: int) -> bool:
        return all(st.total <= spec.capacity_bytes for st in stages_of(cfg, kp, a, mbs, d))

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # memory grows with the micro-batch: bisect between the last fit and the first miss
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _suggestions(cfg: RunConfig, gpu: GPUSpec, a: PlannerAssumptions, worst: int) -> list[Suggestion]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    d = derive(cfg)
    cands: list[tuple[str, dict[str, Any]]] = []
    if p.tensor_parallel > 1 and not p.sequence_parallel and m.seq_length % p.tensor_parallel == 0:
        cands.append(("enable sequence parallelism (SP)", {"parallel.sequence_parallel": True}))
    if p.recompute == "none":
        # speed costs measured on the compiled layer (bench/README.md: GPT-2 medium, H200)
        cands.append(("selective recompute (MLP; ~7% slower)", {"parallel.recompute": "selective"}))
    if p.recompute != "full":
        cands.append(("full recompute (1 layer per block; ~20% slower)", {"parallel.recompute": "full", "parallel.recompute_num_layers": 1}))
    if d.data_parallel > 1 and not p.distributed_optimizer:
        cands.append(("distributed optimizer (shard master weights + Adam over DP)", {"parallel.distributed_optimizer": True}))
    if p.device == "cuda" and p.optimizer_cpu_offload < 1:  # the validator refuses it without the distributed optimizer
        ov: dict[str, Any] = {"parallel.optimizer_cpu_offload": 1.0, "parallel.distributed_optimizer": True}
        cands.append(("optimizer CPU offload (master weights + Adam in host memory, stepped by the CPU; slower steps)", ov))
    if t.precision == "bf16" and t.grad_reduce_in_fp32:
        cands.append(("reduce gradients in bf16 (grad_reduce_in_fp32: false)", {"train.grad_reduce_in_fp32": False}))
    for tp in (2, 4, 8):
        if tp > p.tensor_parallel and m.num_attention_heads % tp == 0 and m.query_groups % tp == 0 and m.ffn_size % tp == 0:
            cands.append((f"raise tp to {tp} (world {tp * p.pipeline_parallel * d.data_parallel})",
                          {"parallel.tensor_parallel": tp, "parallel.nproc_per_node": p.nproc_per_node * tp // p.tensor_parallel}))
            break
    if p.pipeline_parallel > 1 and p.pipeline_split == "balanced":
        # the balanced split loads stage 0 (which also holds the most micro-batches in flight)
        cands.append(("split layers evenly over the stages (pipeline_split: even; slower 1F1B)", {"parallel.pipeline_split": "even"}))
    for pp in (2, 4, 8, 16):
        if pp > p.pipeline_parallel and m.num_layers % pp == 0:
            cands.append((f"raise pp to {pp} (world {p.tensor_parallel * pp * d.data_parallel})",
                          {"parallel.pipeline_parallel": pp, "parallel.nproc_per_node": p.nproc_per_node * pp // p.pipeline_parallel,
                           "parallel.virtual_pipeline_parallel": None}))
            break
    out: list[Suggestion] = []
    for text, ov in cands:
        try:
            alt = cfg.replace(**ov)
            if alt.validate():
                continue
            stages = stages_of(alt, kernel_path(alt, a), a)
        except (ConfigError, ValueError):
            continue
        w = max(st.total for st in stages)
        if w < worst:
            out.append(Suggestion(text, ov, w, w <= gpu.capacity_bytes))
    # the largest smaller micro-batch that fits and keeps the global batch (more micro-batches per step)
    per_dp = t.global_batch_size // d.data_parallel
    for mbs in range(t.micro_batch_size - 1, 0, -1):
        if per_dp % mbs:
            continue
        alt = cfg.replace(**{"train.micro_batch_size": mbs})
        if alt.validate():
            continue
        w = max(st.total for st in stages_of(alt, kernel_path(alt, a), a))
        if w <= gpu.capacity_bytes:
            out.append(Suggestion(f"lower micro_batch_size to {mbs} ({per_dp // mbs} micro-batches per step, same global batch)",
                                  {"train.micro_batch_size": mbs}, w, True))
            break
    out.sort(key=lambda sg: (not sg.fits, sg.worst_total))
    return out


def predict(cfg: RunConfig, gpu: str | int | GPUSpec | None = None, assumptions: PlannerAssumptions | None = None,
            suggest: bool = True) -> Plan:
    """Per-rank memory plan of a (valid) config; with a GPU: fits, largest micro-batch, suggestions."""
    problems = cfg.validate()
    if problems:
        raise ConfigError(problems)
    spec = gpu_spec(gpu)
    a = assumptions or PlannerAssumptions()
    kp = kernel_path(cfg, a)
    stages = stages_of(cfg, kp, a)
    d = derive(cfg)
    p = cfg.parallel
    ranks = [
        RankPlan(rank=g, tp_rank=tr, pp_rank=pr, dp_rank=dr, peak_allocated=stages[pr].peak_allocated,
                 total=stages[pr].total, fits=_fits(stages[pr].total, spec), peak_reserved=stages[pr].peak_reserved)
        for g, tr, pr, dr in _rank_coords(p.tensor_parallel, p.pipeline_parallel, d.data_parallel,
                                          max(int(getattr(p, "context_parallel", 1) or 1), 1))
    ]
    ranks.sort(key=lambda r: r.rank)
    largest = largest_micro_batch(cfg, spec, a) if spec is not None else None
    worst = max(st.total for st in stages)
    sugg = _suggestions(cfg, spec, a, worst) if (suggest and spec is not None and worst > spec.capacity_bytes) else []
    return Plan(
        config_name=cfg.name, gpu=spec, kernel_path=kp, stages=stages, ranks=ranks, largest_micro_batch=largest,
        suggestions=sugg, megatron=megatron_theoretical_memory(cfg), assumptions=a,
        layout={"world_size": d.world_size, "tp": p.tensor_parallel, "pp": p.pipeline_parallel, "dp": d.data_parallel,
                "cp": max(int(getattr(p, "context_parallel", 1) or 1), 1),
                "vpp": p.vpp, "micro_batch_size": cfg.train.micro_batch_size, "num_microbatches": d.num_microbatches,
                "device": p.device, "recompute": p.recompute, "nnodes": p.nnodes},
    )
