"""The top-k router of the workbench's MoE layers (``KernelChoice.moe_router == "workbench"``): megatron's
``TopKRouter`` whose routing maths after the gating GEMM is one function, compiled on the GPU.

Megatron's router runs, per layer and micro-batch, the z-loss (logsumexp, square, mean, an attach op, a tracker
update), the top-k with its softmax and two scatters (the dense probabilities, the bool routing map), then for the
load-balancing loss a second softmax, a second top-k and scatter, the counts per expert, the Switch loss, a second
attach op and tracker update: some 30 small kernels forward and 20 backward, each a Python call (issue #51: the
``moe-research`` preset is host-bound).  Here :func:`route` does the same maths -- op for op megatron's, in its
order, so on the CPU (eager) the probabilities, the routing map, both losses, the logged values and the gradients
of the gating weight and input are bitwise megatron's -- and is ``torch.compile``d where the workbench compiles
(training on CUDA, ``compiled_layer.compiling()``): a few fused kernels each way.  Outside it stay the gating GEMM
(megatron's ``router_gating_linear``), one ``MoEAuxLossAutoScaler`` attach of both losses (their sum: its backward
gives each loss the same gradient as megatron's two attaches) and megatron's metrics tracker (the same records).

- The load-balancing loss's top-k is megatron's second one, on the softmax of all logits.  With the softmax before
  the top-k (``moe_router_pre_softmax``) that is the routing's own top-k of the same softmax (bitwise the same
  map, so it is reused); after the top-k (``moe-research``) the routing picks by the logits, and two logits a few
  ulps apart can round to one softmax value, where megatron's second top-k may break the tie the other way: the
  second top-k stays, inside the compiled graph.
- The counts per expert of the routing map (``routing_map.sum(0)``, computed in the graph) go to the workbench's
  token dispatcher (:class:`workbench.backend.moe_dispatch.LocalTokenDispatcher`), which would count them again.
- Anything else goes to megatron's ``TopKRouter.forward`` (:attr:`WorkbenchRouter.refusal` says why, for the
  whole model; a forward with a padding mask for that forward): other score functions or load-balancing types
  (sinkhorn, quantile, seq / global aux loss, several losses), grouped top-k, expert bias, TE's fused router,
  capacity factors, input jitter, forced balancing, routing replay, MTP layers, TP x CP > 1.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from workbench.backend import compiled_layer

__all__ = ["WorkbenchRouter", "route", "refusal"]


def route(logits: torch.Tensor, topk: int, pre_softmax: bool, scaling: float | None, z_coeff: float | None,
          aux_coeff: float, per_token: bool, sort: bool):
    """Megatron's routing of ``[tokens, experts]`` gating logits (``TopKRouter.routing`` with softmax scores):
    ``(probs, routing_map, counts, attached, z_logged, aux_logged)``: the dense probabilities and bool map, the
    tokens per expert of the map, the losses to attach (z-loss + load-balancing loss, each times the tokens where
    ``per_token``; None without either), and the values megatron's tracker records (None where off).
    ``z_coeff``: None without z-loss; ``aux_coeff``: 0 without the load-balancing loss; ``sort``: megatron's
    ``sorted=torch.is_grad_enabled()``."""
    tokens, experts = logits.shape
    z = z_logged = aux = aux_logged = None
    routed = logits
    if z_coeff is not None:
        z = torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_coeff  # moe_utils.z_loss_func
        z_logged = z / z_coeff
        # megatron attaches the z-loss to the logits: the routing's gradients are summed there before the
        # z-loss's is added.  A view keeps that order (eager; the compiled graph sums in its own order)
        routed = logits.view_as(logits)
    if pre_softmax:  # moe_utils.topk_routing_with_score_function
        scores = torch.softmax(routed, dim=-1, dtype=torch.float32)
        probs, top = torch.topk(scores, k=topk, dim=1, sorted=sort)
    else:
        scores, top = torch.topk(routed, k=topk, dim=1, sorted=sort)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if scaling:
        probs = probs * scaling
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top, 1).bool()
    counts = routing_map.sum(dim=0)
    if aux_coeff:  # moe_utils.compute_routing_scores_for_aux_loss, switch_load_balancing_loss_func
        aux_scores = torch.softmax(routed, dim=-1, dtype=torch.float32)
        if pre_softmax:  # the same top-k of the same softmax: megatron's second map is the routing map
            aux_counts = counts
        else:
            _, aux_top = torch.topk(aux_scores, k=topk, dim=1)
            aux_counts = torch.zeros_like(logits).int().scatter(1, aux_top, 1).bool().sum(dim=0)
        aux = torch.sum(aux_scores.sum(dim=0) * aux_counts) * (experts * aux_coeff / (topk * tokens * tokens))
        aux_logged = aux / aux_coeff
    attached = None
    for loss in (z, aux):
        if loss is not None:
            loss = loss * tokens if per_token else loss
            attached = loss if attached is None else attached + loss
    return routing_probs, routing_map, counts, attached, z_logged, aux_logged


@functools.lru_cache(maxsize=None)
def _route_compiled():
    """:func:`route` compiled (for training on CUDA where the kernel rule's paths compile:
    ``compiled_layer.set_compile``); the tokens per micro-batch are fixed, so static shapes."""
    return torch.compile(route, dynamic=False)


def refusal(router: Any) -> str | None:
    """Why :func:`route` cannot stand for megatron's routing of ``router`` (a ``TopKRouter``); None: it can."""
    c = router.config
    lb = c.moe_router_load_balancing_type
    reasons = (
        (lb not in ("aux_loss", "none"), f"load balancing {lb!r}"),
        (isinstance(c.moe_aux_loss_coeff, (list, tuple)), "several aux-loss coefficients"),
        (c.moe_router_score_function != "softmax", f"score function {c.moe_router_score_function!r}"),
        (c.moe_router_num_groups is not None or c.moe_router_group_topk is not None, "grouped top-k"),
        (c.moe_router_enable_expert_bias, "expert bias"),
        (c.moe_router_fusion, "TE's fused router"),
        (c.moe_expert_capacity_factor is not None, "a capacity factor"),
        (c.moe_input_jitter_eps is not None, "input jitter"),
        (c.moe_router_force_load_balancing or c.moe_router_force_biased is not None, "forced balancing"),
        (c.moe_enable_routing_replay, "routing replay"),
        (router.is_mtp_layer, "an MTP layer"),
        (router.tp_cp_group.size() != 1, "TP x CP > 1"),
    )
    return next((why for bad, why in reasons if bad), None)


