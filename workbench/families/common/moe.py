"""Mixture of experts: the ``model.moe`` config section, its rules and the quantities derived from it.

A family whose ``Supports.moe`` is true (GPT: Mixtral / Qwen3-MoE / OLMoE are Llama-shaped decoders)
replaces the dense MLP of every ``layer_freq``-th layer with megatron-core's ``MoELayer``: a top-k
router (softmax scores, fp32), ``num_experts`` expert MLPs of ``ffn_hidden_size`` each (the same
activation as the dense MLP), optional shared experts every token passes through, a token
dispatcher (all-to-all or all-gather) and expert parallelism (``parallel.expert_parallel``, with
expert tensor parallelism ``parallel.expert_tensor_parallel``).

Megatron 0.19's layout rules, each checked by :func:`rules` before any process starts:

- experts are split evenly over EP ranks: ``num_experts % expert_parallel == 0``;
- expert layers have their own grid ``ETP x EP x PP x expert-DP`` over the same world, so
  ``world % (ETP x EP x PP) == 0`` (expert data parallel = world / (ETP x EP x PP)); the dense
  grid stays ``TP x PP x DP``;
- MoE with TP > 1 trains only with sequence parallelism (``MoELayer`` raises otherwise);
- no linear biases (megatron asserts ETP = 1 for them and fails at TP = EP = 1); the expert FFN is split by ETP,
  a shared expert's by TP;
- top-1 routing needs the softmax before the top-k (a softmax over one score is always 1);
- a capacity (token dropping) applies to the aux / seq-aux / no-balancing routers; padding to it
  needs one.

This module is torch-free (config validation, the planner and widgets read it in a notebook).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from workbench.config_fields import ITERS, LAYERS, bounded
from workbench.layout import Layout

__all__ = ["MoEConfig", "is_moe", "moe_layers", "expert_tensor_parallel", "expert_data_parallel",
           "expert_ffn", "shared_ffn", "transformer_fields", "rules", "LOSS_METRICS"]


@dataclass
class MoEConfig:
    """Mixture of experts (``num_experts: 0``: a dense MLP; the other fields are then not read).  Each numeric
    field's ``metadata["bound"]`` is its range (:mod:`workbench.config_fields`)."""

    num_experts: int = bounded(0, 0, 4096, why="the largest trained MoEs have a few hundred experts",
                               fix="use 0 (dense) or e.g. 8-128")
    #: experts each token is routed to
    top_k: int = bounded(2, 1, 64, why="trained MoEs route to 1-16 experts")
    #: each routed expert's FFN size; None -> model.ffn_hidden_size (its default)
    ffn_hidden_size: int | None = bounded(None, 1, 1 << 20, why="the widest trained MLPs are ~100k",
                                          fix="use null for model.ffn_hidden_size")
    #: shared experts every token passes through (Qwen2-MoE / DeepSeek style), added to the routed output
    shared_experts: int = bounded(0, 0, 64, why="trained MoEs have 0-2 shared experts")
    #: each shared expert's FFN size; None -> the routed experts' size
    shared_expert_ffn_hidden_size: int | None = bounded(None, 1, 1 << 20, why="the widest trained MLPs are ~100k",
                                                        fix="use null for the experts' size")
    #: a sigmoid gate on the shared experts' output (Qwen2-MoE)
    shared_expert_gate: bool = False
    #: MoE on every n-th layer (layers 0, n, 2n, ...; megatron's moe_layer_freq), dense MLPs between
    layer_freq: int = bounded(1, 1, 1024, why=LAYERS.why, fix="use 1 (every layer) or 2 (every other)")
    #: softmax over all experts before the top-k (OLMoE; the k weights then do not sum to 1); false: softmax
    #: over the k chosen scores (Mixtral, Qwen3-MoE with normalised top-k)
    router_pre_softmax: bool = False
    #: load-balancing loss: aux_loss (Switch, over the micro-batch), seq_aux_loss (per sequence), none
    load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    aux_loss_coeff: float = bounded(1e-2, 0, 1e3, why="trained MoEs use 1e-3 to 1e-2", fix="use 1e-2, or 0")
    #: router z-loss (ST-MoE) coefficient; 0: off
    z_loss_coeff: float = bounded(0.0, 0, 1e3, why="ST-MoE uses 1e-3", fix="use 1e-3, or 0 to disable")
    #: expert capacity = capacity_factor x tokens x top_k / num_experts; tokens beyond it are dropped. None: dropless
    capacity_factor: float | None = bounded(None, 0, 1e3, lo_open=True, why="capacity factors are ~1-2",
                                            fix="use e.g. 1.25, or null (dropless)")
    #: pad every expert's input to its capacity (static shapes); needs capacity_factor
    pad_to_capacity: bool = False
    #: which routed tokens a full expert drops: the lowest router probabilities, or the latest positions
    drop_policy: Literal["probs", "position"] = "probs"
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    #: one grouped GEMM for all local experts where the kernel rule has one (TE's grouped MLP, torch's grouped_mm);
    #: false: one GEMM pair per expert (megatron's SequentialMLP)
    grouped_gemm: bool = True
    #: write a ``router`` event (tokens per expert, load-balancing / z-loss, dropped tokens per MoE layer) every
    #: this many steps; 0: never.  Cost: one all-reduce of layers x experts counts on those steps
    router_stats_interval: int = bounded(5, 0, ITERS, why="a billion steps", fix="use 0 to disable")


