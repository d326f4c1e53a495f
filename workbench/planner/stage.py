"""The memory model of one pipeline stage: per-rank peak GPU memory of a training layout, term by term.

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
:func:`workbench.planner.evidence.evidence_table`).

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

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from workbench import schedules
from workbench.config import ConfigError, Derived, Problem, RunConfig, derive
from workbench.families import family_of
from workbench.planner.assumptions import KernelPath, PlannerAssumptions
from workbench.planner.gpus import MiB
from workbench.planner.plan import COMPONENTS, StagePlan

__all__ = ["stages_of", "ring_buffers", "ring_flash"]


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
      2.2 GiB with megatron's cross-entropy, 0.6 GiB with the compiled one, measured).  Under
      optimizer CPU offload the step's small lasting allocations join them
      (``PlannerAssumptions.offload_lasting_bytes``).
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
    # Under optimizer CPU offload the step's small lasting allocations land there too (``a.offload_lasting_bytes``):
    # with full offload (no moments on the device) they alone strand the rest of the block.
    late = moments + (a.offload_lasting_bytes if sh.offload else 0.0)
    stranded = max(0.0, largest - late) if late > 0 else 0.0
    terms = {"default_pool": float(_round_up(default_alloc, _SEGMENT)),
             "stranded_by_adam_state": float(_round_up(stranded, _SEGMENT))}
    if graph_pool:
        terms["cuda_graph_pool"] = float(_round_up(graph_pool, _SEGMENT))
    return terms


@dataclass
class _Static:
    """The stage's static state on one rank (bytes on the device); ``shard``: the parameters whose optimizer state it
    keeps; ``host``: what optimizer CPU offload keeps in host memory instead."""

    weights: float
    grads: float
    master: float
    moments: float
    shard: float
    fp8_weight_copies: float
    host: float = 0.0
    host_startup: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.moments


def _static_state(sh: Any, kp: KernelPath, params: dict[str, int], cp: int) -> _Static:
    """Weights (and FP8 weight copies), the gradient buffer, fp32 master weights and Adam's moments of one rank."""
    P = params["total"]
    # train.fp8: each GEMM weight's forward and transposed copies in FP8, cast once per step and kept
    # (workbench.backend.fp8.cached; TE caches its own across micro-batches): 2 bytes per layer parameter
    fp8_weight_copies = 2 * params["layers"] if kp.fp8_impl else 0
    Pe = params.get("experts", 0)  # MoE: the rank's expert parameters, sharded over the expert data-parallel group
    # the dense buffers (and so the distributed optimizer's shards) span DP x CP (megatron's intra_dp_cp_group)
    shard = (math.ceil((P - Pe) / (sh.dp * cp)) + math.ceil(Pe / getattr(sh, "edp", 1))) if sh.dist_opt else P
    # optimizer CPU offload (megatron's HybridDeviceOptimizer, the precision-aware path): the offloaded share of the
    # shard keeps its fp32 parameter copy, its gradient copy (pinned) and Adam's moments in host memory (16 bytes
    # each); the rest keeps its fp32 copy and moments on the device as the distributed optimizer does
    on_device = 1.0 - sh.offload
    return _Static(weights=P * sh.w + fp8_weight_copies, grads=P * sh.grad_bytes,
                   master=4 * shard * on_device if sh.mixed else 0, moments=8 * shard * on_device, shard=shard,
                   fp8_weight_copies=fp8_weight_copies, host=16 * shard * sh.offload,
                   # megatron builds the offloading optimizer twice, first over all the rank's parameters, then over
                   # the shard: each build's offloaded share as fp32 copies (4 bytes) and pinned bf16 staging (2), both
                   # alive until the rank releases the first (moments and gradient copies come with the first step)
                   host_startup=6 * (P + shard) * sh.offload)


@dataclass
class _Kept:
    """What one stage keeps for backward at its peak (bytes) and the counts it follows from."""

    layers: int
    layer_terms: dict[str, float]  # one layer's kept tensors by term (one micro-batch)
    layer: float  # their sum
    chunks: int  # chunk passes in flight
    inflight: float  # stage-equivalent micro-batches in flight
    per_chunk_layers: int
    blocks_per_chunk: int  # full recompute: checkpointed blocks per chunk (0 otherwise)
    saved_layers: float  # the transformer layers' kept tensors
    saved: float  # and the embedding's / final norm's
    recompute_block: float  # full recompute: one block's activations rebuilt during its backward


