"""The performance fast paths (workbench.backend.compiled_layer, optimizer_paths) keep the training maths.

Model-level checks run in a subprocess (tests/support/compiled_layer_check.py): megatron's parallel state
is process-global.  They compare, on CPU with the same weights and data:
- the compiled-layer forward/backward against stock megatron TransformerLayer (GPT and a
  GQA/SwiGLU/RMSNorm variant), and that unsupported cases fall back to the stock forward;
- the bench reference GPT against the workbench GPT (identical architecture);
- three real Trainer steps with all fast paths on against the stock path.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import free_port
from tests.support.compiled_layer_run import assert_families_match as _assert_families_match
from tests.support.compiled_layer_run import close as _close
from tests.support.compiled_layer_run import run_check as _run_check

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checks() -> dict:
    """``compiled_layer_check.py all+families``: every eager check of this file in one process."""
    return _run_check("all+families", port=free_port())


def test_dense_layer_matches_stock_megatron_layer(checks):
    layers = 4  # preset("tiny")
    for name in ("gpt", "llama-like", "rope", "recompute-selective", "recompute-full"):
        r = checks["layer"][name]
        # every layer took the fast path (under full recompute: its forward, then again in backward)
        assert r["fast_calls"] == layers * (2 if name == "recompute-full" else 1), (name, r)
        assert r["blockers"] == [None] * layers
        assert _close(r["loss_fast"], r["loss_stock"]), (name, r)
        assert r["grad_rel_max"] < 1e-5, (name, r)
        assert r["stock_keys_equal"]  # same parameters / checkpoint keys as the stock layer


def test_eval_calls_use_the_compiled_layer_only_at_trained_shapes(checks):
    """Evaluation at the training length reuses the compiled graph; a prompt of another length runs the
    stock forward (no graph compiled per length); both give the stock model's logits."""
    calls = checks["layer"]["gpt"]["eval_calls"]
    (trained, at_trained), (other, at_other) = sorted(calls.items(), key=lambda kv: -int(kv[0]))
    assert at_trained[0] == 4 and at_other[0] == 0, calls  # 4 layers
    assert at_trained[1] < 1e-4 and at_other[1] < 1e-4, calls


def test_recompute_on_the_dense_path_frees_what_it_recomputes(checks):
    """Selective recompute drops exactly the MLP's fc1 output and activation per layer (what
    the stock RecomputedMLP drops); full recompute keeps less still."""
    from workbench.config import preset

    m = preset("tiny").model
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    none, sel, full = (checks["layer"][k] for k in ("gpt", "recompute-selective", "recompute-full"))
    mlp_intermediates = m.num_layers * 2 * (2 * m.seq_length * ffn) * 4  # layers x 2 tensors x [s, b=2, ffn] fp32
    # within 1 KiB: one full CI run kept 512 bytes more on the compiled selective path (not reproduced alone); the
    # MLP's intermediates are 1 MiB here, so the bar still fails when they are kept
    slack = 1024
    assert abs(none["kept_bytes_fast"] - sel["kept_bytes_fast"] - mlp_intermediates) <= slack, (none, sel)
    assert abs(sel["kept_bytes_fast"] - sel["kept_bytes_stock"]) <= slack
    assert full["kept_bytes_fast"] < sel["kept_bytes_fast"]
    assert full["kept_bytes_fast"] == full["kept_bytes_stock"]


def test_unsupported_cases_fall_back_to_stock_forward(checks):
    alibi = checks["layer"]["alibi"]
    assert alibi["blockers"] == ["ALiBi"] * 4 and alibi["fast_calls"] == 0
    assert _close(alibi["loss_fast"], alibi["loss_stock"])


def test_reference_gpt_is_the_same_architecture(checks):
    r = checks["reference"]
    assert r["ref_params"] == r["wb_params"] == r["derived_params"]
    assert _close(r["ref_loss"], r["wb_loss"]), r
    assert abs(r["ref_loss"] - math.log(4096)) < 0.5  # near-uniform predictions at init (padded vocab 4096)


