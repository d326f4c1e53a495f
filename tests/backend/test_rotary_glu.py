"""The compiled layer's rotary tables and SwiGLU kernels: the same maths as megatron's, where the kernel rule takes them.

The Triton kernels run here through Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the CPU, in a child
process: the variable is read when Triton is imported); on GPUs ``bench/glu_rope_probe.py`` checks them compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from workbench import kernel_rule
from workbench.backend import rotary
from workbench.config import preset


def _freqs(s: int, rot: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 8])  # the whole head, and a partial rotary (rotary_percent 0.5)
def test_tables_rotate_exactly_as_megatron(dtype, rot):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    t = torch.randn(12, 2, 3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    freqs = _freqs(12, rot)
    got = rotary.rotate(t, rotary.rope_tables(freqs, dtype))
    assert torch.equal(got, _apply_rotary_pos_emb_bshd(t, freqs))
    assert torch.equal(rotary.rotate(t, freqs), got) and rotary.rotate(t, None) is t


def test_tables_are_made_once_per_frequencies_tensor_and_dtype(monkeypatch):
    monkeypatch.setattr(rotary, "_TABLES", {})
    a, b = _freqs(8, 8), _freqs(8, 8)
    first = rotary.rope_tables(a, torch.bfloat16)
    assert rotary.rope_tables(a, torch.bfloat16) is first  # the same tensors for every layer and step
    assert rotary.rope_tables(b, torch.bfloat16) is not first  # another tensor (equal values): its own tables
    assert rotary.rope_tables(a, torch.float32)[0].dtype == torch.float32
    assert rotary.rope_tables(None, torch.float32) is None
    monkeypatch.setattr(rotary, "MAX_TABLES", 3)  # full: made, not kept, and nothing kept is dropped
    kept = dict(rotary._TABLES)
    c = _freqs(8, 8)
    assert rotary.rope_tables(c, torch.bfloat16) is not rotary.rope_tables(c, torch.bfloat16)
    assert rotary._TABLES == kept


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
