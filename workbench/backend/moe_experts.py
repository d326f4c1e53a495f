"""MoE layers on the workbench's layer: megatron-core's ``MoELayer`` with the experts the kernel rule names.

:func:`moe_mlp` is the ``mlp`` submodule of an MoE transformer layer: megatron's ``MoELayer`` (top-k router,
token dispatcher, shared experts) whose experts are, by :attr:`workbench.kernel_rule.KernelChoice.experts`,

- ``sequential``: megatron's ``SequentialMLP`` (one fc1 / fc2 GEMM pair per local expert, a Python loop);
- ``torch_grouped``: :class:`GroupedGemmMLP`, the same modules and parameters (so the same checkpoints, the same
  conversion names) with all local experts' fc1 in one ``grouped_mm`` and all fc2 in another;
- ``te_grouped``: TE's ``TEGroupedMLP`` (on TE's layer spec, built by the family's spec).

The token permutation (megatron's ``permute`` / ``unpermute``: index_select / scatter_add, unfused without TE)
runs around them as megatron runs it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP

__all__ = ["GroupedGemmMLP", "moe_mlp", "grouped_mm"]


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ weights[g].T`` for each group; ``offs``: the groups' end rows (int32)."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise RuntimeError("this torch has no grouped_mm (torch.nn.functional.grouped_mm / torch._grouped_mm); "
                           "set model.moe.grouped_gemm: false")
    return fn(x, weights.transpose(-2, -1), offs=offs)


class GroupedGemmMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` (same experts, parameters, sharded state dict and names) computed with one
    grouped GEMM per linear over all local experts instead of a loop over them.

    The local experts' weights are stacked per forward (a copy of the rank's expert weights, ~1-3% of an MoE
    layer's time at research scale); their gradients flow back through the stack to each expert's parameter, where
    megatron's DDP hooks collect them as for SequentialMLP.  The maths is :class:`megatron.core.transformer.mlp.MLP`'s
    unfused path (fc1 + bias, activation or GLU, times the routing probability, fc2, bias times the probability)."""

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):  # noqa: D102
        cfg = self.config
        if self.num_local_experts == 1 or cfg.fp8 or cfg.fp4 or cfg.moe_apply_probs_on_input:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.long).to("cpu")
        offs = torch.cumsum(counts, 0).to(device=x.device, dtype=torch.int32)
        experts = self.local_experts
        w1 = torch.stack([e.linear_fc1.weight for e in experts])
        w2 = torch.stack([e.linear_fc2.weight for e in experts])
        b1 = experts[0].linear_fc1.bias
        b2 = experts[0].linear_fc2.bias
        which = None
        if b1 is not None or b2 is not None:
            which = torch.repeat_interleave(torch.arange(len(experts), device=x.device), counts.to(x.device))
        h = grouped_mm(x, w1, offs)
        if b1 is not None:
            h = h + torch.stack([e.linear_fc1.bias for e in experts])[which]
        if cfg.gated_linear_unit:
            gate, lin = torch.chunk(h, 2, dim=-1)
            if (val := cfg.activation_func_clamp_value) is not None:
                gate, lin = gate.clamp(min=None, max=val), lin.clamp(min=-val, max=val)
            h = cfg.activation_func(gate) * (lin + cfg.glu_linear_offset)
        else:
            h = cfg.activation_func(h)
        dtype = h.dtype
        h = (h * permuted_probs.unsqueeze(-1)).to(dtype)
        out = grouped_mm(h, w2, offs)
        if b2 is not None:
            out = out + torch.stack([e.linear_fc2.bias for e in experts])[which] * permuted_probs.unsqueeze(-1)
        return out, None


def moe_mlp(experts: str) -> Any:
    """The ``mlp`` submodule of an MoE layer on megatron's local linears: ``MoELayer`` with ``experts``
    (``sequential`` | ``torch_grouped``) and megatron's shared-expert MLP."""
    spec = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=1, moe_grouped_gemm=False)
    if experts == "torch_grouped":
        subs = spec.keywords["submodules"]
        subs.experts = partial(GroupedGemmMLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                        linear_fc2=RowParallelLinear))
    return spec