def test_trainer_steps_identical_with_fast_paths(checks):
    stock, fast = checks["trainer_stock"], checks["trainer_fast"]
    assert len(stock["losses"]) == len(fast["losses"]) == 3
    for a, b in zip(stock["losses"], fast["losses"]):
        assert _close(a, b), (stock["losses"], fast["losses"])
    for a, b in zip(stock["grad_norms"], fast["grad_norms"]):
        assert _close(a, b, 1e-4), (stock["grad_norms"], fast["grad_norms"])
    assert fast["losses"][0] != fast["losses"][1]  # the optimizer really stepped
    assert fast["fast_calls"] == 4 * 2 * 3  # layers x micro-batches x steps
    assert stock["fast_calls"] == 0
    assert "fast_layer" in fast["kernel_path"] and "fast_multi_tensor" in fast["kernel_path"]
    # the grad norm stayed on the device (clip_grad 1.0 < these norms: the clipping ran there too)
    assert "fast_grad_norm" in fast["kernel_path"] and min(fast["grad_norms"]) > 1.0
    assert not any(k.startswith("fast_") for k in stock["kernel_path"])


def test_compiled_layer_serves_bert_t5_and_rope_with_the_stock_maths(checks):
    """BERT (padding mask, bidirectional), T5 (relative bias, padding-masked encoder, causal decoder with
    cross-attention; GEGLU and ReLU), a RoPE/GQA GPT and an MoE GPT (a dense layer, then an MoE layer whose attention
    half is compiled): three Trainer steps on the compiled layer (eager) against megatron's own layers, same losses and
    gradient norms."""
    r = checks["families"]
    assert set(r) == {"bert", "t5", "t5-padded", "t5-relu", "gpt-rope", "moe"}
    assert r["t5-padded"]["fast"]["losses"] != r["t5"]["fast"]["losses"]  # the padding changed what was attended
    assert r["t5"]["fast"]["layers"] == 4  # 2 encoder + 2 decoder layers
    moe = r["moe"]["fast"]
    assert moe["layers"] == 2 and "attention half only in the 1 MoE layers" in moe["kernel_path"]["fast_layer"], moe
    _assert_families_match(r, 1e-5)