def _kept(sh: Any, d: Derived, kp: KernelPath, r: int, S: Any, cp: int = 1) -> _Kept:
    """The activations stage ``r`` keeps: every in-flight chunk's layers (one input per block under full recompute).
    Context parallel (``cp`` > 1): a layer also keeps the ring attention's own copy of its output (saved for its
    backward, ``b x h/tp x s_local x d`` in the activation dtype) beside the projection's input."""
    e, tok, h = sh.e, sh.s * sh.b, sh.h
    tsp = sh.tp if sh.sp else 1
    layers = d.stage_layers[r]
    layer_terms = dict(S.layer_activation_terms(sh, kp))
    if cp > 1:
        layer_terms["ring_output"] = e * tok * (sh.heads / sh.tp) * sh.head_dim
    layer = float(sum(layer_terms.values()))
    chunks, inflight = _inflight(sh, r)
    per_chunk_layers = max(layers // sh.vpp, 1)
    blocks_per_chunk = 0
    if sh.recompute == "full":
        k = max(1, min(sh.recompute_num_layers, per_chunk_layers))
        blocks_per_chunk = math.ceil(per_chunk_layers / k)
        saved = chunks * blocks_per_chunk * e * tok * h / tsp
        recompute_block = k * layer
    else:
        saved = chunks * per_chunk_layers * layer
        recompute_block = 0.0
    saved_layers = saved
    if r == 0:
        # token / position ids and the embedding output's extra copies are small; ids are kept
        saved += inflight * 16 * tok
    if r == sh.pp - 1:
        # final-norm input and output (saved by the output layer)
        saved += 2 * e * tok * h / tsp
    return _Kept(layers, layer_terms, layer, chunks, inflight, per_chunk_layers, blocks_per_chunk, saved_layers, saved,
                 recompute_block)


@dataclass
class _Transients:
    """A stage's forward/backward transients (bytes)."""

    backward: float  # one layer's backward working set
    head: float  # logits and loss on the last stage at their peak
    logits_kept: float
    pipeline: float  # received / un-freed pipeline tensors
    gbuf: float  # megatron's global buffer (SP all-gather; local attention's baddbmm input)
    layer_bwd: float  # what a layer's backward holds beside the kept tensors
    workspace: float  # cuBLAS workspaces + gbuf + layer_bwd


def _transients(sh: Any, kp: KernelPath, a: PlannerAssumptions, r: int, S: Any, kept: _Kept, cp: int,
                ring_flash: bool) -> _Transients:
    """The logits / loss buffers, pipeline buffers, megatron's global buffer and one layer's backward working set."""
    e, tok, h, t = sh.e, sh.s * sh.b, sh.h, sh.tp
    tsp = t if sh.sp else 1
    last = r == sh.pp - 1
    backward = S.layer_backward_transient(sh, kp, a)
    logits_peak, logits_kept, out_weight_grad = 0.0, 0.0, 0.0
    if last:
        logits_peak, logits_kept = S.logits_bytes(sh, kp)
        out_weight_grad = e * sh.vocab * h / t
        logits_peak += 16 * tok  # labels + loss mask + per-token loss
    # the output layer's weight grad appears after the fp32 softmax gradient is gone
    head = max(logits_peak, (logits_peak - logits_kept) + out_weight_grad) if last else 0.0
    pipeline = 0.0
    if sh.pp > 1:
        pipeline = e * tok * h / tsp  # the gradient received from (or sent to) the neighbouring stage
        if not a.deallocate_pipeline_outputs and not last:
            pipeline += kept.chunks * e * tok * h / tsp
    gbuf = e * tok * h if sh.sp else 0.0  # the all-gathered [s, b, h] input of a column-parallel linear
    if kp.attention == "local":
        gbuf = max(gbuf, e * sh.b * (sh.heads / t) * sh.s * sh.s)
    # The logits / loss buffers are gone before the first transformer layer runs its backward,
    # so the layer's backward working set (and a recomputed block) competes with them, not adds.
    layer_bwd = backward + kept.recompute_block + ring_buffers(sh, cp, flash=ring_flash)
    if last and head > 0:
        layer_bwd = max(0.0, layer_bwd - head)
    return _Transients(backward, head, logits_kept, pipeline, gbuf, layer_bwd, a.cublas_workspace_bytes + gbuf + layer_bwd)


def _optimizer_temporaries(sh: Any, kp: KernelPath, shard: float, r: int) -> float:
    """Bytes the optimizer step allocates beside the static state (by the AdamW kernel; the fp32 grad copies)."""
    step_tmp = 0.0
    h, t = sh.h, sh.tp
    largest = min(max(sh.vocab * h / t if r in (0, sh.pp - 1) else 0, h * sh.fc1_out / t, sh.ffn * h / t), shard)
    if kp.optimizer == "foreach":
        step_tmp += 4 * shard  # sqrt(exp_avg_sq) materialised by _multi_tensor_adam
    elif kp.optimizer == "for-loop":
        step_tmp += 2 * 4 * largest  # _single_tensor_adam: sqrt(v) and its quotient for one tensor at a time
    if sh.mixed and sh.grad_bytes < 4:
        step_tmp += 4 * shard  # main_grad.float() copies handed to the fp32 master params
    step_tmp *= 1.0 - sh.offload  # the offloaded share steps on the host
    if sh.offload and sh.mixed:
        # the host's updated fp32 parameter goes back into the bf16 weight (and, with bf16 gradients, each gradient to
        # the host as fp32): torch converts on the GPU, an fp32 temporary of one parameter at a time on a copy stream
        step_tmp += 4 * largest * (2 if sh.grad_bytes < 4 else 1)
    return step_tmp


def _peak(st: _Static, kept: _Kept, tr: _Transients, kp: KernelPath, a: PlannerAssumptions, sh: Any,
          step_tmp: float) -> tuple[dict[str, float], str, dict[str, int], float]:
    """Each phase's allocated peak, the phase that decides, its components and the graphed layers' kept bytes.

    CUDA graphs: the compiled layers warm up, record and replay in the cudagraph trees' private pool.  Replays
    allocate nothing, so from the second step on the layers' kept tensors and backward working set are reserved
    there but not allocated; the first step (warm-up: the layers run eagerly, allocating) sees them allocated, but
    not yet Adam's moments, which the first optimizer step creates.

    The step captured as one graph (``cuda_graphs_impl == "step"``): its second eager warm-up step runs with the
    moments allocated, and the capture allocates the same working set in the graph's pool: the whole
    forward-backward peak is allocated (Llama-3.2-1B on one H200: 34.8 GiB measured in both steps,
    ``evidence/planner_1gpu_step_graph_qk_norms.jsonl``); replays allocate nothing."""
    fb_peak = st.total + kept.saved + tr.head + tr.pipeline + tr.workspace
    opt_peak = st.total + a.cublas_workspace_bytes + tr.gbuf + step_tmp
    layers_kept = kept.saved_layers if kp.cuda_graphs and sh.recompute != "full" else 0.0
    phases = {"forward_backward": fb_peak, "optimizer_step": opt_peak}
    if kp.cuda_graphs_impl == "step":
        layers_kept = 0.0
    comp_fb = {"activations": kept.saved, "logits_loss": tr.head, "pipeline_buffers": tr.pipeline,
               "workspace": tr.workspace}
    if layers_kept:
        phases["cuda_graph_warmup"] = fb_peak - st.moments
        phases["forward_backward"] = fb_peak - layers_kept - tr.layer_bwd
    phase = max(phases, key=lambda k: phases[k])
    if phase == "optimizer_step":
        comp = {"activations": 0.0, "logits_loss": 0.0, "pipeline_buffers": 0.0,
                "workspace": a.cublas_workspace_bytes + tr.gbuf + step_tmp}
    elif phase == "forward_backward" and layers_kept:
        comp = {**comp_fb, "activations": kept.saved - layers_kept, "workspace": tr.workspace - tr.layer_bwd}
    else:
        comp = comp_fb
    components = {"weights": st.weights, "gradients": st.grads, "master_weights": st.master,
                  "optimizer_moments": 0.0 if phase == "cuda_graph_warmup" else st.moments, **comp}
    return phases, phase, {k: int(round(components[k])) for k in COMPONENTS}, layers_kept


def _reserved(sh: Any, kp: KernelPath, a: PlannerAssumptions, S: Any, r: int, st: _Static, kept: _Kept,
              tr: _Transients, phases: dict[str, float], layers_kept: float, step_tmp: float) -> dict[str, float]:
    """The reserved peak by cause (:func:`_reserved_terms` plus the activations' segments and the optimizer step's)."""
    e, tok, h, t = sh.e, sh.s * sh.b, sh.h, sh.tp
    tsp = t if sh.sp else 1
    last = r == sh.pp - 1
    graphed = bool(layers_kept)
    default_pool = max(v for k, v in phases.items() if k != "cuda_graph_warmup")
    largest = S.logits_bytes(sh, kp)[1] if last else e * tok * sh.fc1_out / t
    per_layer: list[float] = []
    if sh.recompute == "full":
        slack = _segment_slack([e * tok * h / tsp], kept.chunks * kept.blocks_per_chunk)
    else:
        per_layer = [float(v) for k, v in kept.layer_terms.items() if k != "norm_stats"]
        slack = _segment_slack(per_layer, kept.chunks * kept.per_chunk_layers)
    # cudagraph trees copy a graph's inputs into the pool unless they are static or another
    # graph's outputs: the first layer's input (the embedding's output) and the last layer's
    # incoming gradient (from the eager final norm)
    copies = [e * tok * h / tsp] * 2 if graphed else []
    slack += _segment_slack(copies, 1) if copies else 0
    # megatron's per-layer graphs (TE's layer) keep every layer's backward working set (H100: GPT-2 medium, Llama-1B)
    graph_pool = (layers_kept + tr.backward * (kept.layers if kp.cuda_graphs_impl == "megatron" else 1) + sum(copies)
                  if graphed else 0.0)
    step = kp.cuda_graphs_impl == "step"
    if step:
        # the step as one graph: the capture empties the cache first (workbench.backend.step_graph), then the default
        # pool keeps the static state and the optimizer step's temporaries, the graph's own pool the step's working set
        default_pool = phases["optimizer_step"]
        graph_pool = phases["forward_backward"] - st.total
    terms = _reserved_terms(sh, a, default_pool, st.moments, largest, graph_pool)
    terms["activation_segments"] = float(slack)  # in the graph pool when graphed, else the default pool
    # The optimizer step's temporaries are per-parameter tensors: the blocks they free serve later
    # requests only up to the largest parameter, so a step's larger buffers need segments besides.
    big_n = 4 * (S.largest_param_elements(sh) if hasattr(S, "largest_param_elements") else sh.vocab * h / t)
    big = tr.head if last and tr.logits_kept > big_n and not step else 0.0  # (the step graph's logits: its pool)
    if not graphed and not step and sh.recompute != "full":  # (a graph's activations: its own pool)
        big += sum(n for n in per_layer if n > big_n) * kept.chunks * kept.per_chunk_layers
    terms["optimizer_temporaries"] = max(0.0, st.total + step_tmp + big + a.cublas_workspace_bytes - default_pool)
    return terms


def _stage(sh: Any, d: Derived, kp: KernelPath, a: PlannerAssumptions, r: int,
           params: dict[str, int], S: Any, cp: int = 1, ring_flash: bool = False) -> StagePlan:
    """One stage's plan; ``sh`` / ``S``: the model family's shape (``sh.s``: the tokens a rank holds of each
    sequence, ``seq_length / cp``) and its ``shapes`` module; ``cp``: the context-parallel size (its ring's buffers;
    ``ring_flash``: its blocks run the flash kernel)."""
    st = _static_state(sh, kp, params, cp)
    kept = _kept(sh, d, kp, r, S, cp)
    tr = _transients(sh, kp, a, r, S, kept, cp, ring_flash)
    step_tmp = _optimizer_temporaries(sh, kp, st.shard, r)
    phases, phase, components, layers_kept = _peak(st, kept, tr, kp, a, sh, step_tmp)
    peak_i = sum(components.values())
    reserved_terms = _reserved(sh, kp, a, S, r, st, kept, tr, phases, layers_kept, step_tmp)
    peak_res = max(peak_i, int(sum(reserved_terms.values())))
    groups = sum(1 for n in (sh.tp, sh.pp, sh.dp, cp) if n > 1) + (1 if sh.tp * sh.pp * sh.dp * cp > 1 else 0)
    if sh.pp > 1 and r in (0, sh.pp - 1):
        groups += 1  # embedding group (tied word embeddings / position embeddings)
    overheads = {
        "cuda_context": a.cuda_context_bytes,
        "nccl": groups * a.nccl_bytes_per_group,
        "reserved_over_allocated": peak_res - peak_i,  # reserved over allocated: CUDA-graph pool, stranded blocks, rounding
    }
    detail = {
        "params": params, "layer_activation_terms": {k: int(v) for k, v in kept.layer_terms.items()},
        "layer_activation_bytes": int(kept.layer), "layers": kept.layers, "chunks_in_flight": kept.chunks,
        "logits_kept": int(tr.logits_kept), "backward_transient": int(tr.backward),
        "recompute_block": int(kept.recompute_block), "optimizer_step_transient": int(step_tmp),
        "global_buffer": int(tr.gbuf), "fp8_weight_copies": int(st.fp8_weight_copies), "communicators": groups,
        "optimizer_host_bytes": int(st.host), "optimizer_host_startup_bytes": int(st.host_startup),
    }
    return StagePlan(
        pp_rank=r, layers=kept.layers, params=params["total"], inflight_microbatches=kept.inflight,
        components=components, peak_allocated=peak_i, peak_phase=phase, phases={k: int(v) for k, v in phases.items()},
        overheads=overheads, total=peak_i + sum(overheads.values()), detail=detail,
        peak_reserved=peak_res, reserved_terms={k: int(v) for k, v in reserved_terms.items()},
    )


def stages_of(cfg: RunConfig, kp: KernelPath, a: PlannerAssumptions, micro_batch: int | None = None,
              d: Derived | None = None) -> list[StagePlan]:
    """Every pipeline stage's plan of ``cfg`` on kernel path ``kp`` (``micro_batch`` overrides the config's)."""
    d = d or derive(cfg)
    S = family_of(cfg).shapes
    sh = S.shape(cfg, d, micro_batch)
    if a.lm_head_every_position:
        sh = dataclasses.replace(sh, head_rows=0)
    cp = max(int(getattr(cfg.parallel, "context_parallel", 1) or 1), 1)
    if cp > 1:  # context parallel: every rank holds seq_length / cp tokens of each sequence (its activations / cp)
        sh = dataclasses.replace(sh, s=sh.s // cp)
    params = S.stage_params(cfg, sh, d)
    flash = ring_flash(cfg, sh)
    return [_stage(sh, d, kp, a, r, params[r], S, cp=cp, ring_flash=flash) for r in range(sh.pp)]


def ring_flash(cfg: RunConfig, sh: Any) -> bool:
    """Whether the ring attention's blocks run the flash kernel (``impl='auto'``'s rule,
    :func:`workbench.backend.context_parallel.ring_attention`): CUDA, 16-bit activations, a head dim that is a
    multiple of 8 up to 256, no key-padding mask (a family whose attention takes one, BERT, runs the math kernel:
    ``Supports.key_padding``), on an Ampere or newer GPU: every catalogue GPU (:data:`workbench.planner.GPUS`); a
    pre-Ampere GPU runs the math kernel, whose block scores this plan leaves out."""
    return (cfg.parallel.device == "cuda" and sh.e == 2 and sh.head_dim % 8 == 0 and sh.head_dim <= 256
            and not family_of(cfg).supports.key_padding)


def ring_buffers(sh: Any, cp: int, flash: bool = False) -> float:
    """Context parallel: the ring attention's transient bytes in one layer (``sh.s`` is the local length): the K/V
    block being computed on and the next one in flight (2 x K and V, ``b x s_local x h_kv/tp x d`` each, in the
    activation dtype), in backward the travelling dK/dV accumulators (fp32: received, the block's, their sum and
    the one in flight), and the block kernel's backward working set on the largest (step 0, ``s_local x s_local``)
    block: the math kernel's five fp32 score-sized tensors at once (scores, probabilities, dP, dP - delta, dS), the
    flash kernel's (``flash``; :func:`ring_flash`) no scores but its K/V heads repeated per query group and their
    gradients (4 x ``b x s_local x h/tp x d``, activation dtype) and the block's fp32 dQ
    (:mod:`workbench.backend.context_parallel`; ``impl='auto'``: flash on CUDA in 16 bits, math elsewhere)."""
    if cp <= 1:
        return 0.0
    kv = sh.b * sh.s * (sh.groups / sh.tp) * sh.head_dim
    q = sh.b * sh.s * (sh.heads / sh.tp) * sh.head_dim
    scores = (4 * q * sh.e + q * 4) if flash else 5 * 4 * sh.b * (sh.heads / sh.tp) * sh.s * sh.s
    return 2 * 2 * kv * sh.e + 4 * 2 * kv * 4 + scores
