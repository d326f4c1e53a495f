"""The language model's loss at TP = 1: per-token cross-entropy over the vocabulary, fp32 log-softmax maths.

megatron's vocab-parallel cross entropy makes ~10 passes over the fp32 up-cast ``[tokens, vocab]`` logits and keeps an
fp32 softmax for backward.  :func:`cross_entropy_sb` is ``F.cross_entropy(logits.float())`` (the compiled layer
compiles it: one fused pass, the softmax recomputed from the bf16 logits in backward) or, with
``KernelChoice.triton_ops``, two hand-written Triton kernels behind one op (``workbench::cross_entropy``,
:func:`torch.library.triton_op`):

- forward: one program a token reads its row of logits once (online max and sum of exponentials, fp32) and writes
  the loss and the log-sum-exp;
- backward: one program a block of a row reads the logits again and writes ``(softmax - onehot) * dloss`` in the
  logits' dtype (one rounding, as the compiled path's cast).

Inductor's fused kernels for the same maths took 1.33 (forward) and 1.26 ms (backward) a micro-batch of Llama-3.2-1B
(8192 tokens x 128,256, bf16; H200), these 0.57 and 1.08 ms: 10.5 against 6.8 ms of the step
(``bench/results/triton_ops_probe.jsonl`` row 4; errors against fp32 equal).  The saved tensors are the compiled
path's (the bf16 logits) plus the log-sum-exp (4 bytes a token).  Labels of ``ignore_index`` (-100, as
``F.cross_entropy``) give a zero loss and gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["register", "cross_entropy_sb", "applies", "IGNORE_INDEX", "FORWARD_BLOCK", "BACKWARD_BLOCK"]

#: the label that contributes nothing (``F.cross_entropy``'s default ``ignore_index``)
IGNORE_INDEX = -100

#: vocabulary columns a forward program reads at a time (a loop over the row), and a backward program's block; four
#: warps each (the fastest of 2,048-16,384 x 4-16 warps on an H200 at Llama-3.2-1B's vocabulary: forward 0.50 ms,
#: backward 1.07 ms a micro-batch, one and two passes over the logits at ~4.2 TB/s; triton_ops_probe.jsonl row 4)
FORWARD_BLOCK = 8192
BACKWARD_BLOCK = 4096


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def triton_cross_entropy_forward(x_ptr, label_ptr, loss_ptr, lse_ptr, V, IGNORE: tl.constexpr,
                                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * V
        m = -float("inf")
        s = 0.0
        for start in range(0, V, BLOCK):
            col = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + col, mask=col < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        label = tl.load(label_ptr + row)
        keep = label != IGNORE
        picked = tl.load(x_row + tl.where(keep, label, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(keep, lse - picked, 0.0))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def triton_cross_entropy_backward(dloss_ptr, x_ptr, label_ptr, lse_ptr, dx_ptr, V, IGNORE: tl.constexpr,
                                      BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < V
        label = tl.load(label_ptr + row)
        g = tl.where(label != IGNORE, tl.load(dloss_ptr + row), 0.0)
        lse = tl.load(lse_ptr + row)
        x = tl.load(x_ptr + row * V + col, mask=m, other=0.0).to(tl.float32)
        dx = (tl.exp(x - lse) - tl.where(col == label, 1.0, 0.0)) * g
        tl.store(dx_ptr + row * V + col, dx.to(dx_ptr.dtype.element_ty), mask=m)

    return triton_cross_entropy_forward, triton_cross_entropy_backward


def _forward(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, labels = logits.contiguous(), labels.contiguous()
    n, v = logits.shape
    loss = logits.new_empty(n, dtype=torch.float32)
    lse = torch.empty_like(loss)
    torch.library.wrap_triton(_kernels()[0])[(n,)](logits, labels, loss, lse, v, IGNORE=IGNORE_INDEX,
                                                   BLOCK=FORWARD_BLOCK, num_warps=4)
    return loss, lse


def _backward_op(dloss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    dloss, logits = dloss.contiguous(), logits.contiguous()
    n, v = logits.shape
    dx = torch.empty_like(logits)
    grid = (n, -(-v // BACKWARD_BLOCK))
    torch.library.wrap_triton(_kernels()[1])[grid](dloss, logits, labels, lse, dx, v, IGNORE=IGNORE_INDEX,
                                                   BLOCK=BACKWARD_BLOCK, num_warps=4)
    return dx


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _backward(ctx, dloss: torch.Tensor, _dlse: torch.Tensor):
    logits, labels, lse = ctx.saved_tensors
    return torch.ops.workbench.cross_entropy_backward(dloss.float(), logits, labels, lse), None


@functools.cache
def register() -> None:
    """Registers ``workbench::cross_entropy`` and its backward (once; ``torch.library.triton_op`` imports torch's
    compiler, so never at import: :func:`workbench.backend.compiled_layer.prepare_model` calls it when it binds the
    op, :func:`cross_entropy_sb` before its first eager use)."""
    op = torch.library.triton_op("workbench::cross_entropy", _forward, mutates_args=())
    torch.library.triton_op("workbench::cross_entropy_backward", _backward_op, mutates_args=())
    op.register_autograd(_backward, setup_context=_setup)


def applies(logits: torch.Tensor) -> bool:
    """The op reads ``logits`` as contiguous rows of a CUDA tensor of 16 or 32 bits."""
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16, torch.float32)


def cross_entropy_sb(logits: torch.Tensor, labels: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32) from logits ``[s, b, V]`` and labels ``[b, s]``: fp32 log-softmax like
    megatron's; the Triton op where ``triton`` (``KernelChoice.triton_ops``) and :func:`applies`, else
    ``F.cross_entropy`` of the fp32 logits."""
    s, b, v = logits.shape
    rows, targets = logits.reshape(s * b, v), labels.t().reshape(s * b)
    if triton and applies(logits):
        if not torch.compiler.is_compiling():
            register()
        loss = torch.ops.workbench.cross_entropy(rows, targets)[0]
    else:
        loss = F.cross_entropy(rows.float(), targets, reduction="none", ignore_index=IGNORE_INDEX)
    return loss.view(s, b).t().contiguous()