#: megatron's metric names of the router losses (its MoE metrics tracker), by config
LOSS_METRICS = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss", "z_loss": "z_loss"}


def is_moe(cfg: Any) -> bool:
    """Whether the config's model has experts."""
    moe = getattr(cfg.model, "moe", None)
    return bool(moe is not None and moe.num_experts > 0)


def moe_layers(cfg: Any) -> list[bool]:
    """Per transformer layer (0-based, whole model): whether it is an MoE layer (megatron's ``moe_layer_freq``)."""
    if not is_moe(cfg):
        return [False] * cfg.model.num_layers
    n = max(cfg.model.moe.layer_freq, 1)
    return [i % n == 0 for i in range(cfg.model.num_layers)]


def expert_tensor_parallel(cfg: Any) -> int:
    """Expert tensor parallel size: ``parallel.expert_tensor_parallel``, else TP (megatron's default)."""
    p = cfg.parallel
    return p.expert_tensor_parallel or p.tensor_parallel


def expert_data_parallel(cfg: Any) -> int:
    """Expert data parallel size: world / (ETP x EP x PP), megatron 0.19's definition (1 when it does not divide)."""
    return Layout.of(cfg).expert_data_parallel


def expert_ffn(cfg: Any) -> int:
    """A routed expert's FFN size."""
    return cfg.model.moe.ffn_hidden_size or cfg.model.ffn_size


def shared_ffn(cfg: Any) -> int:
    """All shared experts' FFN size together (megatron's moe_shared_expert_intermediate_size); 0 without."""
    moe = cfg.model.moe
    return moe.shared_experts * (moe.shared_expert_ffn_hidden_size or expert_ffn(cfg))


def transformer_fields(cfg: Any, grouped_te: bool) -> dict[str, Any]:
    """megatron ``TransformerConfig`` fields of the MoE layers ({} for a dense model); ``grouped_te``: the kernel
    rule's TE grouped MLP (megatron's ``moe_grouped_gemm``)."""
    if not is_moe(cfg):
        return {}
    moe, p = cfg.model.moe, cfg.parallel
    lb = moe.load_balancing
    return dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.top_k, moe_ffn_hidden_size=expert_ffn(cfg),
        moe_shared_expert_intermediate_size=shared_ffn(cfg) or None, moe_shared_expert_gate=moe.shared_expert_gate,
        moe_layer_freq=max(moe.layer_freq, 1), moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_load_balancing_type=lb, moe_aux_loss_coeff=moe.aux_loss_coeff if lb != "none" else 0.0,
        moe_z_loss_coeff=moe.z_loss_coeff or None, moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity, moe_token_drop_policy=moe.drop_policy,
        moe_token_dispatcher_type=moe.token_dispatcher, moe_router_dtype="fp32", moe_grouped_gemm=grouped_te,
        expert_model_parallel_size=max(p.expert_parallel, 1), expert_tensor_parallel_size=expert_tensor_parallel(cfg),
    )


