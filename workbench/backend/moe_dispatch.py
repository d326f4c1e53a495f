"""The token permutation of an MoE layer without atomics or identity sorts (``KernelChoice.moe_dispatch ==
"workbench"``: tensor parallel 1, dropless top-k, grouped experts, no shared-expert overlap; any expert parallel size).

Megatron's all-to-all dispatcher runs the general case at any size: it permutes the tokens by expert
(``index_select``; its backward is an ``index_add`` whose bf16 atomics took 70 ms a step on moe-research, one
H200), "sorts" the permuted tokens and probabilities by local expert and back (with one EP rank an identity
permutation, still a 64-way ``split`` + ``cat`` each time: 55 ms of device time and ~60 ms of host time a step),
copies the counts per expert to the host and waits for them, and un-permutes with a bf16 ``scatter_add``
(32 ms).  (``bench/results/moe_profile.jsonl``.)  Where nothing crosses a rank this dispatcher does the same
maths with gathers (and, with expert parallelism, the same all-to-all):

- the permutation is megatron's own (:func:`megatron.core.transformer.moe.moe_utils.permute`'s argsort: expert
  by expert, tokens in order within an expert), so the experts see the same rows in the same order;
- every token is routed to exactly ``top_k`` experts (dropless), so un-permuting is a gather of each token's
  ``top_k`` rows and a sum (in fp32, rounded once; megatron's scatter-add rounds after each bf16 add), and the
  permutation's backward is the same gather-and-sum: no atomics, deterministic;
- the counts per expert stay on the device (the grouped GEMM takes its group offsets from there): no host sync on
  one rank;
- with expert parallelism (EP > 1) the permuted tokens are already grouped by destination rank (experts are
  contiguous per rank); the counts are all-gathered over the EP group and read on the host once (the all-to-all's
  split sizes, as megatron reads them), the tokens and probabilities go through one all-to-all each way, and the
  received blocks (by source rank, then local expert) are regrouped by local expert with one gather whose backward
  is the inverse gather (megatron: a ``split`` + ``cat`` of ``EP x local experts`` chunks each way).

A forward with a padding mask (rows routed to fewer than ``top_k`` experts) goes through megatron's dispatcher on one
rank (:class:`WorkbenchMoELayer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from torch.autograd.function import once_differentiable

from workbench.backend import compiled_layer, moe_kernels
from workbench.backend.moe_router import WorkbenchRouter

__all__ = ["LocalTokenDispatcher", "WorkbenchMoELayer", "routing_indices", "regroup_index"]


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


def regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """For received blocks of ``counts[s, e]`` rows ordered by source ``s`` then local expert ``e`` (``[ep, local]``,
    on the device; ``total`` rows in all, known on the host), the gather index that orders them by local expert then
    source: ``out = x[index]``."""
    ep, local = counts.shape
    lengths = counts.t().reshape(-1)  # the target order: expert-major
    src_start = (torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)).view(ep, local).t().reshape(-1)
    tgt_start = torch.cumsum(lengths, 0) - lengths
    shift = torch.repeat_interleave(src_start - tgt_start, lengths, output_size=total)
    return torch.arange(shift.numel(), device=counts.device) + shift


class _Regroup(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; backward: the gradient gathered by the inverse permutation."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with the given split sizes (lists); backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, out_splits: list, in_splits: list) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


class _Permute(torch.autograd.Function):
    """``x[rows]``; backward: each token's gradient is the sum of its ``k`` rows' (a gather, no atomics)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slots)
        ctx.k = k
        return x.index_select(0, rows)

    @staticmethod
    @once_differentiable  # (the CUDA sum is a Triton kernel: no double backward through it)
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


