"""Quantities derived from a run config, in one place, so no two parts of the workbench compute them differently:
padded vocab, data-parallel size, micro-batches, each pipeline stage's layers (the balanced split), parameter
counts, Megatron's FLOPs per step, and the environment a rank needs before CUDA starts.

Torch-free; tolerant of invalid configs (no division by zero).  ``cfg`` is a :class:`workbench.config.RunConfig` (typed
``Any`` here: that module imports this one).  :mod:`workbench.config` re-exports every name.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from workbench import kernel_rule
from workbench.families import family_of
from workbench.layout import Layout

__all__ = ["ParamCounts", "Derived", "derive", "pad_vocab_size", "layer_and_head_flops", "megatron_flops_per_step",
           "pipeline_stage_layers", "rank_environment", "allocator_reason", "apply_rank_environment"]


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of ``divisible_by * tp`` so every TP shard is equal."""
    multiple = max(divisible_by, 1) * max(tp, 1)
    return int(math.ceil(vocab_size / multiple) * multiple)


def layer_and_head_flops(cfg: Any) -> tuple[float, float]:
    """Megatron's FLOP terms of one layer and of the output layer + loss, in units of
    ``12 * tokens * h^2`` (the model family's ``shapes.layer_and_head_flops``)."""
    vocab = pad_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)
    return family_of(cfg).shapes.layer_and_head_flops(cfg, vocab)


