"""SwiGLU (``silu(gate) * up`` on fc1's ``[gate, up]`` halves) as one Triton kernel each way: ``KernelChoice.triton_ops``.

Inside the compiled layer, inductor fuses the backward of ``silu(gate) * up`` into one point-wise kernel that also
concatenates the two halves' gradients: Llama-3.2-1B on an H200 spent 20.4 ms a step there (64 calls of 8192 x 8192,
0.32 ms each, ~2x the time of the bytes it moves; the plain compiled Llama the same).  Here both
directions are opaque ops (``workbench::swiglu``, ``workbench::swiglu_backward``, :func:`torch.library.triton_op`:
inductor calls the kernels inside its graph, no graph break): the forward writes the product once (saved for fc2's
weight gradient, as eager autograd saves it) and the backward reads ``dy`` and fc1's output and writes the two halves'
gradients in place, one program a row block of each half: 0.161 against 0.297 ms a backward call on an H200
(``bench/results/triton_ops_probe.jsonl``), 10.4 against 20.4 ms of Llama-3.2-1B's step (``train_throughput.jsonl:221``
against ``:219``), the step's peak memory unchanged.

Maths as inductor's fused kernel: every operation in fp32, one rounding to the activations' dtype at the store.
Elsewhere (CPU, no Triton) :func:`swiglu` is the same expression in torch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["register", "swiglu", "swiglu_reference"]

#: columns of one half a program covers (Llama's halves are 8192 wide: 8 programs a row)
BLOCK = 1024


def swiglu_reference(z: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on ``z``'s last-dimension halves, in torch (what the compiled layer runs off CUDA)."""
    gate, up = torch.chunk(z, 2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def triton_swiglu_forward(z_ptr, y_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < half
        zrow = z_ptr + row * 2 * half
        g = tl.load(zrow + col, mask=m).to(tl.float32)
        u = tl.load(zrow + half + col, mask=m).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + row * half + col, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def triton_swiglu_backward(dy_ptr, z_ptr, dz_ptr, half, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < half
        zrow, dzrow = z_ptr + row * 2 * half, dz_ptr + row * 2 * half
        dy = tl.load(dy_ptr + row * half + col, mask=m).to(tl.float32)
        g = tl.load(zrow + col, mask=m).to(tl.float32)
        u = tl.load(zrow + half + col, mask=m).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        dg = dy * u * (s + silu * (1.0 - s))  # d silu / dg = s (1 + g (1 - s))
        tl.store(dzrow + col, dg.to(dz_ptr.dtype.element_ty), mask=m)
        tl.store(dzrow + half + col, (dy * silu).to(dz_ptr.dtype.element_ty), mask=m)

    return triton_swiglu_forward, triton_swiglu_backward


def _grid(z: torch.Tensor) -> tuple[int, int, int]:
    rows, half = z.numel() // z.shape[-1], z.shape[-1] // 2
    return rows, -(-half // BLOCK), half


def _forward(z: torch.Tensor) -> torch.Tensor:
    z = z.contiguous()  # (the kernels read whole rows; a no-op where inductor kept the layout)
    rows, blocks, half = _grid(z)
    y = z.new_empty((*z.shape[:-1], half))
    torch.library.wrap_triton(_kernels()[0])[(rows, blocks)](z, y, half, BLOCK=BLOCK)
    return y


def _backward_op(dy: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    dy, z = dy.contiguous(), z.contiguous()
    rows, blocks, half = _grid(z)
    dz = torch.empty_like(z)
    torch.library.wrap_triton(_kernels()[1])[(rows, blocks)](dy, z, dz, half, BLOCK=BLOCK)
    return dz


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, dy: torch.Tensor) -> torch.Tensor:
    (z,) = ctx.saved_tensors
    return torch.ops.workbench.swiglu_backward(dy.contiguous(), z)


@functools.cache
def register() -> None:
    """Registers ``workbench::swiglu`` and its backward (once; ``torch.library.triton_op`` imports torch's compiler,
    so never at import: the compiled layer calls this when it is built with the ops, :func:`swiglu` before its first
    use)."""
    op = torch.library.triton_op("workbench::swiglu", _forward, mutates_args=())
    torch.library.triton_op("workbench::swiglu_backward", _backward_op, mutates_args=())
    op.register_autograd(_backward, setup_context=_setup)


def swiglu(z: torch.Tensor, triton: bool) -> torch.Tensor:
    """``silu(gate) * up`` on ``z``'s halves: the Triton ops where ``triton`` (the kernel rule's
    ``KernelChoice.triton_ops``) and ``z`` is a contiguous CUDA tensor, else :func:`swiglu_reference`."""
    if triton and z.is_cuda and z.is_contiguous() and z.shape[-1] % 2 == 0:
        if not torch.compiler.is_compiling():  # (compiled layers registered it when built)
            register()
        return torch.ops.workbench.swiglu(z)
    return swiglu_reference(z)
