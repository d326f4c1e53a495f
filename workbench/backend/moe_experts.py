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


def _strided_view(mains: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, bool] | None:
    """One strided view over the ``main_grad`` tensors of a stack of weights, where they lie in one storage (megatron
    DDP's flat grad buffer) at one uniform distance apart: ``(view, flipped)``, ``view[i]`` the ``i``-th of them in
    storage order (``flipped``: the stack's order reversed, as megatron's buffer places parameters in reverse
    registration order, so expert ``E-1`` lowest); None where they do not (then :class:`_MainGradSink` adds with
    ``foreach``).  Checked on shapes, strides, dtype, device, storage and each row's address."""
    first = mains[0]
    if len(mains) < 2 or first.numel() == 0 or not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    if any(m.shape != first.shape or m.dtype != first.dtype or m.device != first.device or not m.is_contiguous()
           or m.untyped_storage().data_ptr() != storage for m in mains):
        return None
    offsets = [m.storage_offset() for m in mains]
    step = offsets[1] - offsets[0]
    if abs(step) < first.numel() or any(b - a != step for a, b in zip(offsets, offsets[1:])):
        return None  # overlapping, or not one uniform distance apart (padding, a bucket boundary between them)
    flipped = step < 0
    view = first.as_strided((len(mains), *first.shape), (abs(step), *first.stride()), min(offsets))
    rows = view.unbind(0)
    in_order = mains[::-1] if flipped else mains
    if not all(r.data_ptr() == m.data_ptr() and r.shape == m.shape and r.stride() == m.stride()
               for r, m in zip(rows, in_order)):
        return None
    return view, flipped


_ROWS_KERNEL = None


def _rows_kernel():
    """Triton: ``acc[r] += g[r]`` (``FLIP``: ``g[rows - 1 - r]``) for each row ``r`` of a strided fp32 ``acc`` whose rows
    are contiguous ``row_stride`` elements apart, from a contiguous ``g`` of a narrower float: the stacked gradient
    read in reverse where DDP's buffer holds the experts in reverse order, so no flipped copy and a vectorised add
    (torch's mixed-dtype ``add_`` into the strided view takes its unvectorised kernel, and the flip one more pass:
    27 + 16 ms a step of ``moe-research`` on an H200, ``bench/results/moe_profile.jsonl:5``)."""
    global _ROWS_KERNEL
    if _ROWS_KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _add_rows_into_fp32(acc_ptr, g_ptr, n, row_stride, rows, FLIP: tl.constexpr, BLOCK: tl.constexpr):
            r = tl.program_id(1).to(tl.int64)
            src = rows - 1 - r if FLIP else r
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g = tl.load(g_ptr + src * n + offs, mask=mask).to(tl.float32)
            at = acc_ptr + r * row_stride + offs
            tl.store(at, tl.load(at, mask=mask) + g, mask=mask)

        _ROWS_KERNEL = _add_rows_into_fp32
    return _ROWS_KERNEL


