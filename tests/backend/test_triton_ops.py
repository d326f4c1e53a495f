"""The compiled layer's hand-written Triton ops (``KernelChoice.triton_ops``: workbench.backend.glu's SwiGLU,
workbench.backend.qkv_rope's QKV split + rotary + GQA repeat): the same maths as the torch expressions they replace.

The kernels run here through Triton's interpreter (``TRITON_INTERPRET=1``, numpy on the CPU, in one child process:
the variable is read when Triton is imported); on GPUs ``bench/triton_ops_probe.py`` and the Llama rows run them compiled."""

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
import json, torch
from workbench.backend import glu, qkv_rope


def rel(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


glu.register()  # (the compiled layer registers the ops when it is built with them)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    z = (torch.randn(3, 5, 2 * 1100, generator=torch.Generator().manual_seed(1)) * 3).to(dtype).requires_grad_()
    gy = torch.randn(3, 5, 1100, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = torch.ops.workbench.swiglu(z)
    dz, = torch.autograd.grad(y, z, gy)
    z64 = z.detach().double().requires_grad_()
    ref = glu.swiglu_reference(z64)
    dref, = torch.autograd.grad(ref, z64, gy.double())
    out["swiglu", str(dtype)] = {"y": rel(y, ref), "dz": rel(dz, dref), "dtype": str(y.dtype), "shape": list(y.shape)}

# QKV: 3 KV groups of 3 query heads (neither a power of two: the kernels pad and mask), multi-head (1 query head a
# group) and one group; head dim 8, s 6, b 3
s, b, d = 6, 3, 8
inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
f = torch.outer(torch.arange(s).float(), inv)
freqs = torch.cat((f, f), -1)[:, None, None, :]


def torch_path(qkv):  # the compiled layer's expression: split, rotate, repeat, SDPA's [b, n, s, d] views
    q, k, v = qkv.view(s, b, g, (pg + 2) * d).split([pg * d, d, d], dim=3)
    q, k = qkv_rope.rotate(q.reshape(s, b, g * pg, d), freqs), qkv_rope.rotate(k, freqs)
    return [t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(pg, dim=2), v.repeat_interleave(pg, dim=2))]


for dtype, g, pg in ((torch.float32, 3, 3), (torch.bfloat16, 3, 3), (torch.float32, 2, 1), (torch.float32, 1, 4)):
    qkv = torch.randn(s, b, g * (pg + 2) * d, generator=torch.Generator().manual_seed(3)).to(dtype).requires_grad_()
    got, want = qkv_rope.rotate_split(qkv, freqs, g, pg), torch_path(qkv)
    grads = [torch.randn(t.shape, generator=torch.Generator().manual_seed(4 + i)).to(dtype) for i, t in enumerate(want)]
    dgot, = torch.autograd.grad(got, qkv, grads)
    dwant, = torch.autograd.grad(want, qkv, grads)
    out["qkv", str(dtype), f"{g}x{pg}"] = {
        "q_k_v": max(rel(a, c) for a, c in zip(got, want)), "dqkv": rel(dgot, dwant),
        "contiguous": all(t.is_contiguous() for t in got), "shape": list(got[1].shape),
        "v_exact": bool(torch.equal(got[2], want[2]))}
g, pg = 3, 3
# the compiled layer's attention through the op (here its CUDA check stands aside: the interpreter runs on the CPU)
from workbench.backend import compiled_layer
x, w = torch.randn(s, b, 16), torch.randn(g * (pg + 2) * d, 16) * 0.2
kw = dict(heads=g * pg, groups=g, head_dim=d, scale=d ** -0.5, causal=True, mask=None, bias=None, rope=freqs)
plain = compiled_layer._self_attention(x, w, None, **kw)
qkv_rope.applies = lambda *a: True
out["layer", "attention"] = {"diff": rel(compiled_layer._self_attention(x, w, None, triton=True, **kw), plain)}

# cross-entropy: 14 tokens (logits [s, b, V] = [7, 2, V]) over a vocabulary of 5,000 (two blocks of
# 4,096, the second masked); one label ignored, one the last column; the gradient weighted per token like a loss mask
from workbench.backend import cross_entropy as ce
ce.register()
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(7, 2, 5000, generator=torch.Generator().manual_seed(5)) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 5000, (2, 7), generator=torch.Generator().manual_seed(6))
    labels[0, 3], labels[1, 6] = ce.IGNORE_INDEX, 4999
    w = torch.rand(2, 7, generator=torch.Generator().manual_seed(7))
    loss, lse = torch.ops.workbench.cross_entropy(logits.reshape(14, 5000), labels.t().reshape(14))
    got = loss.view(7, 2).t()
    dgot, = torch.autograd.grad((got * w).sum(), logits, retain_graph=True)
    l64 = logits.detach().double().requires_grad_()
    want = torch.nn.functional.cross_entropy(l64.reshape(14, 5000), labels.t().reshape(14), reduction="none").view(7, 2).t()
    dwant, = torch.autograd.grad((want * w).sum(), l64)
    ce.applies = lambda *a: True  # (the layer's path: its CUDA check stands aside for the interpreter)
    layer = ce.cross_entropy_sb(logits, labels, triton=True)
    # the log-sum-exp is an output with its own gradient (a z-loss on it: d lse / dx = softmax)
    lse_w = torch.rand(14, generator=torch.Generator().manual_seed(8))
    dz, = torch.autograd.grad((lse * lse_w).sum(), logits)
    dz_want, = torch.autograd.grad((torch.logsumexp(l64.reshape(14, 5000), -1) * lse_w).sum(), l64)
    bad = labels.t().reshape(14).clone()
    bad[2], bad[5] = 5000, -3  # outside the vocabulary (not the ignore index)
    bad_loss = torch.ops.workbench.cross_entropy(logits.detach().reshape(14, 5000), bad)[0]
    out["ce", str(dtype)] = {"loss": rel(got, want), "dlogits": rel(dgot, dwant), "ignored": float(got[0, 3]),
                             "ignored_grad": float(dgot[3, 0].abs().max()), "dtype": str(dgot.dtype),
                             "loss_dtype": str(got.dtype), "layer": rel(layer, want), "shape": list(layer.shape),
                             "lse": rel(lse, torch.logsumexp(l64.reshape(14, 5000), -1)), "dlse": rel(dz, dz_want),
                             "bad_nan": [bool(torch.isnan(bad_loss[i])) for i in range(14)]}
