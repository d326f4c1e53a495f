"""Memory planner: per-rank peak GPU memory of a training layout, before anything launches.

Why: an OOM after a multi-minute start-up (or after the first optimizer step, when Adam's
moments appear) is the most expensive way to learn that a layout does not fit.  This module
predicts, for every rank (tp, pp, dp coordinates), the peak of ``torch.cuda.max_memory_allocated``
during training and the device memory that peak really needs, with a breakdown by component.

What is modelled (bytes on one rank; ``t`` = tensor parallel, ``s`` = sequence length,
``b`` = micro-batch size, ``h`` = hidden, ``e`` = bytes per activation element):

* **Static state** -- model weights (``P`` parameters of this rank's stage, TP-sharded; norms,
  row-parallel biases and learned positions replicated), mcore DDP's gradient buffer
  (fp32 when ``train.grad_reduce_in_fp32``), the mixed-precision optimizer's fp32 master
  weights and Adam's two fp32 moments -- both sharded ``1/dp`` with the distributed
  optimizer.  Embeddings live on the first stage, the output layer on the last; with tied
  embeddings and ``pp > 1`` the last stage holds its own copy of the word embeddings.
  Vocab padding (``derive().padded_vocab_size``) is part of both.
* **Activations** of one micro-batch per layer, term by term for the kernels the backend
  actually runs (see :class:`KernelPath`): Korthikanti et al. 2022 (Table 2) is the
  starting point -- ``sbh (34 + 5 a s / h)`` unparallelised -- refined to what autograd
  keeps alive in megatron-core 0.19: with SDPA / flash attention there is no ``s^2`` term
  (only the fp32 log-sum-exp), with ``attention_backend: local`` the fp32 softmax and its
  bf16 copy are kept (``6 a s^2 b / t``); sequence parallelism divides the norm / dropout /
  linear-input terms by ``t``; selective recompute drops what the workbench recomputes
  (the MLP's fc1 output and activation: checkpointed inside the compiled dense layer, or
  ``workbench.backend.model.RecomputedMLP`` on the stock layer; core attention with
  Transformer Engine);
  full recompute keeps one ``sbh`` input per checkpointed block plus one block's
  activations while it is recomputed.
* **Micro-batches in flight** per stage from :mod:`workbench.schedules` (1F1B:
  ``min(pp - rank, m)``; interleaved: warm-up chunk passes + 1).
* **Logits and loss** on the last stage: ``[s, b, V/t]`` logits plus megatron's fp32
  up-cast softmax kept for backward (the compiled TP=1 cross entropy keeps only the bf16
  logits), and the output layer's weight-gradient transient.
* **Pipeline buffers**: received activation/gradient tensors, and un-freed stage outputs when
  ``deallocate_pipeline_outputs`` is off.
* **FP8** (``train.fp8`` on the compiled layer): the training precision's terms plus the step's FP8
  weight copies (2 bytes per layer parameter, ``detail["fp8_weight_copies"]``, in ``weights``); the
  activations' FP8 copies are transient (Llama-1B, H100: the same allocated peak to 0.01 GiB without
  the weight copies; reserved 3 GiB lower, not modelled: the plan errs high).  TE's FP8 the same (H100, TE's
  layer: Llama-1B +1.81 GiB, GPT-2 medium +0.61 GiB over bf16, i.e. 2.0 / 2.2 bytes per layer parameter).
* **Transients**: one layer's backward working set, the optimizer step (torch's foreach
  AdamW materialises ``sqrt(v)``; fused Adam does not), cuBLAS workspaces, megatron's
  global gather buffer under sequence parallelism.

The allocated peak is the largest of the forward/backward peak, the optimizer-step peak and,
with CUDA graphs, the first step's warm-up (the graphed layers run eagerly once, allocating,
before Adam's moments exist; later steps replay them in the cudagraph trees' private pool,
which is reserved but not allocated).  The **reserved** peak (``max_memory_reserved``) is what
decides whether a run fits, with the CUDA context and NCCL buffers that neither counter sees
(:class:`PlannerAssumptions`): the default pool's allocated peak in 2 MiB segments, the blocks
Adam's moments strand when the first optimizer step carves them out of a larger freed buffer,
and the CUDA-graph pool (:func:`_reserved_terms`).  ``evidence/planner_1gpu.jsonl`` (16
GPT / Llama layouts), ``evidence/planner_1gpu_families.jsonl`` (6 BERT / T5 layouts) and
``evidence/planner_1gpu_compiled_layer.jsonl`` (BERT, T5 and Llama-1B on the compiled layer), measured on
an H100, hold both to 5% in ``tests/planner/test_planner_1gpu_evidence.py`` (table:
:func:`workbench.planner_evidence.evidence_table`).

Pure arithmetic (no torch, no megatron import): ``predict`` takes well under 50 ms.

Validation.  ``tests/planner/test_planner_cpu_measure.py`` checks the per-layer terms against the
tensors the real megatron-core model keeps (CPU allocation tracker, 7 variants, < 3%);
``tests/planner/test_planner_cpu_step.py`` runs whole training steps of the backend on 2 CPU ranks
(PP, VPP, TP, SP, recompute, distributed optimizer, local attention) and compares every
rank's state and step peak (within 0.5% / 3.2% when written).  ``tests/gpu_proofs/planner_measure.py``
measures GPU peaks per rank; ``tests/planner/test_planner_gpu_evidence.py`` holds the planner to 10% of
them.  CUDA-only terms (cuBLAS workspace, flash-attention backward buffers, Inductor's choices
for the compiled layer) are calibrated only by that GPU evidence.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from workbench import kernel_rule, planner_text, schedules
from workbench.config import ConfigError, Derived, Problem, RunConfig, derive, load_config
from workbench.kernel_rule import KernelChoice
from workbench.layout import Layout
from workbench.families import family_of
from workbench.run.reader import RunReader, as_reader

__all__ = ["GiB", "MiB", "GPUSpec", "GPUS", "gpu_spec", "PlannerAssumptions", "KernelPath", "kernel_path",
           "StagePlan", "RankPlan", "Suggestion", "MegatronEstimate", "Plan", "predict",
           "megatron_theoretical_memory", "largest_micro_batch", "compare", "measured_peaks", "measured_reserved",
           "format_plan", "add_cli"]

MiB = 1024**2
GiB = 1024**3

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


# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPUSpec:
    """A GPU model and its memory as the driver reports it (``nvidia-smi`` total)."""

    name: str
    capacity_bytes: int


GPUS: dict[str, GPUSpec] = {
    "H100-80GB": GPUSpec("H100-80GB", 81559 * MiB),
    "H200-141GB": GPUSpec("H200-141GB", 143771 * MiB),
    "A100-40GB": GPUSpec("A100-40GB", 40960 * MiB),
    "A100-80GB": GPUSpec("A100-80GB", 81920 * MiB),
}
_GPU_ALIASES = {
    "h100": "H100-80GB", "h100-80gb": "H100-80GB", "h100-80g": "H100-80GB", "h100-sxm": "H100-80GB",
    "h200": "H200-141GB", "h200-141gb": "H200-141GB", "h200-141g": "H200-141GB",
    "a100": "A100-80GB", "a100-80gb": "A100-80GB", "a100-80g": "A100-80GB",
    "a100-40gb": "A100-40GB", "a100-40g": "A100-40GB",
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(b|kb|kib|mb|mib|gb|gib|tb|tib)?\s*$", re.I)
_UNITS = {None: 1, "b": 1, "kb": 10**3, "kib": 1024, "mb": 10**6, "mib": MiB, "gb": 10**9, "gib": GiB, "tb": 10**12, "tib": 1024**4}


def gpu_spec(gpu: str | int | GPUSpec | None) -> GPUSpec | None:
    """A catalogue GPU by (case-insensitive) name, or a custom capacity: bytes, '24GiB', '80GB'."""
    if gpu is None or isinstance(gpu, GPUSpec):
        return gpu
    if isinstance(gpu, bool):
        raise ValueError(f"not a GPU: {gpu!r}")
    if isinstance(gpu, (int, float)):
        if gpu <= 0:
            raise ValueError(f"GPU capacity must be positive bytes, got {gpu}")
        return GPUSpec(f"custom ({int(gpu) / GiB:.1f} GiB)", int(gpu))
    key = str(gpu).strip()
    if key in GPUS:
        return GPUS[key]
    alias = _GPU_ALIASES.get(key.lower().replace(" ", "-").replace("_", "-"))
    if alias:
        return GPUS[alias]
    m = _SIZE_RE.match(key)
    if m:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower() if m.group(2) else None])
        if n > 0:
            return GPUSpec(f"custom ({n / GiB:.1f} GiB)", n)
    raise ValueError(f"unknown GPU {gpu!r}: use one of {', '.join(GPUS)} or a capacity such as '24GiB' / 25769803776")


# --------------------------------------------------------------------------- assumptions


@dataclass
class PlannerAssumptions:
    """Everything the planner cannot read from the config, with the reasoning for each default.

    Allocated (counted by ``torch.cuda.max_memory_allocated``):

    * ``cublas_workspace_bytes``: cuBLAS / cuBLASLt workspaces come from the caching
      allocator (torch sizes them 32 MiB per handle on Hopper; one stream, one handle each).
    * ``backward_overlap``: fraction of the gradients w.r.t. a layer's MLP intermediates
      (fc1 output + activation output) alive at the layer's backward peak on top of its kept
      tensors; autograd frees the MLP's saved tensors as it goes, so not all of them coexist.
      0.5 is what whole training steps of the real backend measured (CPU allocation tracker,
      ``tests/planner/test_planner_cpu_step.py``); 1.0 is the conservative bound.

    Not allocated (added for "fits"):

    * ``cuda_context_bytes``: CUDA context + kernels images of torch/NCCL (about 0.5 GiB with
      lazy module loading on CUDA 12).
    * ``nccl_bytes_per_group``: NCCL buffers per communicator this rank belongs to with more
      than one member (channels x NCCL_BUFFSIZE; ~0.1-0.3 GiB on NVLink).

    Reserved memory (what the caching allocator holds: ``max_memory_reserved``) is modelled term
    by term, not as a fraction: see :func:`_reserved_terms`.

    Kernel paths (None = what the backend picks on this machine, see :func:`kernel_path`):
    ``transformer_engine`` (TE installed where training runs), ``compiled_layer`` (the
    performance helper's compiled dense layer), ``optimizer`` ('foreach' torch AdamW keeps
    ``sqrt(v)`` of all its parameters, 'fused' kernel: no step temporaries, 'for-loop':
    torch's single-tensor AdamW off CUDA, two temporaries of the largest tensor).  ``deallocate_pipeline_outputs`` mirrors the
    backend's TransformerConfig (True on CUDA).
    """

    cublas_workspace_bytes: int = 64 * MiB
    backward_overlap: float = 0.5
    cuda_context_bytes: int = 512 * MiB
    nccl_bytes_per_group: int = 192 * MiB
    transformer_engine: bool | None = None
    compiled_layer: bool | None = None
    optimizer: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    deallocate_pipeline_outputs: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The kernels a plan assumes: the one kernel rule's answer (:func:`workbench.kernel_rule.choose`).
KernelPath = KernelChoice


def kernel_path(cfg: RunConfig, assumptions: PlannerAssumptions | None = None) -> KernelPath:
    """Which kernels a config trains with: :func:`workbench.kernel_rule.choose`, the backend's own rule.

    ``assumptions`` may pin Transformer Engine's presence (where training runs), the compiled
    layer or the optimizer kernel, for what-if plans and calibration runs of another path.
    """
    a = assumptions or PlannerAssumptions()
    kp = kernel_rule.choose(cfg, te=a.transformer_engine)
    if a.compiled_layer is not None and (a.compiled_layer != (kp.layer == "compiled")):
        kp = dataclasses.replace(kp, layer="compiled" if a.compiled_layer else "stock",
                                 layer_reason="" if a.compiled_layer else "pinned by PlannerAssumptions.compiled_layer",
                                 cuda_graphs_impl=kernel_rule.graphs_impl(cfg, "compiled") if kp.cuda_graphs and a.compiled_layer else "")
    if a.optimizer != "auto":
        kp = dataclasses.replace(kp, optimizer=a.optimizer)
    return kp


# --------------------------------------------------------------------------- structure


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


# --------------------------------------------------------------------------- per-layer helpers


def _inflight(sh: Any, rank: int) -> tuple[int, float]:
    """(chunk passes held, stage-equivalent micro-batches) at the peak, from workbench.schedules."""
    try:
        chunks = schedules.inflight_chunks(None, sh.pp, sh.m, sh.vpp, rank)
    except schedules.ScheduleError as err:
        raise ConfigError([Problem("parallel.pipeline_parallel", f"the pipeline schedule is not runnable: {err}",
                                   "fix the layout (see `workbench schedule`)")]) from None
    return chunks, chunks / sh.vpp


_SEGMENT = 2 * MiB  # the caching allocator's large segments are multiples of 2 MiB


def _round_up(n: float, unit: int) -> int:
    return int(math.ceil(n / unit) * unit)


_SMALL_REQUEST = 1 * MiB  # requests up to 1 MiB: the small pool (2 MiB segments, 512 B blocks)
_MID_REQUEST = 10 * MiB  # 1-10 MiB requests share 20 MiB segments; larger ones get their own, in 2 MiB steps
_MID_SEGMENT = 20 * MiB


def _segment_slack(per_layer: list[float], layers: int) -> int:
    """Reserved beyond the bytes of ``layers`` layers' kept tensors (``per_layer``: one layer's, in forward order),
    per the caching allocator's rules.

    Requests of more than 10 MiB get a segment of their own rounded up to 2 MiB; 1-10 MiB requests are carved
    best-fit from 20 MiB segments, a layer's forward filling its own (the rest of its last one is left to requests
    that fit it, which in a layer's forward do not come), so sizes that do not tile 20 MiB leave remainders: two
    8 MiB tensors per segment (GPT-2 medium at micro-batch 4), 6+6+9+3+6+6 MiB in three (GPT-2 small TP=2);
    small ones (<= 1 MiB) pack into 2 MiB segments and are ignored."""
    large = sum(_round_up(n, _SEGMENT) - n for n in per_layer if n > _MID_REQUEST)
    free: list[float] = []  # this layer's remainders, smallest first
    mid_reserved = mid = 0.0
    for n in (x for x in per_layer if _SMALL_REQUEST < x <= _MID_REQUEST):
        i = bisect.bisect_left(free, n)
        if i == len(free):  # no remainder holds it: a new 20 MiB segment
            mid_reserved += _MID_SEGMENT
            free.append(float(_MID_SEGMENT))
        bisect.insort(free, free.pop(i) - n)
        mid += n
    return int(layers * (large + mid_reserved - mid))


def _reserved_terms(sh: Any, a: PlannerAssumptions, default_alloc: float, moments: float, largest: float,
                    graph_pool: float) -> dict[str, float]:
    """``torch.cuda.max_memory_reserved`` by cause (bytes); their sum is the reserved peak.

    * ``default_pool``: the default pool's allocated peak (CUDA graphs: without the graphed
      layers), rounded to the allocator's 2 MiB large segments.
    * ``stranded_by_adam_state``: Adam's moments are created at the end of the first step, in
      the blocks that step's transients just freed.  When they are smaller than the largest
      transient buffer (the logits: bf16 with the compiled cross-entropy, the fp32 up-cast
      with megatron's), they split that block and the next step needs a new segment of its
      size: ``largest - moments`` stays reserved and unusable (GPT-2 small on one H100:
      2.2 GiB with megatron's cross-entropy, 0.6 GiB with the compiled one, measured).
    * ``cuda_graph_pool``: the cudagraph trees' private pool: the graphed layers' kept tensors
      of one step plus one layer's backward working set (what the warm-up and recording
      allocated there) and the inputs the trees copy in; replays reuse it.  It adds to the
      default pool's peak.
    * ``optimizer_temporaries`` (added by the caller): blocks freed by the optimizer step's
      temporaries (foreach AdamW's ``sqrt(v)``, fp32 grad copies) are parameter-sized, too small
      for the next step's logits, which need segments besides them.
    * ``activation_segments`` (added by the caller, :func:`_segment_slack`): the allocator's
      segment sizes around the kept activations (2 MiB steps above 10 MiB; 1-10 MiB requests
      in 20 MiB segments, which matters for small models: demo-small's [4096, 384] tensors).
    """
    terms = {"default_pool": float(_round_up(default_alloc, _SEGMENT)),
             "stranded_by_adam_state": float(_round_up(max(0.0, largest - moments), _SEGMENT))}
    if graph_pool:
        terms["cuda_graph_pool"] = float(_round_up(graph_pool, _SEGMENT))
    return terms


def _stage(sh: Any, d: Derived, kp: KernelPath, a: PlannerAssumptions, r: int,
           params: dict[str, int], S: Any, cp: int = 1) -> StagePlan:
    """One stage's plan; ``sh`` / ``S``: the model family's shape (``sh.s``: the tokens a rank holds of each
    sequence, ``seq_length / cp``) and its ``shapes`` module; ``cp``: the context-parallel size (its ring's buffers)."""
    s, b, h, t, e = sh.s, sh.b, sh.h, sh.tp, sh.e
    tok = s * b
    tsp = t if sh.sp else 1
    first, last = r == 0, r == sh.pp - 1
    P = params["total"]

    # ---- static state
    # train.fp8: each GEMM weight's forward and transposed copies in FP8, cast once per step and kept
    # (workbench.backend.fp8.cached; TE caches its own across micro-batches): 2 bytes per layer parameter
    fp8_weight_copies = 2 * params["layers"] if kp.fp8_impl else 0
    weights = P * sh.w + fp8_weight_copies
    grads = P * sh.grad_bytes
    Pe = params.get("experts", 0)  # MoE: the rank's expert parameters, sharded over the expert data-parallel group
    # the dense buffers (and so the distributed optimizer's shards) span DP x CP (megatron's intra_dp_cp_group)
    shard = (math.ceil((P - Pe) / (sh.dp * cp)) + math.ceil(Pe / getattr(sh, "edp", 1))) if sh.dist_opt else P
    master = 4 * shard if sh.mixed else 0
    moments = 8 * shard

    # ---- activations
    layers = d.stage_layers[r]
    layer_terms = S.layer_activation_terms(sh, kp)
    layer = float(sum(layer_terms.values()))
    chunks, inflight = _inflight(sh, r)
    per_chunk_layers = max(layers // sh.vpp, 1)
    if sh.recompute == "full":
        k = max(1, min(sh.recompute_num_layers, per_chunk_layers))
        blocks_per_chunk = math.ceil(per_chunk_layers / k)
        kept_per_chunk = blocks_per_chunk * e * tok * h / tsp
        saved = chunks * kept_per_chunk
        recompute_block = k * layer  # one block's activations rebuilt during its backward
    else:
        saved = chunks * per_chunk_layers * layer
        recompute_block = 0.0
    saved_layers = saved
    if first:
        # token / position ids and the embedding output's extra copies are small; ids are kept
        saved += inflight * 16 * tok
    if last:
        # final-norm input and output (saved by the output layer)
        saved += 2 * e * tok * h / tsp
    backward = S.layer_backward_transient(sh, kp, a)

    logits_peak, logits_kept = (0.0, 0.0)
    out_weight_grad = 0.0
    if last:
        logits_peak, logits_kept = S.logits_bytes(sh, kp)
        out_weight_grad = e * sh.vocab * h / t
        labels = 16 * tok  # labels + loss mask + per-token loss
        logits_peak += labels
    # the output layer's weight grad appears after the fp32 softmax gradient is gone
    head = max(logits_peak, (logits_peak - logits_kept) + out_weight_grad) if last else 0.0

    pipeline = 0.0
    if sh.pp > 1:
        pipeline = e * tok * h / tsp  # the gradient received from (or sent to) the neighbouring stage
        if not a.deallocate_pipeline_outputs and not last:
            pipeline += chunks * e * tok * h / tsp

    # megatron's global "mpu" buffer: SP all-gather of linear inputs; local attention's baddbmm input
    gbuf = 0.0
    if sh.sp:
        gbuf = e * tok * h  # the all-gathered [s, b, h] input of a column-parallel linear
    if kp.attention == "local":
        gbuf = max(gbuf, e * b * (sh.heads / t) * s * s)
    # The logits / loss buffers are gone before the first transformer layer runs its backward,
    # so the layer's backward working set (and a recomputed block) competes with them, not adds.
    layer_bwd = backward + recompute_block + ring_buffers(sh, cp)
    if last and head > 0:
        layer_bwd = max(0.0, layer_bwd - head)
    workspace_fb = a.cublas_workspace_bytes + gbuf + layer_bwd

    static = weights + grads + master + moments
    fb_dynamic = saved + head + pipeline + workspace_fb
    fb_peak = static + fb_dynamic

    # ---- optimizer step
    step_tmp = 0.0
    if kp.optimizer == "foreach":
        step_tmp += 4 * shard  # sqrt(exp_avg_sq) materialised by _multi_tensor_adam
    elif kp.optimizer == "for-loop":
        # _single_tensor_adam: sqrt(v) and its quotient for one tensor at a time: the largest one
        largest = max(sh.vocab * h / t if (first or last) else 0, h * sh.fc1_out / t, sh.ffn * h / t)
        step_tmp += 2 * 4 * min(largest, shard)
    if sh.mixed and sh.grad_bytes < 4:
        step_tmp += 4 * shard  # main_grad.float() copies handed to the fp32 master params
    opt_peak = static + a.cublas_workspace_bytes + gbuf + step_tmp

    # ---- CUDA graphs: the compiled layers warm up, record and replay in the cudagraph trees'
    # private pool.  Replays allocate nothing, so from the second step on the layers' kept
    # tensors and backward working set are reserved there but not allocated; the first step
    # (warm-up: the layers run eagerly, allocating) sees them allocated, but not yet Adam's
    # moments, which the first optimizer step creates.
    layers_kept = saved_layers if kp.cuda_graphs and sh.recompute != "full" else 0.0
    graphed = bool(layers_kept)
    phases = {"forward_backward": fb_peak, "optimizer_step": opt_peak}
    comp_fb = {"activations": saved, "logits_loss": head, "pipeline_buffers": pipeline, "workspace": workspace_fb}
    if graphed:
        phases["cuda_graph_warmup"] = fb_peak - moments
        phases["forward_backward"] = fb_peak - layers_kept - layer_bwd
    phase = max(phases, key=lambda k: phases[k])
    if phase == "optimizer_step":
        comp = {"activations": 0.0, "logits_loss": 0.0, "pipeline_buffers": 0.0,
                "workspace": a.cublas_workspace_bytes + gbuf + step_tmp}
    elif phase == "forward_backward" and graphed:
        comp = {**comp_fb, "activations": saved - layers_kept, "workspace": workspace_fb - layer_bwd}
    else:
        comp = comp_fb
    components = {"weights": weights, "gradients": grads, "master_weights": master,
                  "optimizer_moments": 0.0 if phase == "cuda_graph_warmup" else moments, **comp}
    components = {k: int(round(components[k])) for k in COMPONENTS}
    peak_i = sum(components.values())

    groups = sum(1 for n in (sh.tp, sh.pp, sh.dp, cp) if n > 1) + (1 if sh.tp * sh.pp * sh.dp * cp > 1 else 0)
    if sh.pp > 1 and (first or last):
        groups += 1  # embedding group (tied word embeddings / position embeddings)
    default_pool = max(v for k, v in phases.items() if k != "cuda_graph_warmup")
    largest = S.logits_bytes(sh, kp)[1] if last else e * tok * sh.fc1_out / t
    if sh.recompute == "full":
        slack = _segment_slack([e * tok * h / tsp], chunks * blocks_per_chunk)
    else:
        per_layer = [float(v) for k, v in layer_terms.items() if k != "norm_stats"]
        slack = _segment_slack(per_layer, chunks * per_chunk_layers)
    # cudagraph trees copy a graph's inputs into the pool unless they are static or another
    # graph's outputs: the first layer's input (the embedding's output) and the last layer's
    # incoming gradient (from the eager final norm)
    copies = [e * tok * h / tsp] * 2 if graphed else []
    slack += _segment_slack(copies, 1) if copies else 0
    # megatron's per-layer graphs (TE's layer) keep every layer's backward working set (H100: GPT-2 medium, Llama-1B)
    graph_pool = layers_kept + backward * (layers if kp.cuda_graphs_impl == "megatron" else 1) + sum(copies) if graphed else 0.0
    reserved_terms = _reserved_terms(sh, a, default_pool, moments, largest, graph_pool)
    reserved_terms["activation_segments"] = float(slack)  # in the graph pool when graphed, else the default pool
    # The optimizer step's temporaries are per-parameter tensors: the blocks they free serve later
    # requests only up to the largest parameter, so a step's larger buffers need segments besides.
    big_n = 4 * (S.largest_param_elements(sh) if hasattr(S, "largest_param_elements") else sh.vocab * h / t)
    big = head if last and logits_kept > big_n else 0.0
    if not graphed and sh.recompute != "full":
        big += sum(n for n in per_layer if n > big_n) * chunks * per_chunk_layers
    reserved_terms["optimizer_temporaries"] = max(0.0, static + step_tmp + big + a.cublas_workspace_bytes - default_pool)
    peak_res = max(peak_i, int(sum(reserved_terms.values())))
    overheads = {
        "cuda_context": a.cuda_context_bytes,
        "nccl": groups * a.nccl_bytes_per_group,
        "reserved_over_allocated": peak_res - peak_i,  # reserved over allocated: CUDA-graph pool, stranded blocks, rounding
    }
    detail = {
        "params": params,
        "layer_activation_terms": {k: int(v) for k, v in layer_terms.items()},
        "layer_activation_bytes": int(layer),
        "layers": layers,
        "chunks_in_flight": chunks,
        "logits_kept": int(logits_kept),
        "backward_transient": int(backward),
        "recompute_block": int(recompute_block),
        "optimizer_step_transient": int(step_tmp),
        "global_buffer": int(gbuf),
        "fp8_weight_copies": int(fp8_weight_copies),
        "communicators": groups,
    }
    return StagePlan(
        pp_rank=r, layers=layers, params=P, inflight_microbatches=inflight, components=components,
        peak_allocated=peak_i, peak_phase=phase,
        phases={k: int(v) for k, v in phases.items()},
        overheads=overheads, total=peak_i + sum(overheads.values()), detail=detail,
        peak_reserved=peak_res, reserved_terms={k: int(v) for k, v in reserved_terms.items()},
    )


def _stages(cfg: RunConfig, kp: KernelPath, a: PlannerAssumptions, micro_batch: int | None = None,
            d: Derived | None = None) -> list[StagePlan]:
    d = d or derive(cfg)
    S = family_of(cfg).shapes
    sh = S.shape(cfg, d, micro_batch)
    cp = max(int(getattr(cfg.parallel, "context_parallel", 1) or 1), 1)
    if cp > 1:  # context parallel: every rank holds seq_length / cp tokens of each sequence (its activations / cp)
        sh = dataclasses.replace(sh, s=sh.s // cp)
    params = S.stage_params(cfg, sh, d)
    return [_stage(sh, d, kp, a, r, params[r], S, cp=cp) for r in range(sh.pp)]


def ring_buffers(sh: Any, cp: int) -> float:
    """Context parallel: the ring attention's transient bytes in one layer (``sh.s`` is the local length): the K/V
    block being computed on and the next one in flight (2 x K and V, ``b x s_local x h_kv/tp x d`` each, in the
    activation dtype), in backward the travelling dK/dV accumulators (fp32: received, the block's, their sum and
    the one in flight), and the math block kernel's backward working set on the largest (step 0,
    ``s_local x s_local``) block: five fp32 score-sized tensors at once (scores, probabilities, dP, dP - delta, dS)
    (:mod:`workbench.backend.context_parallel`; ``impl='auto'`` is the math kernel until the flash path is checked)."""
    if cp <= 1:
        return 0.0
    kv = sh.b * sh.s * (sh.groups / sh.tp) * sh.head_dim
    scores = 5 * 4 * sh.b * (sh.heads / sh.tp) * sh.s * sh.s
    return 2 * 2 * kv * sh.e + 4 * 2 * kv * 4 + scores


# --------------------------------------------------------------------------- megatron's formula


def megatron_theoretical_memory(cfg: RunConfig) -> MegatronEstimate:
    """Megatron-LM's ``report_theoretical_memory`` for this config, in bytes.

    Re-derived from ``megatron/training/theoretical_memory_usage.py`` (dense GPT, no MoE/MTP):
    weights+optimizer = params of the most loaded shard (1/pp of the layers + the embedding,
    + the untied output layer when pp == 1) / tp x (18 bytes, or 6 + 12/dp with the
    distributed optimizer).  Activations: with SP *and* selective recompute it uses
    Korthikanti's Table 2, ``sbh (18 + 4 f/h)`` per layer over all layers (/ t), else
    ``sbh (10 + 24/t)`` per layer with a 5% margin; both add the embedding terms for ``pp``
    micro-batches, scale by the interleaving penalty or ``min(1, m/pp)``, and add the output
    layer only when pp == 1.  It models the first pipeline stage, whatever the rank.
    """
    m, p = cfg.model, cfg.parallel
    d = derive(cfg)
    h, L, V = m.hidden_size, m.num_layers, d.padded_vocab_size
    a, g = m.num_attention_heads, m.query_groups
    tp, pp, dp = p.tensor_parallel, p.pipeline_parallel, d.data_parallel
    s, b = m.seq_length, cfg.train.micro_batch_size
    gated = 1.5 if m.activation == "swiglu" else 1.0
    norm = 1 if m.normalization == "rmsnorm" else 2
    qproj = m.head_dim * a / h
    attn = 2 * h * h * ((1 + g / a) * qproj)
    per_layer = 2 * h * (m.ffn_size * gated + norm) + attn
    emb = h * V
    block = per_layer * L + norm * h
    shard = (block / pp + emb) / tp
    if not m.tie_embeddings and pp == 1:
        shard += emb / tp
    bytes_per_param = (6 + 12 / dp) if p.distributed_optimizer else 18
    weights = shard * bytes_per_param

    vpp = p.virtual_pipeline_parallel if p.vpp > 1 else None
    micro = d.num_microbatches

    def schedule_factor(x: float) -> float:
        if vpp is not None:
            x *= 1 + (pp - 1) / (pp * vpp)
        elif pp > 1:
            x *= min(1, micro / pp)
        return x

    if p.sequence_parallel and p.recompute == "selective":
        formula = "table2_sp_selective"
        act = s * b * h * (18 + 4 * (m.ffn_size / h)) * L
        act += 8 * s * b * pp + s * b * h * pp
        act = schedule_factor(act)
        if pp == 1:
            act += s * b * h * 4 * (1 + V / h)
        act /= tp
    else:
        formula = "without_sp"
        act = s * b * h * (10 + 24 / tp) * L
        act += 8 * s * b * pp + s * b * h * pp
        act = schedule_factor(act)
        if pp == 1:
            act += (s * b * V / tp + s * b * h) * 2
        act *= 1.05
    return MegatronEstimate(int(weights), int(act), int(weights + act), formula)


# --------------------------------------------------------------------------- predict


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
        return all(st.total <= spec.capacity_bytes for st in _stages(cfg, kp, a, mbs, d))

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
            stages = _stages(alt, kernel_path(alt, a), a)
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
        w = max(st.total for st in _stages(alt, kernel_path(alt, a), a))
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
    stages = _stages(cfg, kp, a)
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
                "device": p.device, "recompute": p.recompute},
    )


# --------------------------------------------------------------------------- measured vs predicted


def measured_peaks(run_dir: str | Path | RunReader) -> dict[int, int]:
    """Peak allocated bytes per rank of a run: the max ``mem_peak`` of its ``step`` events.

    ``run_dir``: a run directory or its :class:`workbench.run.RunReader` (a ``Run``'s ``reader``).
    """
    out: dict[int, int] = {}
    for ev in as_reader(run_dir).records("step"):
        if ev.mem_peak is not None and ev.rank is not None:
            r = int(ev.rank)
            out[r] = max(out.get(r, 0), int(ev.mem_peak))
    return out


def measured_reserved(run_dir: str | Path | RunReader) -> dict[int, int]:
    """Reserved bytes per rank of a run: the max ``mem_reserved`` of its ``step`` events (the
    caching allocator never returns segments during training, so the last is the peak)."""
    out: dict[int, int] = {}
    for ev in as_reader(run_dir).records("step"):
        if ev.mem_reserved is not None and ev.rank is not None:
            r = int(ev.rank)
            out[r] = max(out.get(r, 0), int(ev.mem_reserved))
    return out


def compare(plan: Plan, measured: dict[int, int], reserved: dict[int, int] | None = None):
    """A DataFrame of predicted vs measured peak allocated bytes per rank (and megatron's formula);
    with ``reserved`` (:func:`measured_reserved`) the reserved peaks too."""
    import pandas as pd

    rows = []
    for r in plan.ranks:
        meas = measured.get(r.rank, measured.get(str(r.rank)))  # type: ignore[call-overload]
        res = (reserved or {}).get(r.rank)
        rows.append({
            "predicted_reserved": r.peak_reserved, "measured_reserved": res,
            "reserved_error_pct": None if not res else 100.0 * (r.peak_reserved - res) / res,
            "rank": r.rank, "tp": r.tp_rank, "pp": r.pp_rank, "dp": r.dp_rank,
            "predicted": r.peak_allocated, "measured": meas,
            "error_pct": None if not meas else 100.0 * (r.peak_allocated - meas) / meas,
            "megatron_formula": plan.megatron.total,
            "megatron_error_pct": None if not meas else 100.0 * (plan.megatron.total - meas) / meas,
            "predicted_total": r.total,
        })
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- text / CLI


def format_plan(plan: Plan) -> str:
    """A per-rank table (GiB) with the breakdown, totals, fits, suggestions and the notes that explain them
    (:mod:`workbench.planner_text`)."""
    return planner_text.format_plan(plan, COMPONENTS)


def _cli_plan(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
        plan = predict(cfg, gpu=args.gpu)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except ValueError as err:  # unknown GPU name
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else format_plan(plan))
    if plan.fits is False:  # a status a script can test: 1 = does not fit, 2 = bad input
        print(f"workbench plan: does not fit on {args.gpu} (exit 1)", file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="predict per-rank GPU memory of a run config (before launching)",
                              epilog="exit status: 0 fits (or no --gpu), 1 does not fit on --gpu, 2 bad config or GPU name")
    p.add_argument("file", help="run config (JSON or YAML)")
    p.add_argument("--gpu", default=None, help=f"GPU to check against: {', '.join(GPUS)} or a capacity like 24GiB")
    p.add_argument("--json", action="store_true", help="print the whole plan (every rank, breakdown) as JSON")
    p.set_defaults(func=_cli_plan)