def rules(cfg: Any, supported: bool) -> list[tuple[str, ...]]:
    """``(field, rule, fix, *fields it reads)`` for each MoE / expert-parallel problem; ``supported``: the family's
    ``Supports.moe``."""
    m, p = cfg.model, cfg.parallel
    moe = m.moe
    ep, tp = max(p.expert_parallel, 1), p.tensor_parallel
    out: list[tuple[str, ...]] = []
    E = "model.moe.num_experts"
    if not is_moe(cfg):
        if ep > 1:
            out.append(("parallel.expert_parallel", f"expert parallelism {ep} needs experts (model.moe.num_experts is 0)",
                        "set expert_parallel: 1, or model.moe.num_experts > 0", E))
        if p.expert_tensor_parallel not in (None, tp):
            out.append(("parallel.expert_tensor_parallel", "expert tensor parallelism needs experts (model.moe.num_experts is 0)",
                        "leave expert_tensor_parallel unset", E, "parallel.tensor_parallel"))
        return out
    if not supported:
        out.append((E, f"the {m.arch} family has no mixture-of-experts layers", "set num_experts: 0 (experts: a gpt model)",
                    "model.arch"))
        return out
    if moe.top_k > moe.num_experts:
        out.append(("model.moe.top_k", f"top_k {moe.top_k} is more than num_experts {moe.num_experts}",
                    f"use top_k <= {moe.num_experts}", E))
    elif moe.top_k == 1 and not moe.router_pre_softmax:
        out.append(("model.moe.router_pre_softmax", "top-1 routing with the softmax after the top-k gives every token weight 1 "
                    "(megatron refuses it)", "set router_pre_softmax: true for top-1 routing", "model.moe.top_k"))
    if moe.num_experts % ep:
        ok = [str(x) for x in range(1, moe.num_experts + 1) if moe.num_experts % x == 0]
        out.append(("parallel.expert_parallel", f"num_experts {moe.num_experts} is not divisible by expert_parallel {ep}",
                    f"use an expert_parallel dividing the experts: one of {', '.join(ok)}", E))
    etp = expert_tensor_parallel(cfg)
    out.extend((q.field, q.rule, q.fix, *q.reads) for q in Layout.of(cfg).expert_problems())  # world % (ETP x EP x PP)
    if tp > 1 and not p.sequence_parallel:
        out.append(("parallel.sequence_parallel", f"MoE layers with tensor_parallel {tp} train only with sequence parallelism "
                    "(megatron's MoELayer refuses otherwise)", "set sequence_parallel: true", "parallel.tensor_parallel"))
    if m.add_bias_linear:
        out.append(("model.add_bias_linear", "megatron 0.19's experts cannot take linear biases here: it asserts expert TP 1, "
                    "and at TP = EP = 1 its expert MLP adds the fc2 bias in place on an autograd view (training fails)",
                    "set add_bias_linear: false (Mixtral, Qwen3-MoE and OLMoE have no biases)"))
    if expert_ffn(cfg) % etp:
        out.append(("model.moe.ffn_hidden_size", f"expert ffn size {expert_ffn(cfg)} is not divisible by expert_tensor_parallel {etp}",
                    f"use an expert ffn size that is a multiple of {etp}", "parallel.expert_tensor_parallel",
                    "parallel.tensor_parallel", "model.ffn_hidden_size"))
    if shared_ffn(cfg) % tp:
        out.append(("model.moe.shared_expert_ffn_hidden_size", f"shared experts' ffn size {shared_ffn(cfg)} is not divisible "
                    f"by tensor_parallel {tp}", f"use a shared expert size that is a multiple of {tp}", "model.moe.shared_experts",
                    "parallel.tensor_parallel", "model.moe.ffn_hidden_size"))
    if moe.shared_expert_gate and not moe.shared_experts:
        out.append(("model.moe.shared_expert_gate", "a shared-expert gate needs shared experts", "set shared_experts >= 1, "
                    "or shared_expert_gate: false", "model.moe.shared_experts"))
    if moe.pad_to_capacity and moe.capacity_factor is None:
        out.append(("model.moe.pad_to_capacity", "padding to capacity needs a capacity (capacity_factor is null: dropless)",
                    "set capacity_factor (e.g. 1.25) or pad_to_capacity: false", "model.moe.capacity_factor"))
    if p.recompute == "selective":
        out.append(("parallel.recompute", "selective recompute rebuilds the dense MLP; an MoE layer has none to rebuild",
                    "use recompute: full, or none", E))
    return out
