"""The compiled layer's SwiGLU kernels (workbench.backend.glu): the same maths as torch's, where the kernel rule takes them.

The Triton kernels run here through Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the CPU, in a child
process: the variable is read when Triton is imported); on GPUs ``bench/swiglu_probe.py`` checks them compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workbench import kernel_rule
from workbench.config import preset


_KERNELS = r"""
import json, sys, torch
from workbench.backend import glu
out = {}
for dtype in (torch.float32, torch.bfloat16):
    z = (torch.randn(3, 5, 2 * 1100, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).requires_grad_()
    gy = torch.randn(3, 5, 1100, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = glu.swiglu(z, triton=True) if dtype is torch.float32 else torch.ops.workbench.swiglu(z)
    dz, = torch.autograd.grad(y, z, gy)
    z64 = z.detach().double().requires_grad_()
    ref = glu.swiglu_reference(z64)
    dref, = torch.autograd.grad(ref, z64, gy.double())
    out[str(dtype)] = {"y": float((y.double() - ref).abs().max() / ref.abs().max()),
                       "dz": float((dz.double() - dref).abs().max() / dref.abs().max()),
                       "dtype": str(y.dtype), "shape": list(y.shape)}
print(json.dumps(out))
"""


def test_swiglu_kernels_compute_silu_gate_times_up_and_its_gradients():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _KERNELS], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    fp32, bf16 = got["torch.float32"], got["torch.bfloat16"]
    assert fp32["shape"] == [3, 5, 1100] and bf16["dtype"] == "torch.bfloat16"
    assert fp32["y"] < 1e-6 and fp32["dz"] < 1e-6, fp32  # fp32 maths, one rounding at the store
    assert bf16["y"] < 1e-2 and bf16["dz"] < 1e-2, bf16


def test_swiglu_off_cuda_is_torchs_expression():
    from workbench.backend import glu

    z = torch.randn(4, 6)
    assert torch.equal(glu.swiglu(z, triton=True), glu.swiglu_reference(z))  # CPU: no Triton launch


def test_kernel_rule_takes_the_triton_swiglu_on_cuda_compiled_swiglu_layers_only():
    base = {"parallel.device": "cuda", "train.precision": "bf16", "train.compile_kernels": True}
    assert preset("llama-small").model.activation == "swiglu"
    assert kernel_rule.choose(preset("llama-small", **base), te=False).swiglu_triton
    for why in ({"parallel.device": "cpu"}, {"train.compile_kernels": False}, {"model.activation": "gelu"}):
        choice = kernel_rule.choose(preset("llama-small", **{**base, **why}), te=False)
        assert not choice.swiglu_triton, (why, choice)
    te = kernel_rule.choose(preset("llama-small", **base, **{"model.attention_backend": "te"}), te=True)
    assert te.layer == "stock" and not te.swiglu_triton