def megatron_flops_per_step(cfg: Any, batch_size: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward), Megatron's formula.

    From ``megatron/training/training.py::num_floating_point_operations``:
    12 * B * s * L * h^2 * ((1 + g/a + s/h) * (d*a/h) + (f/h) * gate + V / (2 L h)).
    Recompute is deliberately not counted (MFU, not hardware FLOPs).
    """
    m = cfg.model
    b = batch_size if batch_size is not None else cfg.train.global_batch_size
    layer, head = layer_and_head_flops(cfg)
    return 12.0 * b * m.seq_length * m.hidden_size**2 * (m.num_layers * layer + head)


def pipeline_stage_layers(cfg: Any) -> tuple[int, ...]:
    """Transformer layers held by each pipeline rank (all its virtual chunks together).

    ``parallel.pipeline_split: balanced`` (without interleaving) picks the first and last
    stages' counts (megatron's ``num_layers_in_first/last_pipeline_stage``; middle stages
    split the rest evenly) that minimise the slowest stage's FLOPs, the output layer and
    loss counted on the last stage.  In 1F1B every stage runs at the pace of the slowest,
    so this is the split the ideal ``(p-1)/m`` bubble assumes.  Ties go to the even split.
    Falls back to the even split when no other split is valid (e.g. too few layers).
    """
    L, pp = cfg.model.num_layers, max(cfg.parallel.pipeline_parallel, 1)
    even = tuple([max(L // pp, 1)] * pp)
    if pp == 1 or cfg.parallel.pipeline_split != "balanced" or cfg.parallel.vpp > 1 or L < pp:
        return even
    return _balanced_split(L, pp, *layer_and_head_flops(cfg)) or even


@functools.lru_cache(maxsize=256)
def _balanced_split(L: int, pp: int, layer: float, head: float) -> tuple[int, ...] | None:
    """:func:`pipeline_stage_layers`' search: (first, middle stages, last) in the order first, then last,
    ascending; the first split strictly faster than the best so far wins (None: no valid split)."""
    k = pp - 2  # middle stages, each holding `per` layers

    def slowest(first: int, per: int, last: int) -> float:
        return max(first * layer + 0.0, per * layer + 0.0, last * layer + head) if k else max(first * layer + 0.0, last * layer + head)

    best = (L // pp, L // pp, L // pp) if L % pp == 0 else None
    best_time = slowest(*best) if best else math.inf
    for first in range(1, L):
        # pp == 2: the last stage takes the rest; else last = L - first - k * per, ascending as per descends
        for per in ((0,) if k == 0 else range((L - first - 1) // k, 0, -1)):
            t = slowest(first, per, L - first - k * per)
            if best is None or t < best_time - 1e-9:
                best, best_time = (first, per, L - first - k * per), t
    return None if best is None else (best[0], *([best[1]] * k), best[2])


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # word embeddings (padded vocab) + learned positions
    per_layer: int
    final_norm: int
    output_layer: int  # 0 when tied
    total: int


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_parallel: int
    padded_vocab_size: int
    num_microbatches: int
    tokens_per_step: int
    stage_layers: tuple[int, ...]  # transformer layers per pipeline rank (all its virtual chunks together)
    params: ParamCounts
    params_per_stage: tuple[int, ...]  # unsharded (before TP) parameters held by each pipeline stage
    flops_per_step: float


def rank_environment(cfg: Any) -> dict[str, str]:
    """Environment variables a rank process needs before it starts CUDA (read at CUDA's start).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP comm overlap (megatron's setting): with one
    hardware queue the GPU starts kernels in launch order across streams, so a backward
    all-reduce launched before the weight-gradient GEMMs gets its SMs and runs under them.  Not under
    ``parallel.async_tp``: its fused ops pipeline their pieces over side streams themselves.
    TE's userbuffers (``parallel.te_userbuffers``) need it too, and ``UB_SKIPMC=1`` (CUDA IPC instead of NVLink
    multicast) where the launch keeps multicast off for NCCL (``NCCL_NVLS_ENABLE=0``): hosts that share their GPUs
    disable multicast, and TE's userbuffers would otherwise create multicast objects on their own.

    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` where :func:`allocator_reason` names one.  A value the
    launch sets is kept.
    """
    import os

    p = cfg.parallel
    env: dict[str, str] = {}
    k = kernel_rule.choose(cfg)
    userbuffers = k.tp_overlap == "userbuffers"
    if p.device == "cuda" and p.tensor_parallel > 1 and (p.tp_comm_overlap or userbuffers or k.tp_overlap == "chunked") \
            and not k.async_tp:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if userbuffers and os.environ.get("NCCL_NVLS_ENABLE") == "0":
        env["UB_SKIPMC"] = "1"
    if allocator_reason(cfg):
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def allocator_reason(cfg: Any) -> str:
    """Why a run's ranks need the CUDA allocator's expandable segments ("" where they do not): the default caching
    allocator fragments where a step's buffers change size, and expandable segments grow one mapping instead
    (PyTorch's advice for changing allocation sizes).  (With CUDA graphs they need ``NCCL_GRAPH_REGISTER=0``,
    pytorch#158029; neither layout below runs CUDA graphs: ``kernel_rule``.)

    - Expert parallelism (EP > 1): the tokens a rank's experts receive change in number every step
      (``moe-research`` at EP=2 on two H200s: 44.2 GiB reserved over a 32.2 GiB allocated peak, against 46.1 over
      45.7 at EP=1; ``evidence/moe_proof.jsonl``).
    - Context parallelism (CP > 1): the ring's K/V blocks and fp32 gradient accumulators come whole and in halves
      (the load-balanced chunks) and travel between ranks (Llama-3.2-1B at 32k, CP=2 on two H200s: 54.3 GiB reserved
      over a 49.5 GiB allocated peak, 50.3 with expandable segments; ``evidence/planner_2gpu.jsonl``).
    """
    p = cfg.parallel
    if p.device != "cuda":
        return ""
    if p.expert_parallel > 1:
        return "expert parallelism: the dispatched token buffers change size every step"
    if getattr(p, "context_parallel", 1) > 1:
        return "context parallelism: the ring's blocks come whole and in halves and travel between ranks"
    return ""


def apply_rank_environment(cfg: Any) -> dict[str, str]:
    """Set :func:`rank_environment` in this process where the launch did not set a value
    (called first thing by a rank, before anything starts CUDA).  Returns the values in force."""
    import os

    return {k: os.environ.setdefault(k, v) for k, v in rank_environment(cfg).items()}


def derive(cfg: Any) -> Derived:
    """Everything computed from a config, in one place. Tolerant of invalid configs (no division by zero)."""
    m, t = cfg.model, cfg.train
    lay = Layout.of(cfg)
    tp, pp, world, dp = lay.tp, lay.pp, lay.world, lay.dp
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    micro = max(t.global_batch_size // max(t.micro_batch_size * dp, 1), 1)
    stage_layers = pipeline_stage_layers(cfg)
    params = ParamCounts(**family_of(cfg).shapes.param_counts(cfg, vocab))
    stages = []
    for s in range(pp):
        n = stage_layers[s] * params.per_layer
        if s == 0:
            n += params.embedding
        if s == pp - 1:
            n += params.final_norm + (params.output_layer if not m.tie_embeddings else (vocab * m.hidden_size if pp > 1 else 0))
        stages.append(n)
    return Derived(
        world_size=world,
        data_parallel=dp,
        padded_vocab_size=vocab,
        num_microbatches=micro,
        tokens_per_step=t.global_batch_size * m.seq_length,
        stage_layers=stage_layers,
        params=params,
        params_per_stage=tuple(stages),
        flops_per_step=megatron_flops_per_step(cfg),
    )