def add_rows(view: torch.Tensor, grad: torch.Tensor, flipped: bool, block: int = 4096) -> None:
    """``view[i] += grad[i]`` (``flipped``: ``grad[len - 1 - i]``) in one launch of :func:`_rows_kernel`: ``view`` an
    fp32 stack of contiguous rows at one stride (:func:`_strided_view`), ``grad`` contiguous of the same shape."""
    rows, n = view.shape[0], view[0].numel()
    _rows_kernel()[(-(-n // block), rows)](view, grad, n, view.stride(0), rows, FLIP=flipped, BLOCK=block)


def _rows_fit(view: torch.Tensor, grad: torch.Tensor) -> bool:
    return (view.is_cuda and view.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and grad.is_contiguous() and grad.shape == view.shape and view[0].is_contiguous())


class _MainGradSink:
    """Where the gradient of a stack of expert weights goes: their ``main_grad`` (megatron DDP's buffer), laid out
    once (:func:`_strided_view`) and re-laid out if any weight's ``main_grad`` is replaced.  :attr:`path`:

    - ``strided``: the ``main_grad`` tensors are rows of one strided view of DDP's buffer: one add of the stacked
      gradient into it (on CUDA :func:`add_rows`, one Triton kernel reading the rows in reverse where the buffer holds
      the experts in reverse order; elsewhere ``add_``, after the gradient's ``flip`` there);
    - ``foreach``: elsewhere, where the ``main_grad`` tensors share a dtype at least as wide as the gradient's: the
      gradient cast to it once and one ``torch._foreach_add_`` of equal dtypes (torch's multi-tensor kernel);
    - ``per-tensor``: otherwise ``torch._foreach_add_`` of mixed dtypes (one add kernel per weight).

    Each adds exactly what ``main_grad.add_(grad)`` adds per weight (the same fp32 sum of the same values)."""

    def __init__(self, weights: tuple[torch.Tensor, ...]) -> None:
        self.mains = tuple(w.main_grad for w in weights)
        laid = _strided_view(self.mains)
        self.view, self.flipped = laid if laid is not None else (None, False)
        dtypes = {m.dtype for m in self.mains}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        self.path = "strided" if self.view is not None else "foreach" if self.dtype is not None else "per-tensor"

    def current(self, weights: tuple[torch.Tensor, ...]) -> bool:
        """Whether the weights' ``main_grad`` are still the tensors this was laid out for."""
        return len(weights) == len(self.mains) and all(w.main_grad is m for w, m in zip(weights, self.mains))

    def add(self, grad: torch.Tensor) -> None:
        """``main_grad += grad[i]`` for each weight ``i`` of the stack."""
        if self.view is not None and _rows_fit(self.view, grad):
            add_rows(self.view, grad, self.flipped)
        elif self.view is not None:
            self.view.add_(grad.flip(0) if self.flipped else grad)
        elif self.dtype is not None and torch.promote_types(self.dtype, grad.dtype) == self.dtype:
            torch._foreach_add_(list(self.mains), list(grad.to(self.dtype).unbind(0)))
        else:  # (a main_grad narrower than the gradient: cast first would round twice)
            torch._foreach_add_(list(self.mains), list(grad.unbind(0)))


class _StackedWeights(torch.autograd.Function):
    """``torch.stack`` of the local experts' weights.  Backward with a ``sink`` (the module's
    :attr:`GroupedGemmMLP.main_grad_direct`): the stacked gradient is added into the weights' ``main_grad``
    (megatron DDP's buffer) by :class:`_MainGradSink` -- under DDP one ``add_`` into a strided view of the buffer --
    and the weights, passed in as one tuple (autograd sees no tensor in it) beside an empty ``anchor`` leaf that keeps
    the stack in the graph, are not reached at all: no ``.grad``, no accumulator, no DDP hook, and no per-weight
    ``detach`` or argument for autograd to walk (128 a layer and micro-batch on moe-research).  (Before, one
    ``torch._foreach_add_`` of fp32 ``main_grad`` and bf16 slices, which torch runs per tensor: one add kernel per
    weight, 8,192 a step on moe-research, one H200, ``bench/results/moe_profile.jsonl``.)  Without a sink the weights
    come as arguments and each gets its slice."""

    @staticmethod
    def forward(ctx, sink: "_MainGradSink | None", anchor: "torch.Tensor | None",  # noqa: D102
                *weights: "torch.Tensor | tuple[torch.Tensor, ...]") -> torch.Tensor:
        ctx.sink, ctx.direct = sink, sink is not None
        return torch.stack(weights[0] if sink is not None else weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        if not ctx.direct:
            return (None, None, *grad.unbind(0))
        sink, ctx.sink = ctx.sink, None
        if sink is None:
            raise RuntimeError("a second backward through the experts' weight stack: their gradients went into "
                               "main_grad on the first (megatron's schedules never retain the graph)")
        sink.add(grad)
        return None, None, None


class GroupedGemmMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` (same experts, parameters, sharded state dict and names) computed with one
    grouped GEMM per linear over all local experts instead of a loop over them.

    The local experts' weights are stacked per forward (a copy of the rank's expert weights, ~1-3% of an MoE
    layer's time at research scale); their gradients flow back through the stack to each expert's parameter, where
    megatron's DDP hooks collect them as for SequentialMLP -- or, with :attr:`main_grad_direct`, the stack's
    backward adds them into DDP's ``main_grad`` itself (:class:`_StackedWeights`, :class:`_MainGradSink`: one add
    into a strided view of DDP's buffer).  The maths is
    :class:`megatron.core.transformer.mlp.MLP`'s unfused path (fc1 + bias, activation or GLU, times the routing
    probability, fc2, bias times the probability)."""

    #: the weights' gradients go straight into megatron DDP's ``main_grad`` (set by
    #: :func:`workbench.backend.grad_accumulation.install_experts` where DDP's hooks need no ``.grad``)
    main_grad_direct = False
    #: the fc1 and fc2 stacks' :class:`_MainGradSink` (laid out by :meth:`main_grad_path` or the first direct forward)
    _sinks: "tuple[_MainGradSink, _MainGradSink] | None" = None

    def _stacks(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        experts = self.local_experts
        return tuple(e.linear_fc1.weight for e in experts), tuple(e.linear_fc2.weight for e in experts)

    def _main_grad_sinks(self, stacks: tuple) -> "tuple[_MainGradSink, _MainGradSink]":
        sinks = self._sinks
        if sinks is None or not all(s.current(w) for s, w in zip(sinks, stacks)):
            sinks = self._sinks = tuple(_MainGradSink(w) for w in stacks)
        return sinks

    def main_grad_path(self) -> str:
        """How :attr:`main_grad_direct` adds the stacked weight gradients into ``main_grad`` (laid out now, once):
        ``strided`` (both stacks), ``foreach`` or ``per-tensor`` (:class:`_MainGradSink`; the slower of the two
        stacks' paths)."""
        paths = [s.path for s in self._main_grad_sinks(self._stacks())]
        return next(p for p in ("per-tensor", "foreach", "strided") if p in paths)

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
        stacks = self._stacks()
        if self.main_grad_direct and torch.is_grad_enabled():
            sinks = self._main_grad_sinks(stacks)
            # the weights enter as one tuple, out of autograd's sight: the stack's backward adds into main_grad
            # itself, so nothing reaches their accumulators, and autograd runs neither those nor DDP's hook on each
            # (8,192 a step on moe-research, each adding nothing); a fresh empty leaf keeps the stack in the graph
            anchor = torch.empty(0, device=x.device, requires_grad=True)
            w1 = _StackedWeights.apply(sinks[0], anchor, stacks[0])
            w2 = _StackedWeights.apply(sinks[1], anchor, stacks[1])
        else:
            w1 = _StackedWeights.apply(None, None, *stacks[0])
            w2 = _StackedWeights.apply(None, None, *stacks[1])
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