def test_foreach_multi_tensor_ops_match_plain_torch(monkeypatch):
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt

    from workbench.backend import optimizer_paths

    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=g) for n in (7, 300, 1)] + [torch.randn(5, 9, generator=g)]
    flag = torch.zeros(1, dtype=torch.int)
    total, per = optimizer_paths.foreach_l2_norm(2048, flag, [ts], True)
    expect = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in ts]))
    assert total.shape == (1,) and torch.allclose(total[0], expect, rtol=1e-6)
    assert torch.allclose(per, torch.stack([t.norm() for t in ts]))

    dst = [torch.empty_like(t, dtype=torch.bfloat16) for t in ts]
    optimizer_paths.foreach_scale(2048, flag, [ts, dst], 1.0)  # main fp32 -> model bf16 copy
    assert all(torch.equal(d, t.to(torch.bfloat16)) for d, t in zip(dst, ts))
    inplace = [t.clone() for t in ts]
    optimizer_paths.foreach_scale(2048, flag, [inplace, inplace], 0.25)  # grad clipping scale
    assert all(torch.allclose(a, 0.25 * b) for a, b in zip(inplace, ts))

    # clipping by a device-resident coefficient: scales like the float path, and 1.0 is bit-exact
    clipped = [t.clone() for t in ts]
    optimizer_paths.foreach_scale(2048, flag, [clipped, clipped], torch.tensor([0.25]))
    assert all(torch.equal(a, b * 0.25) for a, b in zip(clipped, ts))
    kept = [t.clone() for t in ts]
    optimizer_paths.foreach_scale(2048, flag, [kept, kept], torch.tensor([1.0]).clamp_max(1.0))
    assert all(torch.equal(a, b) for a, b in zip(kept, ts))

    for mod, name in ((clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"), (mopt, "multi_tensor_scale_impl"),
                      (clip_grads, "multi_tensor_scale_tensor_impl")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:  # no apex / TE here
        assert clip_grads.multi_tensor_scale_tensor_impl is None  # so megatron syncs on the norm
        assert optimizer_paths.install_multi_tensor_fallbacks()
        assert clip_grads.l2_norm_impl is optimizer_paths.foreach_l2_norm
        assert mopt.multi_tensor_scale_impl is optimizer_paths.foreach_scale
        assert clip_grads.multi_tensor_scale_tensor_impl is optimizer_paths.foreach_scale


def test_fused_adam_leaves_cpu_params_alone():
    from workbench.backend import optimizer_paths

    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    assert optimizer_paths.use_fused_adam(opt) == 0  # the fused kernel is CUDA-only
    assert not opt.param_groups[0].get("fused")


def test_transformer_config_overrides_only_on_gpu_with_compile_kernels():
    from workbench.backend import compiled_layer
    from workbench.backend.model import transformer_config_overrides
    from workbench.config import preset

    assert transformer_config_overrides(preset("tiny")) == {}  # CPU preset
    gpu = preset("gpt2-small")
    over = transformer_config_overrides(gpu)
    assert over["bias_dropout_fusion"] and over["cross_entropy_loss_fusion"]
    assert "bias_activation_fusion" not in over  # megatron's fused bias-GELU is tanh: different maths
    assert transformer_config_overrides(gpu.replace(**{"train.compile_kernels": False})) == {}
    assert compiled_layer.layer_module(gpu) is compiled_layer.CompiledTransformerLayer
    assert compiled_layer.layer_module(preset("tiny")) is not compiled_layer.CompiledTransformerLayer


def test_cuda_graphs_only_on_a_gpu_with_compiled_kernels():
    from workbench.backend import compiled_layer
    from workbench.config import preset

    gpu = preset("tiny").replace(**{"parallel.device": "cuda", "train.compile_kernels": True, "train.cuda_graphs": True})
    assert compiled_layer.graphs_wanted(gpu) == torch.cuda.is_available()
    assert not compiled_layer.graphs_wanted(gpu.replace(**{"train.cuda_graphs": False}))
    assert not compiled_layer.graphs_wanted(gpu.replace(**{"train.compile_kernels": False}))
    assert not compiled_layer.graphs_wanted(gpu.replace(**{"parallel.device": "cpu"}))
    assert not compiled_layer.graphs_wanted(gpu.replace(**{"parallel.pipeline_parallel": 2}))
    compiled_layer.step_begin()  # a no-op without graphs (must not touch CUDA)


CLIP_CHECK = r'''
import json, torch, torch.distributed as dist
from megatron.core.optimizer import clip_grads
from workbench.backend import cpu_mode, optimizer_paths

megatron_clip = clip_grads.clip_grad_by_total_norm_fp32  # before cpu_mode swaps in its own CPU copy
cpu_mode.enable()  # 'cuda' factories -> CPU, CUDA tensor type names: megatron's own code runs on CPU
from workbench.run.files import free_port
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
optimizer_paths.install_multi_tensor_fallbacks()
out = {}
for max_norm in (0.5, 1e6):  # clipping, and a coefficient clamped to exactly 1.0
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 64)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.grad.clone() for p in params]
    norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
    megatron_clip(params, max_norm, norm)
    expect_norm = torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in before])).item()
    coeff = min(1.0, max_norm / (expect_norm + 1e-6))
    out[str(max_norm)] = {
        "norm_is_tensor": isinstance(norm, torch.Tensor), "norm": float(norm), "expect_norm": expect_norm,
        "max_err": max(((p.grad - b * coeff).abs().max().item()) for p, b in zip(params, before)),
        "bit_exact_when_unclipped": all(torch.equal(p.grad, b) for p, b in zip(params, before)) if coeff == 1.0 else None,
    }
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
'''


def test_megatron_clipping_keeps_the_norm_on_the_device():
    """megatron's own get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 with the foreach tensor-scale slot
    filled: the norm stays a tensor (no .item() mid-step), clipping scales like the float path, and an
    unclipped step leaves the gradients bit-identical."""
    proc = subprocess.run([sys.executable, "-c", CLIP_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=180)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    for case in r.values():
        assert case["norm_is_tensor"], case
        assert math.isclose(case["norm"], case["expect_norm"], rel_tol=1e-5), case
        assert case["max_err"] < 1e-6, case
    assert r["1000000.0"]["bit_exact_when_unclipped"] is True
