"""The mixture-of-experts terms of the transformer stack's shapes: parameters, FLOPs and the planner's memory of MoE layers.

Called by :mod:`workbench.families.common.shapes` where ``model.moe.num_experts`` > 0 (nothing here is read for a
dense model).  An MoE layer is a dense layer whose MLP is megatron's ``MoELayer``:

- parameters: the router (``E x h``), ``E`` experts of ``(2 if gated else 1) x h x f_e + f_e x h`` each, the
  shared experts (``h x f_s`` likewise, plus ``h`` for their gate), no biases (refused with experts).  On a rank
  the experts are split over expert parallelism and expert TP (``E / EP`` experts, ``f_e / ETP`` wide), the rest of
  the layer over TP as a dense layer's; the distributed optimizer shards expert parameters over the expert
  data-parallel group (``world / (ETP x EP x PP)``) and the rest over the dense one.
- FLOPs: megatron's formula with the MLP term ``(top_k x f_e + f_s) / h`` (the router's ``E / h`` is left out, as
  megatron leaves it out).
- activations kept per MoE layer and micro-batch (replacing the dense MLP's ``fc1_output`` / ``act_output``):
  router logits and probabilities (fp32, ``tokens x E``), the expert inputs after dispatch (``R x h``), fc1's
  output (``R x f1_e``), megatron's GLU keeps (silu(gate), the linear half, their product) and the product scaled
  by the routing probability (``4 x R x f_e``; non-gated: 2), the shared experts as a dense MLP of ``f_s``, and for
  the grouped-GEMM experts the stacked expert weights their GEMMs keep (``E_local x f1_e+f_e x h``).  ``R``, the
  routed tokens a rank's experts receive, is ``tokens_local x top_k x ETP`` when balanced.

Imbalance: with EP = 1 every routed token is on the rank whatever the balance, so ``R`` is exact.  With EP > 1 and
dropless routing the plan assumes the busiest rank receives :data:`DROPLESS_IMBALANCE` times the balanced share
(an aux-loss-balanced router's spread; the router dashboard's coefficient of variation shows the real one);
:func:`routed_tokens` also gives the true worst case (every source rank sends each token's ``min(top_k, E_local)``
assignments to one rank), which a plan may be checked against.  With a capacity, a rank receives at most ``capacity_factor``
times the balanced share (each source rank's experts cap at ``capacity`` tokens), the bound used.
"""

from __future__ import annotations

from typing import Any

from workbench.families.common import moe

__all__ = ["DROPLESS_IMBALANCE", "layer_params", "mlp_flops", "shape_fields", "stage_expert_params",
           "apply_activation_terms", "backward_transient", "routed_tokens"]

#: the busiest EP rank's routed tokens over the balanced share, assumed for dropless routing at EP > 1: measured,
#: ``moe-research`` (64 experts, top-8, aux-loss balanced) at EP=2 on two H200s, the allocated peaks over a run's
#: first 30 steps under expandable segments (33.6 / 33.2 GiB, ``evidence/moe_proof.jsonl``, phase planner): this
#: plan is 0.6% / 1.9% over them (reserved -0.3% / +1.5%).  Over only its first 4 steps the busier rank's peak was
#: that of 1.11 times the balanced share: the spread grows as the router trains, so the planner test holds the
#: busiest measured rank to never more than 1% under its plan
DROPLESS_IMBALANCE = 1.25


def layer_params(cfg: Any, attn: int, norms: int) -> tuple[int, int]:
    """(an MoE layer's parameters, of which its routed experts'), the attention part and norms given."""
    m = cfg.model
    h, g = m.hidden_size, 2 if m.gated_mlp else 1
    fe, fs, E = moe.expert_ffn(cfg), moe.shared_ffn(cfg), m.moe.num_experts
    experts = E * (g * h * fe + fe * h)
    shared = (g * h * fs + fs * h + (h if m.moe.shared_expert_gate else 0)) if fs else 0
    return attn + norms + E * h + experts + shared, experts


def mlp_flops(cfg: Any) -> float:
    """An MoE layer's MLP FLOPs term in megatron's units (``12 tokens h^2``): ``(top_k f_e + f_s) / h x gate``."""
    m = cfg.model
    gate = 1.5 if m.gated_mlp else 1.0
    return (m.moe.top_k * moe.expert_ffn(cfg) + moe.shared_ffn(cfg)) / m.hidden_size * gate