print(json.dumps({" ".join(k): v for k, v in out.items()}))
"""


@pytest.fixture(scope="module")
def kernels() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _KERNELS], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_swiglu_kernels_compute_silu_gate_times_up_and_its_gradients(kernels):
    fp32, bf16 = kernels["swiglu torch.float32"], kernels["swiglu torch.bfloat16"]
    assert fp32["shape"] == [3, 5, 1100] and bf16["dtype"] == "torch.bfloat16"
    assert fp32["y"] < 1e-6 and fp32["dz"] < 1e-6, fp32  # fp32 maths, one rounding at the store
    assert bf16["y"] < 1e-2 and bf16["dz"] < 1e-2, bf16


def test_qkv_kernels_rotate_and_repeat_as_the_torch_path_in_sdpas_layout(kernels):
    fp32, bf16 = kernels["qkv torch.float32 3x3"], kernels["qkv torch.bfloat16 3x3"]
    assert fp32["shape"] == [3, 9, 6, 8] and fp32["contiguous"] and fp32["v_exact"] and bf16["v_exact"]
    assert fp32["q_k_v"] < 1e-6 and fp32["dqkv"] < 1e-6, fp32  # the gradient sums each group's repeats
    assert bf16["q_k_v"] < 1e-2 and bf16["dqkv"] < 2e-2, bf16  # (eager rounds every intermediate to bf16)
    for case, heads in (("2x1", 2), ("1x4", 4)):  # multi-head attention (no repeat), one KV group
        got = kernels[f"qkv torch.float32 {case}"]
        assert got["shape"] == [3, heads, 6, 8] and got["v_exact"] and got["q_k_v"] < 1e-6 and got["dqkv"] < 1e-6, got


def test_the_compiled_layers_attention_through_the_op_is_the_same_attention(kernels):
    assert kernels["layer attention"]["diff"] < 1e-6  # SDPA takes the op's [b, n, s, d] tensors as they are


def test_cross_entropy_kernels_compute_fp32_log_softmax_loss_and_its_gradient(kernels):
    fp32, bf16 = kernels["ce torch.float32"], kernels["ce torch.bfloat16"]
    assert fp32["loss"] < 1e-6 and fp32["dlogits"] < 1e-6 and fp32["lse"] < 1e-6, fp32  # fp32 maths in the kernels
    assert bf16["loss"] < 1e-6 and bf16["dlogits"] < 1e-2, bf16  # (bf16 logits read exactly; the gradient rounded)
    assert fp32["dlse"] < 1e-6 and bf16["dlse"] < 1e-2, (fp32, bf16)  # the log-sum-exp's own gradient
    for got in (fp32, bf16):
        assert got["ignored"] == 0.0 and got["ignored_grad"] == 0.0, got  # ignore_index: no loss, no gradient
        assert got["loss_dtype"] == "torch.float32" and got["shape"] == [2, 7] and got["layer"] < 1e-6, got
        assert got["bad_nan"] == [i in (2, 5) for i in range(14)], got  # a label outside the vocabulary: NaN
    assert bf16["dtype"] == "torch.bfloat16"  # the gradient in the logits' dtype


def test_off_cuda_the_compiled_layer_keeps_torchs_expressions():
    from workbench.backend import glu, qkv_rope

    z = torch.randn(4, 6)
    assert torch.equal(glu.swiglu(z, triton=True), glu.swiglu_reference(z))  # CPU: no Triton launch
    qkv, freqs = torch.zeros(5, 2, 48, dtype=torch.bfloat16), torch.zeros(5, 1, 1, 8)
    assert qkv_rope.fits(qkv, freqs, 8) and not qkv_rope.applies(qkv, freqs, 8)  # CPU: the torch path
    from workbench.backend import cross_entropy

    logits, labels = torch.randn(3, 2, 11), torch.randint(0, 11, (2, 3))
    want = torch.nn.functional.cross_entropy(logits.reshape(6, 11), labels.t().reshape(6), reduction="none")
    assert torch.equal(cross_entropy.cross_entropy_sb(logits, labels, triton=True), want.view(3, 2).t())


def test_the_qkv_kernel_takes_only_what_it_reads():
    from workbench.backend import qkv_rope

    qkv, freqs = torch.zeros(5, 2, 120, dtype=torch.bfloat16), torch.zeros(5, 1, 1, 8)
    assert qkv_rope.fits(qkv, freqs, 8)
    assert not qkv_rope.fits(qkv.float(), freqs, 8)  # 16-bit activations
    assert not qkv_rope.fits(qkv, freqs.bfloat16(), 8)  # fp32 frequencies
    assert not qkv_rope.fits(qkv, None, 8)  # no rotary
    assert not qkv_rope.fits(qkv, freqs[..., :4], 8)  # partial rotary
    assert not qkv_rope.fits(qkv.transpose(0, 1), freqs, 8)  # whole rows only
    assert not qkv_rope.fits(qkv, torch.zeros(4, 1, 1, 8), 8)  # a table row per position
    assert not qkv_rope.fits(torch.zeros(5, 2, 240, dtype=torch.bfloat16), torch.zeros(5, 1, 1, 24), 24)  # half 12


def test_the_compiled_layer_names_swiglu_for_the_triton_op_only_where_the_rule_says():
    import torch.nn.functional as F
    from types import SimpleNamespace

    from workbench.backend.layer_rules import activation_name

    def config(act, glu, triton_ops):
        return SimpleNamespace(activation_func=act, gated_linear_unit=glu, bias_activation_fusion=False,
                               workbench_kernels=SimpleNamespace(triton_ops=triton_ops))

    assert activation_name(config(F.silu, True, True), kernels=True) == "swiglu_triton"
    assert activation_name(config(F.silu, True, True)) == "swiglu"  # the activation itself (the layer rules)
    assert activation_name(config(F.silu, True, False), kernels=True) == "swiglu"
    assert activation_name(config(F.gelu, False, True), kernels=True) == "gelu"  # no op for other activations


def test_kernel_rule_takes_the_triton_ops_on_cuda_compiled_layers_only():
    base = {"parallel.device": "cuda", "train.precision": "bf16", "train.compile_kernels": True}
    assert kernel_rule.choose(preset("llama-small", **base), te=False).triton_ops
    for why in ({"parallel.device": "cpu"}, {"train.compile_kernels": False}):
        choice = kernel_rule.choose(preset("llama-small", **{**base, **why}), te=False)
        assert not choice.triton_ops, (why, choice)
    te = kernel_rule.choose(preset("llama-small", **base, **{"model.attention_backend": "te"}), te=True)
    assert te.layer == "stock" and not te.triton_ops
