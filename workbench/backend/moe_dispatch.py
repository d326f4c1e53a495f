"""The token permutation of an MoE layer whose tokens never leave the rank (``KernelChoice.moe_dispatch ==
"workbench"``: expert parallel 1, tensor parallel 1, dropless top-k, no shared-expert overlap).

Megatron's all-to-all dispatcher runs the general case at any size: it permutes the tokens by expert
(``index_select``; its backward is an ``index_add`` whose bf16 atomics took 70 ms a step on moe-research, one
H200), "sorts" the permuted tokens and probabilities by local expert and back (with one EP rank an identity
permutation, still a 64-way ``split`` + ``cat`` each time: 55 ms of device time and ~60 ms of host time a step),
copies the counts per expert to the host and waits for them, and un-permutes with a bf16 ``scatter_add``
(32 ms).  (``bench/results/moe_profile.jsonl``.)  Where nothing crosses a rank this dispatcher does the same
maths with gathers only:

- the permutation is megatron's own (:func:`megatron.core.transformer.moe.moe_utils.permute`'s argsort: expert
  by expert, tokens in order within an expert), so the experts see the same rows in the same order;
- every token is routed to exactly ``top_k`` experts (dropless), so un-permuting is a gather of each token's
  ``top_k`` rows and a sum (in fp32, rounded once; megatron's scatter-add rounds after each bf16 add), and the
  permutation's backward is the same gather-and-sum: no atomics, deterministic;
- the counts per expert stay on the device (the grouped GEMM takes its group offsets from there): no host sync.

A forward with a padding mask (rows routed to fewer than ``top_k`` experts) goes through megatron's dispatcher.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

__all__ = ["LocalTokenDispatcher", "WorkbenchMoELayer", "routing_indices"]


def routing_indices(routing_map: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, slots, flat)`` of a ``[tokens, experts]`` routing map with ``top_k`` experts a token: ``rows[i]``
    the token in permuted row ``i`` (megatron's ``sorted_indices``), ``slots`` the permuted rows of each token in
    token order (``[tokens * top_k]``: token ``t``'s rows are ``slots[t*k:(t+1)*k]``, by expert), ``flat`` each
    permuted row's index into the expert-major ``[experts * tokens]`` flattening (for the probabilities)."""
    tokens = routing_map.shape[0]
    flat = routing_map.t().reshape(-1).argsort(descending=True, stable=True)[: tokens * top_k]
    rows = flat % tokens
    slots = rows.argsort(stable=True)
    return rows, slots, flat


class _Permute(torch.autograd.Function):
    """``x[rows]``; backward: each token's gradient is the sum of its ``k`` rows' (a gather, no atomics)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.k = k
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (slots,) = ctx.saved_tensors
        return _sum_rows(grad, slots, ctx.k), None, None, None


class _Unpermute(torch.autograd.Function):
    """Each token's output is the sum of its ``k`` rows; backward: each row's gradient is its token's (a gather)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(rows)
        return _sum_rows(y, slots, k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None, None


def _sum_rows(y: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    return y.index_select(0, slots).view(slots.numel() // k, k, y.shape[-1]).sum(1, dtype=torch.float32).to(y.dtype)


class LocalTokenDispatcher:
    """The dispatcher interface :class:`MoELayer` calls (``dispatch_preprocess`` ... ``combine_postprocess``) for
    tokens that stay on the rank; see the module docstring."""

    shared_experts = None

    def __init__(self, config: Any) -> None:
        self.config = config
        self.top_k = config.moe_router_topk
        self.routing_map = None

    def set_shared_experts(self, shared_experts: Any) -> None:  # noqa: D102 (the overlap is refused by the rule)
        raise ValueError("the workbench's local dispatcher does not overlap shared experts")

    def get_expert_zero_copy_buffers(self):  # noqa: D102
        return None, None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Tokens and their probabilities permuted by expert (``[tokens * top_k, hidden]``, ``[tokens * top_k]``)."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        x = hidden_states.view(-1, hidden_states.shape[-1])
        self.rows, self.slots, flat = routing_indices(routing_map, self.top_k)
        self.tokens_per_expert = routing_map.sum(dim=0)
        permuted_probs = probs.t().reshape(-1).index_select(0, flat)
        return _Permute.apply(x, self.rows, self.slots, self.top_k), permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: D102 (nothing to send)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):  # noqa: D102
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Each token's ``top_k`` expert outputs summed, in the input's shape."""
        out = _Unpermute.apply(hidden_states, self.rows, self.slots, self.top_k)
        self.rows = self.slots = None
        return out.view(self.hidden_shape)


class WorkbenchMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`LocalTokenDispatcher` where the kernel rule's ``moe_dispatch`` is
    ``"workbench"`` (the config's ``workbench_kernels``); megatron's dispatcher otherwise, and for a forward with a
    padding mask."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._megatron_dispatcher = self.token_dispatcher
        kernels = getattr(config, "workbench_kernels", None)
        if getattr(kernels, "moe_dispatch", "") == "workbench" and self.token_dispatcher.shared_experts is None:
            self.token_dispatcher = LocalTokenDispatcher(config)
        self._local_dispatcher = self.token_dispatcher

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None):  # noqa: D102
        self.token_dispatcher = self._megatron_dispatcher if padding_mask is not None else self._local_dispatcher
        return super().forward(hidden_states, intermediate_tensors, padding_mask)
