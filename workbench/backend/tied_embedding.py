"""A tied input embedding and LM head at TP = 1 whose shared weight's gradient goes straight into megatron DDP's
fp32 ``main_grad`` (part of ``KernelChoice.wgrad_fused``).

Stock, each micro-batch's backward makes two bf16 gradients of the ``[vocab, hidden]`` weight -- the LM head's GEMM and
the embedding's dense scatter (a zero fill of the whole matrix first) -- sums them in bf16 and then adds the sum
into ``main_grad``: Llama-3.2-1B (vocabulary 128,256) spent 4.3 ms of an H200 step on the fill and the two adds,
besides the bf16 rounding of each part.  Here (:func:`install`):

- the LM head (``output_layer._forward_impl``) multiplies through :func:`workbench.backend.grad_accumulation.linear`:
  its weight gradient is added into ``main_grad`` inside the GEMM (``beta = 1``), an unwritten placeholder handed to
  autograd so that DDP's hook still fires and drops it;
- the embedding lookup's backward adds its rows' gradients into ``main_grad`` (``index_put_`` with accumulate, in
  fp32: the ``tokens x hidden`` rows, not the vocabulary) and hands autograd nothing.

Where a forward runs without grad (evaluation, generation) both are the stock calls.  Elsewhere (TP > 1, pipeline
stages that hold only one of the two, untied heads, megatron's ``deterministic_mode``, a model with a sequence
classifier whose forward skips the head) nothing is installed.  Installed for the life of the model (the trainer's).
"""

from __future__ import annotations

import types
from typing import Any, Iterable

import torch
import torch.nn.functional as F

from workbench.backend.grad_accumulation import MainGradWeight, fused_weight, linear

__all__ = ["install"]


class _LookupIntoMainGrad(torch.autograd.Function):
    """``F.embedding(ids, w)`` whose backward adds the rows' gradients into ``main_grad`` and returns none for ``w``."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w: torch.Tensor, main_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.main_grad = main_grad  # (not saved: a view of DDP's buffer, whose version every add into it moves)
        return F.embedding(ids, w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        (ids,) = ctx.saved_tensors
        mg = ctx.main_grad
        # index_put_ with accumulate: on CUDA a sort and an ordered sum per row (deterministic, unlike index_add_'s
        # atomics); no host sync, so the step graph records it
        mg.index_put_((ids.reshape(-1),), g.reshape(-1, g.shape[-1]).to(mg.dtype), accumulate=True)
        return None, None, None


def _lookup(self: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
    """``VocabParallelEmbedding.forward`` at TP = 1 (bound to the module)."""
    w = self.weight
    if getattr(w, "main_grad", None) is None or not (torch.is_grad_enabled() and w.requires_grad):
        return F.embedding(input_, w)
    return _LookupIntoMainGrad.apply(input_, w, w.main_grad)


def _lm_head(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, **_: Any) -> torch.Tensor:
    """``output_layer._forward_impl`` at TP = 1 (megatron's other arguments: its all-reduce and sequence-parallel
    switches, off at TP = 1, and its deferred-wgrad buffers, unused here)."""
    w = fused_weight(weight)  # (sets megatron's grad_added_to_main_grad for DDP's hook)
    return linear(input, w, bias) if isinstance(w, MainGradWeight) else F.linear(input, weight, bias)


def install(ddp_chunks: Iterable[Any]) -> int:
    """On each DDP-wrapped chunk that holds both ends of a tied embedding at TP = 1: the LM head and the lookup as
    above, the shared weight marked so that no other hook adds its ``.grad`` (call before
    :func:`workbench.backend.grad_accumulation.install`).  How many chunks got it."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
    from megatron.core.utils import unwrap_model

    n = 0
    for chunk in ddp_chunks:
        gpt = unwrap_model(chunk)
        emb = getattr(getattr(gpt, "embedding", None), "word_embeddings", None)
        head = getattr(gpt, "output_layer", None)
        c = gpt.config
        if not (getattr(gpt, "share_embeddings_and_output_weights", False) and gpt.pre_process and gpt.post_process
                and type(emb) is VocabParallelEmbedding and type(head) is ColumnParallelLinear
                and c.tensor_model_parallel_size == 1 and getattr(emb, "gtp_remat_size", 1) == 1
                and not getattr(emb, "reduce_scatter_embeddings", False) and not emb.deterministic_mode
                and not c.defer_embedding_wgrad_compute
                # a model whose training forward may skip the head (a sequence classifier on the encoder): its
                # lookup alone would leave the weight without the placeholder that DDP's hook expects
                and getattr(gpt, "classifier", None) is None):
            continue
        w = emb.weight
        if getattr(w, "main_grad", None) is None or not hasattr(w, "grad_added_to_main_grad"):
            continue
        emb.forward = types.MethodType(_lookup, emb)
        head._forward_impl = _lm_head
        w.zero_out_wgrad = False  # (megatron's DDP hook would add the placeholder whatever the flag says)
        w._workbench_wgrad_fused = True  # (grad_accumulation.install leaves it alone)
        n += 1
    return n