def _gather_sum(y: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    return y.index_select(0, slots).view(slots.numel() // k, k, y.shape[-1]).sum(1, dtype=torch.float32).to(y.dtype)


def _sum_rows(y: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's ``k`` rows of ``y`` (``slots``: their positions, grouped by token) summed in fp32, rounded once:
    on CUDA in the kernel rule's compiled paths (``compiled_layer.compiling``) one Triton kernel
    (:func:`workbench.backend.moe_kernels.gather_sum`; eagerly three kernels and a ``[tokens, k, hidden]`` copy, and
    inductor's fused kernel read at about a fifth of an H200's bandwidth), else :func:`_gather_sum`."""
    if y.is_cuda and compiled_layer.compiling():
        return moe_kernels.gather_sum(y, slots, k)
    return _gather_sum(y, slots, k)


class LocalTokenDispatcher:
    """The dispatcher interface :class:`MoELayer` calls (``dispatch_preprocess`` ... ``combine_postprocess``);
    see the module docstring.  ``megatron``: the layer's own dispatcher, for its EP group and local experts."""

    shared_experts = None
    #: the layer's :class:`workbench.backend.moe_router.WorkbenchRouter`, whose counts per expert it takes
    router = None

    def __init__(self, config: Any, megatron: Any = None) -> None:
        self.config = config
        self.top_k = config.moe_router_topk
        self.routing_map = None
        self.ep_group = getattr(megatron, "ep_group", None)
        self.ep = int(getattr(megatron, "ep_size", 1) or 1)
        self.local = int(getattr(megatron, "num_local_experts", 0))  # (read at EP > 1 only)
        self.first_local = int(megatron.local_expert_indices[0]) if megatron is not None else 0
        # EP > 1 with several local experts: the received rows' regrouping by local expert and its inverse (set by
        # :meth:`_exchange_plan` each forward, cleared by :meth:`combine_postprocess`; None: no regrouping)
        self.regroup: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None

    def set_shared_experts(self, shared_experts: Any) -> None:  # noqa: D102 (the overlap is refused by the rule)
        raise ValueError("the workbench's token dispatch does not overlap shared experts")

    def get_expert_zero_copy_buffers(self):  # noqa: D102
        return None, None

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Tokens and their probabilities permuted by expert (``[tokens * top_k, hidden]``, ``[tokens * top_k]``);
        with EP > 1 also the split sizes and the regrouping of what the all-to-all will bring."""
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        x = hidden_states.view(-1, hidden_states.shape[-1])
        self.rows, self.slots, flat = routing_indices(routing_map, self.top_k)
        counts = self.router.take_counts(routing_map) if self.router is not None else None
        counts = routing_map.sum(dim=0) if counts is None else counts  # (the workbench router counted them)
        if self.ep > 1:
            self._exchange_plan(counts)
        else:
            self.tokens_per_expert = counts
        permuted_probs = probs.t().reshape(-1).index_select(0, flat)
        return _Permute.apply(x, self.rows, self.slots, self.top_k), permuted_probs

    def _exchange_plan(self, counts: torch.Tensor) -> None:
        """All ranks' counts per expert (one all-gather, read on the host once): the all-to-all's split sizes, the
        local experts' token counts and the regrouping of the received blocks."""
        gathered = [torch.empty_like(counts) for _ in range(self.ep)]
        torch.distributed.all_gather(gathered, counts.contiguous(), group=self.ep_group)
        every = torch.stack(gathered)  # [ep, experts]: what each rank routes to each expert
        local = slice(self.first_local, self.first_local + self.local)
        mine = every[:, local]  # [ep, local]: what each rank sends here (a view, on the device)
        me = torch.distributed.get_rank(group=self.ep_group)
        host = every.cpu()  # the one host read (waits for the all-gather)
        self.send_splits = host[me].view(self.ep, self.local).sum(1).tolist()
        self.recv_splits = host[:, local].sum(1).tolist()  # mine's host copy, by source rank
        self.tokens_per_expert = mine.sum(0)
        self.regroup = self.inverse = None
        if self.local > 1:
            self.regroup = regroup_index(mine, sum(self.recv_splits))
            # the inverse permutation (what regroup.argsort() gives: inverse[regroup[i]] = i) in O(n), two launches
            # (an arange and a scatter) instead of a sort
            self.inverse = torch.empty_like(self.regroup).scatter_(
                0, self.regroup, torch.arange(self.regroup.numel(), device=self.regroup.device))

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """To the experts' ranks (EP > 1: one all-to-all each for the tokens and their probabilities)."""
        if self.ep == 1:
            return hidden_states, probs
        return (_AllToAll.apply(hidden_states, self.ep_group, self.recv_splits, self.send_splits),
                _AllToAll.apply(probs, self.ep_group, self.recv_splits, self.send_splits))

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The received tokens ordered by local expert; the local experts' token counts (on the device)."""
        if self.regroup is not None:
            hidden_states = _Regroup.apply(hidden_states, self.regroup, self.inverse)
            probs = _Regroup.apply(probs, self.regroup, self.inverse)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The experts' outputs back in the order they arrived in."""
        if self.regroup is not None:
            hidden_states = _Regroup.apply(hidden_states, self.inverse, self.regroup)
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Back to the tokens' ranks (EP > 1: the reverse all-to-all)."""
        if self.ep == 1:
            return hidden_states
        return _AllToAll.apply(hidden_states, self.ep_group, self.send_splits, self.recv_splits)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Each token's ``top_k`` expert outputs summed, in the input's shape."""
        out = _Unpermute.apply(hidden_states, self.rows, self.slots, self.top_k)
        self.rows = self.slots = self.regroup = self.inverse = self.routing_map = None
        return out.view(self.hidden_shape)


class WorkbenchMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`LocalTokenDispatcher` where the kernel rule's ``moe_dispatch`` is
    ``"workbench"`` (the config's ``workbench_kernels``); megatron's dispatcher otherwise; and the workbench's router
    (:class:`workbench.backend.moe_router.WorkbenchRouter`) where its ``moe_router`` is.  A forward with a padding
    mask (rows routed to fewer than ``top_k`` experts) takes megatron's dispatcher on one rank and is refused under
    expert parallelism (the EP ranks' collectives must match; the workbench's decoders pass no padding mask)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        kernels = getattr(config, "workbench_kernels", None)
        if getattr(kernels, "moe_router", "") == "workbench" and kwargs.get("submodules") is not None:
            kwargs["submodules"] = dataclasses.replace(kwargs["submodules"], router=WorkbenchRouter)
        super().__init__(config, *args, **kwargs)
        self._megatron_dispatcher = self.token_dispatcher
        if getattr(kernels, "moe_dispatch", "") == "workbench":
            self.token_dispatcher = LocalTokenDispatcher(config, self.token_dispatcher)
            if isinstance(self.router, WorkbenchRouter):
                self.token_dispatcher.router = self.router
        self._local_dispatcher = self.token_dispatcher

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors: Any = None, padding_mask: Any = None):  # noqa: D102
        local = self._local_dispatcher
        if padding_mask is not None and isinstance(local, LocalTokenDispatcher):
            if local.ep > 1:
                raise ValueError("an MoE forward with a padding mask under expert parallelism: the workbench's token "
                                 "dispatch needs every token routed to top_k experts")
            local = self._megatron_dispatcher
        self.token_dispatcher = local
        return super().forward(hidden_states, intermediate_tensors, padding_mask)
