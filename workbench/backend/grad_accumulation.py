"""Weight gradients into megatron DDP's fp32 ``main_grad``: the workbench's accumulation (``KernelChoice.grad_accumulation``).

Megatron's DDP adds every parameter's bf16 ``.grad`` into its fp32 ``main_grad`` in a hook on the parameter's
gradient accumulator, once per micro-batch: ``main_grad.add_(grad)``.  With mixed dtypes torch runs that add
through its unvectorised element-wise kernel (Llama-3.2-1B on an H100: 392 adds, 21.9 ms per step, ~2.3 TB/s;
Llama-3.2-3B: 56 ms).  Here a hook that runs before megatron's (a tensor post-accumulate hook runs inside the
accumulator, the node hooks megatron registers after it) does the same sum itself and sets megatron's own
``grad_added_to_main_grad`` flag, so megatron's hook skips its add and goes on as usual (``.grad = None``, the
bucket's grad-ready count):

- the first accumulation of a step *copies* (megatron's ``zero_grad_buffer`` zeroed ``main_grad`` and reset the
  flag at the step's start, so ``0 + g`` is ``g``): 6 bytes per element instead of 10;
- later ones add (the same fp32 sum of the bf16 value);
- both in one vectorised Triton kernel on CUDA (H200, 262M elements: the add at 4.2 TB/s against torch's 2.9,
  bit-equal: ``bench/grad_accumulation_probe.py``), torch's ``copy_`` / ``add_`` elsewhere.

Only on parameters of :data:`MIN_NUMEL` elements or more: each hook call launches the Triton kernel through its Python
path (~30 us of host time), and it saves ~1.1 ps of device time an element over torch's add (derived from the probe's
bandwidths, 10 bytes an element at 4.17 against 2.85 TB/s: ~5 us at 4M elements).  BERT-base's step called it 1,264
times, mostly on biases and norms of under a million elements, and its host-bound step paid ~100 ms for it
(cProfile, ``bench/results/bert_train.jsonl``).  Below the bound megatron's own hook adds (one C++ launch); above it
(Llama's and GPT's projection matrices, the embeddings) the kernel's bandwidth is what a device-bound step gains,
and its launch is hidden behind device work (in a host-bound step it is about break-even there).

Not installed where megatron's own CUDA graphs run TE's layer (they accumulate into ``main_grad`` inside the
graph and read the flag), and idle while megatron captures (its hook skips those too).  Inside the workbench's step
graph (``workbench.backend.step_graph``) it runs, and is recorded with the step: each step's zeroing resets the flag
before the replay, so the recorded copy-then-add order is each step's.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional

import torch

__all__ = ["install", "install_experts", "accumulate", "wgrad_into", "MainGradWeight", "linear", "MIN_NUMEL",
           "EXPERT_PATHS"]

#: the smallest parameter (elements) that gets the workbench's hook; smaller ones keep megatron's add (see above)
MIN_NUMEL = 1 << 22

#: :func:`install_experts`'s paths, in words (:class:`workbench.backend.moe_experts._MainGradSink`)
EXPERT_PATHS = {
    "strided": "one add a stack into a strided view of DDP's grad buffer (one Triton kernel on CUDA, reading the "
               "stacked gradient in reverse where the buffer holds the experts in reverse order, as megatron's does)",
    "foreach": "the stacked gradient cast to main_grad's dtype, one multi-tensor foreach add",
    "per-tensor": "one foreach call of mixed dtypes, an add kernel per expert weight",
}

_KERNEL = None


def _triton_kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _add_into_fp32(acc_ptr, g_ptr, n, FIRST: tl.constexpr, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
            if not FIRST:  # FIRST: acc is zero, so the sum is g (no read of acc)
                g += tl.load(acc_ptr + offs, mask=mask)
            tl.store(acc_ptr + offs, g, mask=mask)

        _KERNEL = _add_into_fp32
    return _KERNEL


def accumulate(main_grad: torch.Tensor, grad: torch.Tensor, first: bool) -> None:
    """``main_grad += grad`` (``first``: ``main_grad`` is zero, so copy)."""
    if (main_grad.is_cuda and main_grad.dtype == torch.float32 and grad.dtype in (torch.bfloat16, torch.float16)
            and main_grad.is_contiguous() and grad.is_contiguous() and main_grad.numel() == grad.numel()):
        n, block = main_grad.numel(), 4096
        _triton_kernel()[(-(-n // block),)](main_grad, grad, n, FIRST=first, BLOCK=block)
    elif first:
        main_grad.copy_(grad.view_as(main_grad))
    else:
        main_grad.add_(grad.view_as(main_grad))


def wgrad_into(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    """``main_grad += grad_out^T @ inp`` for a linear layer's weight ``[out, in]``, the product of the 16-bit
    operands accumulated in fp32 and added to the fp32 ``main_grad`` inside the GEMM (cuBLAS's ``beta = 1``:
    ``addmm`` with ``out_dtype``), so no 16-bit weight gradient is written and no add runs after it (megatron's
    ``gradient_accumulation_fusion``, which needs apex's or TE's extension, does the same).  ``grad_out`` is
    ``[tokens, out]`` and ``inp`` ``[tokens, in]`` (any leading shape, flattened).  Elsewhere (CPU, other dtypes)
    the same sum in fp32 through torch's ``addmm_``.  One opaque op (``workbench::wgrad_into``) to ``torch.compile``:
    inductor would split the GEMM from its add (its decomposition of ``addmm`` with ``out_dtype``)."""
    torch.ops.workbench.wgrad_into(main_grad, grad_out.reshape(-1, grad_out.shape[-1]), inp.reshape(-1, inp.shape[-1]))


@torch.library.custom_op("workbench::wgrad_into", mutates_args=("main_grad",))
def _wgrad_into(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    if main_grad.is_cuda and main_grad.dtype == torch.float32 and g.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, g.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))


@_wgrad_into.register_fake
def _(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    return None


class MainGradWeight(NamedTuple):
    """A linear layer's weight ``w`` [out, in] whose gradient :func:`linear` adds into ``main_grad`` (megatron DDP's
    fp32 buffer view) inside the backward (``KernelChoice.wgrad_fused``: the compiled layer's GEMMs)."""

    w: torch.Tensor
    main_grad: torch.Tensor


class _WgradIntoMainGrad(torch.autograd.Function):
    """``x @ w.T`` whose backward adds the weight gradient into ``main_grad`` (:func:`wgrad_into`) and hands autograd
    an unwritten placeholder for ``w`` (megatron's fused accumulation does the same): DDP's hook still fires on it
    (a bucket's readiness), sees ``grad_added_to_main_grad`` and drops it.  Traced whole by ``torch.compile`` (the
    add is a mutation of a forward input inside the compiled backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.main_grad = main_grad  # (not saved: a view of DDP's buffer, whose version every add into it moves)
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, w = ctx.saved_tensors
        wgrad_into(ctx.main_grad, g, x)
        return g @ w, torch.empty_like(w), None


def linear(x: torch.Tensor, w: MainGradWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, w.w, bias)`` with ``w.w``'s gradient added into ``w.main_grad`` in its GEMM (the bias's through
    autograd as usual)."""
    y = _WgradIntoMainGrad.apply(x, w.w, w.main_grad)
    return y if bias is None else y + bias


def fused_weight(w: torch.Tensor) -> Any:
    """``w`` as a :class:`MainGradWeight` for this micro-batch's forward when its gradient can go straight into
    ``main_grad`` (training with grad on, DDP gave it a ``main_grad``), with megatron's flag set so that DDP's hook
    drops the placeholder ``.grad``; ``w`` itself otherwise (its gradient through ``.grad`` and the hooks)."""
    main_grad = getattr(w, "main_grad", None)
    if main_grad is None or not (torch.is_grad_enabled() and w.requires_grad) or not hasattr(w, "grad_added_to_main_grad"):
        return w
    w.grad_added_to_main_grad = True  # (megatron's zero_grad_buffer clears it at each step's start)
    return MainGradWeight(w, main_grad)


#: megatron's "its own CUDA graphs are capturing" (set by :func:`install`); a torch capture of the whole step
#: (workbench.backend.step_graph) records this hook's kernels with the step instead
_megatron_capturing: Any = None


def _hook(param: torch.Tensor) -> None:
    grad = param.grad
    if grad is None or getattr(param, "main_grad", None) is None or (_megatron_capturing is not None and _megatron_capturing()):
        return  # megatron's hook decides (it skips its captures too)
    accumulate(param.main_grad, grad, first=not param.grad_added_to_main_grad)
    param.grad_added_to_main_grad = True  # megatron's hook now skips its own add


def install(ddp_chunks: Iterable[Any], min_numel: int | None = None) -> int:
    """Register the hook on every parameter of ``min_numel`` elements or more (default :data:`MIN_NUMEL`) that
    megatron's DDP gave a ``main_grad``; how many got it.

    ``zero_out_wgrad`` (megatron sets it on embeddings tied to the output layer in one stage) makes DDP's hook add
    ``.grad`` whatever ``grad_added_to_main_grad`` says; it exists for megatron's fused weight-gradient accumulation,
    whose dummy ``.grad`` must then be zeros.  Without that fusion (the workbench's TransformerConfig never sets
    ``gradient_accumulation_fusion``) ``.grad`` is the real gradient and the flag alone decides, so it is cleared
    here.  A model built so that megatron writes ``main_grad`` itself (fused accumulation, delayed weight
    gradients, megatron's CUDA graphs) is refused: the kernel rule never installs the hook there.
    """
    global _megatron_capturing
    from megatron.core.transformer.cuda_graphs import is_graph_capturing

    _megatron_capturing = is_graph_capturing
    n, least = 0, MIN_NUMEL if min_numel is None else min_numel
    for chunk in ddp_chunks:
        if (why := _megatrons_own(getattr(chunk, "config", None))) is not None:
            raise ValueError(f"grad_accumulation: the model was built with {why}, which adds into main_grad itself; "
                             "the kernel rule gives it grad_accumulation 'megatron'")
        for param in chunk.module.parameters():
            if not (param.requires_grad and getattr(param, "main_grad", None) is not None
                    and hasattr(param, "grad_added_to_main_grad")) or hasattr(param, "_workbench_grad_hook") \
                    or param.numel() < least or getattr(param, "_workbench_wgrad_fused", False):
                continue  # (a second install would add twice; a small one: megatron's hook adds it; a fused one:
                #            its GEMM adds it, :func:`linear`)
            param.zero_out_wgrad = False
            param._workbench_grad_hook = param.register_post_accumulate_grad_hook(_hook)
            n += 1
    return n


def install_experts(ddp_chunks: Iterable[Any]) -> dict[str, int]:
    """Let grouped-GEMM expert layers add their weights' gradients into ``main_grad`` themselves
    (:attr:`workbench.backend.moe_experts.GroupedGemmMLP.main_grad_direct`: per layer and micro-batch one ``add_`` of
    each stacked gradient into a strided view of DDP's buffer, instead of DDP's add in a hook per expert weight; the
    weights are not reached by autograd, so their accumulators and hooks do not run); how many layers take each path (``{"strided": 16}``; the paths:
    :class:`workbench.backend.moe_experts._MainGradSink`, laid out here once).  Only where DDP's hook does nothing
    else: not with ``overlap_grad_reduce`` (the hook counts each parameter into its bucket's readiness there), not
    where megatron writes ``main_grad`` itself (:func:`install`'s refusal), and not on layers of one local expert
    (they run megatron's SequentialMLP)."""
    paths: dict[str, int] = {}
    for chunk in ddp_chunks:
        if _megatrons_own(getattr(chunk, "config", None)) is not None or chunk.ddp_config.overlap_grad_reduce:
            continue
        for module in chunk.module.modules():
            weights = [p for p in module.parameters() if p.requires_grad]
            if hasattr(module, "main_grad_direct") and getattr(module, "num_local_experts", 0) > 1 and weights and all(
                    getattr(p, "main_grad", None) is not None for p in weights):
                module.main_grad_direct = True
                path = module.main_grad_path()
                paths[path] = paths.get(path, 0) + 1
    return paths


def _megatrons_own(config: Any) -> str | None:
    """What in a built model's TransformerConfig makes megatron write main_grad itself (None: nothing)."""
    if config is None:
        return None
    if getattr(config, "gradient_accumulation_fusion", False):
        return "gradient_accumulation_fusion"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute"
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        return f"cuda_graph_impl {config.cuda_graph_impl!r} (megatron's graphs accumulate inside the graph)"
    return None
