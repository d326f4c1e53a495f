"""MoE layers on the workbench's layer: megatron-core's ``MoELayer`` with the experts the kernel rule names.

:func:`moe_mlp` is the ``mlp`` submodule of an MoE transformer layer: megatron's ``MoELayer`` (top-k router,
token dispatcher, shared experts) whose experts are, by :attr:`workbench.kernel_rule.KernelChoice.experts`,

- ``sequential``: megatron's ``SequentialMLP`` (one fc1 / fc2 GEMM pair per local expert, a Python loop);
- ``torch_grouped``: :class:`GroupedGemmMLP`, the same modules and parameters (so the same checkpoints, the same
  conversion names) with all local experts' fc1 in one ``grouped_mm`` and all fc2 in another;
- ``te_grouped``: TE's ``TEGroupedMLP`` (on TE's layer spec, built by the family's spec).

The layer is :class:`workbench.backend.moe_dispatch.WorkbenchMoELayer`: megatron's, whose token permutation is
the workbench's gathers where no token leaves the rank (``KernelChoice.moe_dispatch``), megatron's dispatcher
otherwise.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

from workbench.backend import compiled_layer

__all__ = ["GroupedGemmMLP", "moe_mlp", "grouped_mm"]


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ weights[g].T`` for each group; ``offs``: the groups' end rows (int32)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm (torch.nn.functional.grouped_mm / torch._grouped_mm); "
                           "set model.moe.grouped_gemm: false")
    return fn(x, weights.transpose(-2, -1), offs=offs)


def _activate_weighted(h: torch.Tensor, probs: torch.Tensor, activation: Any, glu: bool, clamp: Any,
                       offset: float) -> torch.Tensor:
    """The experts' activation (or GLU) times each row's routing probability, in ``h``'s dtype."""
    if glu:
        gate, lin = torch.chunk(h, 2, dim=-1)
        if clamp is not None:
            gate, lin = gate.clamp(min=None, max=clamp), lin.clamp(min=-clamp, max=clamp)
        a = activation(gate) * (lin + offset)
    else:
        a = activation(h)
    return (a * probs.unsqueeze(-1)).to(a.dtype)


@functools.lru_cache(maxsize=None)
def _activate_weighted_compiled(dynamic: bool):
    """:func:`_activate_weighted` compiled (one fused kernel forward and one backward on CUDA, for the
    kernel rule's compiled paths: ``compiled_layer.set_compile``); ``dynamic``: for row counts that change every
    micro-batch (expert parallelism: the rows a rank receives), one graph for all of them."""
    return torch.compile(_activate_weighted, dynamic=dynamic)


class _StackedWeights(torch.autograd.Function):
    """``torch.stack`` of the local experts' weights.  Backward with ``direct`` (the module's
    :attr:`GroupedGemmMLP.main_grad_direct`): the stacked gradient is added into each weight's ``main_grad``
    (megatron DDP's buffer) with one ``torch._foreach_add_`` call and the weights get no ``.grad``: autograd's
    accumulators and DDP's hooks still run for each expert weight, but find no gradient and add nothing.  (Over fp32
    ``main_grad`` and bf16 gradients torch's foreach takes its per-tensor path: one add kernel per weight, as DDP's hook
    launched, from one Python call; moe-research, one H200, ``bench/results/moe_profile.jsonl``.)  Otherwise each
    weight gets its slice."""

    @staticmethod
    def forward(ctx, direct: bool, *weights: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.weights = weights if direct else None
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        weights, ctx.weights = ctx.weights, None
        if weights is None:
            return (None, *grad.unbind(0))
        torch._foreach_add_([w.main_grad for w in weights], list(grad.unbind(0)))
        return (None,) * (len(weights) + 1)


class GroupedGemmMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` (same experts, parameters, sharded state dict and names) computed with one
    grouped GEMM per linear over all local experts instead of a loop over them.

    The local experts' weights are stacked per forward (a copy of the rank's expert weights, ~1-3% of an MoE
    layer's time at research scale); their gradients flow back through the stack to each expert's parameter, where
    megatron's DDP hooks collect them as for SequentialMLP -- or, with :attr:`main_grad_direct`, the stack's
    backward adds them into DDP's ``main_grad`` itself in one call (:class:`_StackedWeights`).  The maths is
    :class:`megatron.core.transformer.mlp.MLP`'s unfused path (fc1 + bias, activation or GLU, times the routing
    probability, fc2, bias times the probability)."""

    #: the weights' gradients go straight into megatron DDP's ``main_grad`` (set by
    #: :func:`workbench.backend.grad_accumulation.install_experts` where DDP's hooks need no ``.grad``)
    main_grad_direct = False

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):  # noqa: D102
        cfg = self.config
        if self.num_local_experts == 1 or cfg.fp8 or cfg.fp4 or cfg.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        # on the device (the workbench's dispatcher keeps them there: no host sync), else copied there
        counts = torch.as_tensor(tokens_per_expert).to(device=x.device, dtype=torch.long)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        experts = self.local_experts
        direct = self.main_grad_direct and torch.is_grad_enabled()
        w1 = _StackedWeights.apply(direct, *(e.linear_fc1.weight for e in experts))
        w2 = _StackedWeights.apply(direct, *(e.linear_fc2.weight for e in experts))
        b1 = experts[0].linear_fc1.bias
        b2 = experts[0].linear_fc2.bias
        which = None
        if b1 is not None or b2 is not None:
            which = torch.repeat_interleave(torch.arange(len(experts), device=x.device), counts, output_size=x.shape[0])
        h = grouped_mm(x, w1, offs)
        if b1 is not None:
            h = h + torch.stack([e.linear_fc1.bias for e in experts])[which]
        # compiled for training on the GPU (generation's shapes change every call: eager there; so is the no-grad
        # first forward of a full recompute, which then recomputes compiled: the same maths, rounded alike up to
        # the fused kernel's order).  One rank: the rows are tokens x top_k, fixed; EP > 1: they vary
        compiled = x.is_cuda and torch.is_grad_enabled() and compiled_layer.compiling()
        act = _activate_weighted_compiled(cfg.expert_model_parallel_size > 1) if compiled else _activate_weighted
        h = act(h, permuted_probs, cfg.activation_func, cfg.gated_linear_unit, cfg.activation_func_clamp_value,
                cfg.glu_linear_offset)
        out = grouped_mm(h, w2, offs)
        if b2 is not None:
            out = out + torch.stack([e.linear_fc2.bias for e in experts])[which] * permuted_probs.unsqueeze(-1)
        return out, None


def moe_mlp(experts: str) -> Any:
    """The ``mlp`` submodule of an MoE layer on megatron's local linears: ``MoELayer`` with ``experts``
    (``sequential`` | ``torch_grouped``) and megatron's shared-expert MLP, as :class:`WorkbenchMoELayer`."""
    from workbench.backend.moe_dispatch import WorkbenchMoELayer

    stock = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=1, moe_grouped_gemm=False)
    spec = partial(WorkbenchMoELayer, *stock.args, **stock.keywords)
    if experts == "torch_grouped":
        subs = spec.keywords["submodules"]
        subs.experts = partial(GroupedGemmMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                        linear_fc2=RowParallelLinear))
    return spec
