"""The language model's loss at TP = 1: per-token cross-entropy over the vocabulary, fp32 log-softmax maths.

megatron's vocab-parallel cross entropy makes ~10 passes over the fp32 up-cast ``[tokens, vocab]`` logits and keeps an
fp32 softmax for backward.  :func:`cross_entropy_sb` is ``F.cross_entropy(logits.float())`` (the compiled layer
compiles it: one fused pass, the softmax recomputed from the bf16 logits in backward) or, with
``KernelChoice.triton_ops``, two hand-written Triton kernels behind one op (``workbench::cross_entropy``,
:func:`torch.library.triton_op`):

- forward: one program a token reads its row of logits once (online max and sum of exponentials, fp32) and writes
  the loss and the log-sum-exp (an output of its own, differentiable: ``d lse / dx = softmax``);
- backward: one program a block of a row reads the logits again and writes ``(softmax - onehot) * dloss`` (plus
  ``softmax * dlse``) in the logits' dtype (one rounding, as the compiled path's cast).

Inductor's fused kernels for the same maths took 1.33 (forward) and 1.26 ms (backward) a micro-batch of Llama-3.2-1B
(8192 tokens x 128,256, bf16; H200), these kernels 0.57 and 1.08 ms at 4,096 columns and 8 warps (10.5 against 6.8 ms
of the step; errors against fp32 equal) and 0.50 and 1.07 ms as shipped (below), one and two passes over the logits
at ~4.2 TB/s (``bench/results/triton_ops_probe.jsonl`` row 4).  The saved tensors are the compiled path's (the bf16
logits) plus the log-sum-exp (4 bytes a token).  Labels of ``ignore_index`` (-100, as ``F.cross_entropy``) give a
zero loss and gradient; a label outside the vocabulary a NaN loss (``F.cross_entropy`` raises).
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
#: backward 1.07 ms a micro-batch; triton_ops_probe.jsonl row 4)
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
        valid = (label >= 0) & (label < V)  # (another label reads nothing and gives a NaN loss, not a wrong one)
        picked = tl.load(x_row + tl.where(valid, label, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(keep, tl.where(valid, lse - picked, float("nan")), 0.0))
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def triton_cross_entropy_backward(dloss_ptr, dlse_ptr, x_ptr, label_ptr, lse_ptr, dx_ptr, V,
                                      IGNORE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < V
        label = tl.load(label_ptr + row)
        g = tl.where(label != IGNORE, tl.load(dloss_ptr + row), 0.0)
        lse = tl.load(lse_ptr + row)
        x = tl.load(x_ptr + row * V + col, mask=m, other=0.0).to(tl.float32)
        # d loss / dx = softmax - onehot(label); d lse / dx = softmax
        dx = tl.exp(x - lse) * (g + tl.load(dlse_ptr + row)) - tl.where(col == label, g, 0.0)
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


def _backward_op(dloss: torch.Tensor, dlse: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                 lse: torch.Tensor) -> torch.Tensor:
    dloss, dlse, logits, labels, lse = (t.contiguous() for t in (dloss, dlse, logits, labels, lse))
    n, v = logits.shape
    dx = torch.empty_like(logits)
    grid = (n, -(-v // BACKWARD_BLOCK))
    torch.library.wrap_triton(_kernels()[1])[grid](dloss, dlse, logits, labels, lse, dx, v, IGNORE=IGNORE_INDEX,
                                                   BLOCK=BACKWARD_BLOCK, num_warps=4)
    return dx


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _backward(ctx, dloss: torch.Tensor, dlse: torch.Tensor):
    logits, labels, lse = ctx.saved_tensors
    dloss = torch.zeros_like(lse) if dloss is None else dloss.float()
    dlse = torch.zeros_like(lse) if dlse is None else dlse.float()
    return torch.ops.workbench.cross_entropy_backward(dloss, dlse, logits, labels, lse), None


@functools.cache
def register() -> None:
    """Registers ``workbench::cross_entropy`` and its backward (once; ``torch.library.triton_op`` imports torch's
    compiler, so never at import: :func:`workbench.backend.compiled_layer.prepare_model` calls it when it binds the
    op, :func:`cross_entropy_sb` before its first eager use)."""
    op = torch.library.triton_op("workbench::cross_entropy", _forward, mutates_args=())
    torch.library.triton_op("workbench::cross_entropy_backward", _backward_op, mutates_args=())
    op.register_autograd(_backward, setup_context=_setup)


def applies(logits: torch.Tensor) -> bool:
    """The op runs on a CUDA tensor of 16 or 32 bits (it reads contiguous rows: a strided one is copied first)."""
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