class WorkbenchRouter(TopKRouter):
    """megatron's ``TopKRouter`` (same parameters, state dict, gating GEMM) whose routing is :func:`route`; see the
    module docstring.  :attr:`last` names the router that ran the latest forward ("workbench" | "megatron")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusal = refusal(self)
        self.last = ""
        # (routing map, its counts per expert) of the latest forward, for the dispatcher (taken by
        # :meth:`take_counts`, so held for one forward at most)
        self._counts: tuple[torch.Tensor, torch.Tensor] | None = None

    def take_counts(self, routing_map: torch.Tensor) -> torch.Tensor | None:
        """``routing_map.sum(0)`` where this router computed it for this map (once); else None."""
        held, self._counts = self._counts, None
        return held[1] if held is not None and held[0] is routing_map else None

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):  # noqa: D102
        if self.refusal is not None or padding_mask is not None:
            self.last = "megatron"
            return super().forward(input, padding_mask)
        self.last = "workbench"
        c = self.config
        logits = self.gating(input).view(-1, c.num_moe_experts)
        training = self.training and torch.is_grad_enabled()
        z_coeff = c.moe_z_loss_coeff if training else None  # / tp_cp size, which is 1
        aux_coeff = self.get_aux_loss_coeff("aux_loss") if training else 0.0
        aux_coeff = aux_coeff if aux_coeff > 0 else 0.0  # megatron's is_aux_loss_enabled
        compiled = logits.is_cuda and torch.is_grad_enabled() and compiled_layer.compiling()
        fn = _route_compiled() if compiled else route
        probs, routing_map, counts, attached, z_logged, aux_logged = fn(
            logits, self.topk, bool(c.moe_router_pre_softmax), c.moe_router_topk_scaling_factor, z_coeff, aux_coeff,
            bool(self.calculate_per_token_loss), torch.is_grad_enabled())
        layers = c.num_layers + (c.mtp_num_layers or 0)
        tracker = get_moe_metrics_tracker()
        if z_logged is not None:
            tracker.record("z_loss", z_logged, self.layer_number, layers, avg_group=self.tp_dp_cp_group)
        if aux_logged is not None:
            tracker.record("load_balancing_loss", aux_logged, self.layer_number, layers, reduce_group=self.tp_cp_group,
                           needs_dp_avg=True)
        if attached is not None:
            probs = MoEAuxLossAutoScaler.apply(probs, attached)
        self._counts = (routing_map, counts)
        return probs, routing_map
