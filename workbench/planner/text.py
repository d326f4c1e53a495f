"""A memory plan as text: the table ``workbench plan`` prints (:func:`workbench.planner.format_plan`).

Besides the per-rank table the text explains itself: which GPU the ``fits`` column checks against
(or that none was named), that a CPU run's bytes are host memory, where CUDA graphs put the
activations, and what selective recompute recomputes.  Torch-free and planner-free (it reads a
:class:`workbench.planner.Plan` by its attributes), so the planner imports it, not the reverse.
"""

from __future__ import annotations

from typing import Any, Sequence

GiB = 1024**3

#: the plan's allocated components, shortened for the column heads
SHORT = {"weights": "weights", "gradients": "grads", "master_weights": "master", "optimizer_moments": "adam",
         "activations": "activ", "logits_loss": "logits", "pipeline_buffers": "p2p", "workspace": "work"}

#: the catalogue GPUs a newcomer most likely means (``--gpu``)
GPU_HINT = "H100-80GB|H200-141GB"

#: what ``recompute: selective`` recomputes, by :attr:`KernelChoice.selective`
SELECTIVE_MEANS = {
    "mlp": "the MLP's fc1 output and activation are rebuilt in backward, not kept (the workbench's layers)",
    "core_attn": "core attention is rebuilt in backward, not kept (Transformer Engine's layer, Megatron's meaning)",
}


def _gib(n: float) -> str:
    return f"{n / GiB:7.2f}"


def notes_before(plan: Any) -> list[str]:
    """The lines above the table: what the numbers are measured against."""
    lay = plan.layout
    if lay.get("device") == "cpu":
        out = ["parallel.device cpu: these are host memory (RAM) bytes per rank process; no CUDA context, NCCL or "
               "caching-allocator pool applies (reserv / +ctx / total: what the same layout would need on a GPU)"]
    else:
        out = []
    if plan.gpu is not None:
        out.append(f"checked against GPU {plan.gpu.name}: {plan.gpu.capacity_bytes / GiB:.1f} GiB per rank "
                   "(fits: total <= that)")
    elif lay.get("device") != "cpu":
        out.append(f"no GPU named: pass --gpu {GPU_HINT} to check fit (Python: predict(cfg, gpu=...))")
    return out


def notes_after(plan: Any) -> list[str]:
    """The lines below the table: the reserved terms, CUDA graphs, selective recompute, megatron's formula, fit."""
    lay, kp, worst = plan.layout, plan.kernel_path, plan.worst
    out = []
    if lay.get("device") != "cpu":
        terms = ", ".join(f"{k.replace('_', ' ')} {v / GiB:.2f}" for k, v in worst.reserved_terms.items() if v)
        out.append(f"reserved (decides fits, with CUDA context + NCCL) on stage {worst.pp_rank}: {terms}")
    pool = f"graph pool {worst.reserved_terms.get('cuda_graph_pool', 0) / GiB:.2f} GiB, in reserv"
    if kp.cuda_graphs_impl == "step":
        out.append(f"CUDA graphs (the step as one graph): the allocated peak is the last eager warm-up step and the "
                   f"capture (the whole forward-backward, Adam's moments allocated); replays allocate nothing, and "
                   f"the graph's pool holds the step's working set from then on ({pool})")
    elif worst.reserved_terms.get("cuda_graph_pool"):
        if worst.peak_phase == "cuda_graph_warmup":
            out.append(f"CUDA graphs: the allocated peak is the first step's warm-up (the graphed layers run eagerly, "
                       f"before Adam's moments exist: adam 0); from the second step the graph pool holds the layers' "
                       f"activations ({pool}) and max_memory_allocated shows them as ~0")
        else:
            out.append(f"CUDA graphs: the graph pool holds the graphed layers' activations ({pool}): allocated shows "
                       f"them as ~0, so activ is only what runs outside the graphs")
    if lay.get("recompute") == "selective":
        out.append(f"selective recompute here means: {SELECTIVE_MEANS.get(kp.selective, kp.selective)}")
    host = [plan.stages[r.pp_rank].detail.get("optimizer_host_bytes", 0) for r in plan.ranks]
    if any(host):
        per_node = max(1, len(plan.ranks) // max(1, int(lay.get("nnodes", 1))))
        start = max(st.detail.get("optimizer_host_startup_bytes", 0) for st in plan.stages)
        out.append(f"optimizer CPU offload: host memory (RAM) {max(host) / GiB:.2f} GiB on the fullest rank, up to "
                   f"{max(host) * per_node / GiB:.2f} GiB for a node's {per_node} ranks (fp32 parameter copies, pinned gradient "
                   f"copies and Adam's moments of the offloaded share); {start / GiB:.2f} GiB a rank ({start * per_node / GiB:.2f} "
                   "a node) while the optimizer is built (megatron builds it twice, first over all the rank's parameters); "
                   "a checkpoint's save or load adds 12 bytes a parameter of the rank (the distributed optimizer's "
                   "reshardable state in full)")
    mg = plan.megatron
    out.append(f"megatron theoretical formula ({mg.formula}, first stage only): {mg.total / GiB:.2f} GiB "
               f"(weights+optimizer {mg.weight_and_optimizer / GiB:.2f}, activations {mg.activation / GiB:.2f})")
    if plan.gpu is not None:
        out.append(f"fits: {'yes' if plan.fits else 'NO'}; largest micro-batch that fits: {plan.largest_micro_batch}")
        for sg in plan.suggestions:
            out.append(f"  - {sg.text}: worst rank {sg.worst_total / GiB:.2f} GiB{' (fits)' if sg.fits else ''}")
    return out


def format_plan(plan: Any, components: Sequence[str]) -> str:
    """A per-rank table (GiB) with the breakdown, totals, fits, suggestions and the notes around it."""
    lay, kp = plan.layout, plan.kernel_path
    lines = [f"{plan.config_name}: tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}"
             f"{' (vpp ' + str(lay['vpp']) + ')' if lay['vpp'] > 1 else ''}, micro-batch {lay['micro_batch_size']}"
             f" x {lay['num_microbatches']}; kernels: attention {kp.attention}, layer {kp.layer},"
             f" CE {kp.cross_entropy}, optimizer {kp.optimizer}"]
    lines += notes_before(plan)
    head = ["rank", "tp", "pp", "dp"] + [SHORT[c] for c in components] + ["alloc", "reserv", "+ctx", "total", "fits"]
    lines.append("  ".join(f"{h:>7}" for h in head) + "   (GiB)")
    for r in plan.ranks:
        st = plan.stages[r.pp_rank]
        cells = [f"{r.rank:>7}", f"{r.tp_rank:>7}", f"{r.pp_rank:>7}", f"{r.dp_rank:>7}"]
        cells += [_gib(st.components[c]) for c in components]
        cells += [_gib(r.peak_allocated), _gib(r.peak_reserved), _gib(r.total - r.peak_reserved), _gib(r.total),
                  f"{'-' if r.fits is None else ('yes' if r.fits else 'OOM'):>7}"]
        lines.append("  ".join(cells))
    lines += notes_after(plan)
    return "\n".join(lines)