def shape_fields(cfg: Any) -> dict[str, Any]:
    """The MoE fields of the planner's ``Shape`` (all zero / off for a dense model)."""
    if not moe.is_moe(cfg):
        return {}
    m, p = cfg.model, cfg.parallel
    etp, ep = moe.expert_tensor_parallel(cfg), max(p.expert_parallel, 1)
    return dict(moe_frac=sum(moe.moe_layers(cfg)) / max(m.num_layers, 1), experts=m.moe.num_experts, ep=ep, etp=etp,
                edp=moe.expert_data_parallel(cfg), top_k=m.moe.top_k, expert_ffn=moe.expert_ffn(cfg),
                shared_ffn=moe.shared_ffn(cfg), capacity_factor=m.moe.capacity_factor or 0.0)


def stage_expert_params(cfg: Any, sh: Any, stage_layers: int) -> tuple[int, int]:
    """(routed-expert parameters of a stage before any split, those on one of its ranks: / (EP x ETP)); the stage's MoE
    layers taken as its share of the model's (exact for ``layer_freq`` 1)."""
    if not sh.moe_frac:
        return 0, 0
    per_layer = layer_params(cfg, 0, 0)[1]
    total = round(sh.moe_frac * stage_layers) * per_layer
    return total, total // (sh.ep * sh.etp)


def routed_tokens(sh: Any) -> tuple[float, float]:
    """(routed tokens one rank's experts receive per MoE layer and micro-batch as planned, the worst case)."""
    local = sh.s * sh.b / (sh.tp if sh.sp else 1)
    balanced = local * sh.top_k * sh.etp
    if sh.ep == 1:
        return balanced, balanced
    worst = local * sh.ep * min(sh.top_k, sh.experts // sh.ep) * sh.etp
    bound = sh.capacity_factor if sh.capacity_factor else DROPLESS_IMBALANCE
    return min(balanced * bound, worst), worst


def _moe_terms(sh: Any, kp: Any) -> dict[str, float]:
    e, t = sh.e, sh.tp
    tsp = t if sh.sp else 1
    tok_local = sh.s * sh.b / tsp
    R, _ = routed_tokens(sh)
    fe = sh.expert_ffn / sh.etp
    gated = sh.swiglu
    f1 = (2 if gated else 1) * fe
    terms = {"router_logits_probs": 2 * 4 * tok_local * sh.experts,
             "expert_input": e * R * sh.h,
             "expert_fc1_output": e * R * f1,
             # megatron's eager activation keeps its intermediates (GLU: silu(gate), the product and its
             # probability-weighted copy); the grouped experts' compiled activation x probability keeps only the
             # weighted product (fc2's input): moe-research on an H200 45.8 GiB at 97953ed against 52.0 at 11ba28f
             "expert_act_output": e * R * fe * (1 if kp.experts == "torch_grouped" else 4 if gated else 2)}
    if sh.shared_ffn:
        fs = sh.shared_ffn / t
        terms["shared_fc1_output"] = e * sh.s * sh.b * (2 if gated else 1) * fs
        terms["shared_act_output"] = e * sh.s * sh.b * fs * (3 if gated else 1)
    if kp.experts == "torch_grouped":
        local = sh.experts // sh.ep
        terms["grouped_weight_stack"] = sh.w * local * (f1 + fe) * sh.h
    return terms


def apply_activation_terms(terms: dict[str, float], sh: Any, kp: Any) -> None:
    """Mix an MoE layer's kept tensors into the stack's per-layer ``terms`` (in place): the dense MLP's intermediates are
    weighted by the dense share of layers, the MoE ones by the MoE share (``layer_freq``)."""
    dense = 1.0 - sh.moe_frac
    for k in ("fc1_output", "act_output"):
        if k in terms:
            terms[k] *= dense
            if not terms[k]:
                del terms[k]
    for k, v in _moe_terms(sh, kp).items():
        terms[k] = sh.moe_frac * v


def backward_transient(sh: Any) -> float:
    """Extra bytes alive while an MoE layer runs backward: the gradients of the expert intermediates (fc1 output,
    activation) and of the dispatched tokens, the all-to-all's send and receive buffers of those gradients."""
    if not sh.moe_frac:
        return 0.0
    R, _ = routed_tokens(sh)
    fe = sh.expert_ffn / sh.etp
    return sh.e * R * ((2 if sh.swiglu else 1) * fe + fe + 2 * sh.h)
