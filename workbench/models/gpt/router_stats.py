"""The router made visible: per MoE layer and expert, what megatron's top-k routers did in a training step.

:class:`RouterMonitor` hooks every ``TopKRouter`` of the rank's model chunks.  In each training forward
(grad enabled: evaluation and the no-grad first pass of full recompute are not counted) it adds, per layer,
the tokens each expert received (``probs > 0`` of the router's routing map: after any capacity, without the
padding of ``pad_to_capacity``) and the assignments asked for (tokens x top_k, before any capacity), as
tensors on the device.  Megatron's own MoE metrics tracker accumulates the load-balancing and z-losses
per layer meanwhile.  After every step :meth:`RouterMonitor.after_step` clears both; on every
``model.moe.router_stats_interval``-th step it first reduces them across all ranks (the counts summed over the
world: pipeline stages hold different layers, TP/DP/EP ranks route different tokens; the losses reduced as
megatron's tracker reduces them) and returns one :class:`workbench.run.events.Router` record of that step.

Cost: on a sampled step one all-reduce of ``num_layers x num_experts`` counts plus megatron's per-metric
all-reduces and one host copy; other steps a ``[tokens, experts]`` comparison and sum per layer and
micro-batch, on the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from workbench.families.common import moe
from workbench.run.events import Router

__all__ = ["RouterMonitor", "step_monitor"]


def _chunk_modules(chunks: list[Any]) -> list[Any]:
    return [m for c in chunks for m in c.modules()]


class RouterMonitor:
    """Counts of one rank's routers, reduced and turned into ``router`` records (see the module docstring)."""

    def __init__(self, cfg: Any, chunks: list[Any]):
        from megatron.core.transformer.moe.router import TopKRouter

        self.cfg = cfg
        self.interval = cfg.model.moe.router_stats_interval
        self.layers = [i for i, on in enumerate(moe.moe_layers(cfg)) if on]
        L, E = cfg.model.num_layers, cfg.model.moe.num_experts
        self.routers = [m for m in _chunk_modules(chunks) if isinstance(m, TopKRouter)]
        dev = self.routers[0].weight.device if self.routers else torch.device("cpu")
        if cfg.parallel.device == "cuda" and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self.counts = torch.zeros(L, E, dtype=torch.long, device=dev)
        self.asked = torch.zeros(L, dtype=torch.long, device=dev)
        self.topk = cfg.model.moe.top_k
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        lb = cfg.model.moe.load_balancing
        self.metrics = {}
        if lb != "none" and cfg.model.moe.aux_loss_coeff > 0:
            self.metrics["load_balancing_loss"] = moe.LOSS_METRICS[lb]
        if cfg.model.moe.z_loss_coeff > 0:
            self.metrics["z_loss"] = moe.LOSS_METRICS["z_loss"]

    def _hook(self, module: Any, _inputs: Any, outputs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()) or module.layer_number is None:
            return
        probs, routing_map = outputs
        i = module.layer_number - 1
        with torch.no_grad():
            self.counts[i] += (routing_map & (probs > 0)).sum(0).to(torch.long)
            self.asked[i] += routing_map.shape[0] * self.topk

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def after_step(self, iteration: int, num_microbatches: int) -> list[Router]:
        """The step's ``router`` record when ``iteration`` is sampled (every rank must call this after every step)."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        tracker = get_moe_metrics_tracker()
        sampled = self.interval > 0 and iteration % self.interval == 0
        losses: dict[str, list[float]] = {}
        if sampled:
            L = self.cfg.model.num_layers
            for name in self.metrics.values():
                tracker.ensure_initialized(name, L, device=self.device)
            tracker._sync_metrics(list(self.metrics.values()))  # megatron's own reduction of its per-layer metrics
            for key, name in self.metrics.items():
                v = tracker.metrics[name].values.float() / max(num_microbatches, 1)
                losses[key] = [float(v[i]) for i in self.layers]
            both = torch.cat([self.counts, self.asked.unsqueeze(1)], dim=1)
            if dist.is_initialized():
                dist.all_reduce(both)
            rows = both.cpu().tolist()
        tracker.clear()
        self.counts.zero_()
        self.asked.zero_()
        if not sampled:
            return []
        per_expert = [rows[i][:-1] for i in self.layers]
        asked = [rows[i][-1] for i in self.layers]
        return [Router(iteration=iteration, layers=list(self.layers), tokens_per_expert=per_expert, assignments=asked,
                       dropped=[a - sum(c) for a, c in zip(asked, per_expert)],
                       load_balancing_loss=losses.get("load_balancing_loss"), z_loss=losses.get("z_loss"))]


def step_monitor(cfg: Any, chunks: list[Any]) -> RouterMonitor | None:
    """The family's per-step monitor for a training run (the trainer calls it with its model chunks): the router
    monitor of an MoE model whose ``router_stats_interval`` is set, else None."""
    if not moe.is_moe(cfg) or cfg.model.moe.router_stats_interval <= 0:
        return None
    return RouterMonitor(cfg, chunks)
