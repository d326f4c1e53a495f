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

from tests.support import SUPPORT, free_port, torchrun_args

ROOT = Path(__file__).resolve().parents[2]
LAYER_CHECK = SUPPORT / "compiled_layer_check.py"


def _run_check(*args: str, port: int) -> dict:
    proc = subprocess.run([sys.executable, str(LAYER_CHECK), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "CHECK_PORT": str(port)})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def checks() -> dict:
    return _run_check("all", port=free_port())


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


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


def _assert_families_match(r: dict, rel: float) -> None:
    for name, runs in r.items():
        stock, fast = runs["stock"], runs["fast"]
        assert stock["fast_calls"] == 0 and stock["layers"] == 0, name  # megatron's own layers
        # every layer (T5: encoder and decoder) took the compiled path, each micro-batch of each step
        assert fast["blockers"] == [None] * fast["layers"] and fast["fast_calls"] == fast["layers"] * 2 * 3, (name, fast)
        for a, b in zip(stock["losses"], fast["losses"]):
            assert _close(a, b, rel), (name, stock["losses"], fast["losses"])
        for a, b in zip(stock["grad_norms"], fast["grad_norms"]):
            assert _close(a, b, 10 * rel), (name, stock["grad_norms"], fast["grad_norms"])
        assert fast["losses"][0] != fast["losses"][2]  # the optimizer really stepped


def test_compiled_layer_serves_bert_t5_and_rope_with_the_stock_maths():
    """BERT (padding mask, bidirectional), T5 (relative bias, padding-masked encoder, causal decoder with
    cross-attention; GEGLU and ReLU) and a RoPE/GQA GPT: three Trainer steps on the compiled layer (eager)
    against megatron's own layers, same losses and gradient norms."""
    r = _run_check("families", port=free_port())
    assert set(r) == {"bert", "t5", "t5-padded", "t5-relu", "gpt-rope"}
    assert r["t5-padded"]["fast"]["losses"] != r["t5"]["fast"]["losses"]  # the padding changed what was attended
    assert r["t5"]["fast"]["layers"] == 4  # 2 encoder + 2 decoder layers
    _assert_families_match(r, 1e-5)


@pytest.mark.slow
def test_families_on_the_compiled_layer_under_torch_compile():
    proc = subprocess.run([sys.executable, str(LAYER_CHECK), "families"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "CHECK_PORT": str(free_port()), "CHECK_COMPILE": "1"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    _assert_families_match(json.loads(lines[-1][len("RESULT "):]), 1e-4)


@pytest.mark.slow
def test_fp8_gemms_train_on_the_compiled_layer_under_torch_compile():
    """train.fp8 through the real Trainer (RoPE/GQA/SwiGLU GPT, torch.compile'd layer, CPU): every layer takes the
    compiled path, the kernel path names the recipe, three steps stay within FP8's rounding of the same run
    without FP8 while differing from it (the GEMMs really ran in FP8), and each weight is cast once per step."""
    proc = subprocess.run([sys.executable, str(LAYER_CHECK), "fp8"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "CHECK_PORT": str(free_port()), "CHECK_COMPILE": "1"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT "):])
    off = r["off"]
    assert "fast_fp8" not in off["kernel_path"]
    for recipe in ("tensorwise", "rowwise"):
        run = r[recipe]
        assert f"FP8 GEMMs ({recipe} scaling" in run["kernel_path"]["fast_fp8"]
        assert run["blockers"] == [None] * run["layers"] and run["fast_calls"] == off["fast_calls"] > 0
        assert run["losses"] != off["losses"] and run["grad_norms"] != off["grad_norms"]
        for a, b in zip(run["losses"], off["losses"]):
            assert _close(a, b, 1e-3), (recipe, run["losses"], off["losses"])
        for a, b in zip(run["grad_norms"], off["grad_norms"]):
            assert _close(a, b, 5e-2), (recipe, run["grad_norms"], off["grad_norms"])
        assert run["losses"][0] != run["losses"][2]
        # each GEMM weight (4 per layer) cast to FP8 once per step, not per micro-batch and GEMM
        assert run["weight_casts"] == 3 * 4 * run["layers"], run["weight_casts"]
    assert off["weight_casts"] == 0


@pytest.mark.slow
def test_compiled_layer_matches_stock_under_torch_compile():
    r = _run_check("layer", "--compile", port=free_port())
    for name in ("gpt", "llama-like", "rope", "recompute-selective", "recompute-full"):
        assert r[name]["fast_calls"] == (8 if name == "recompute-full" else 4)
        assert _close(r[name]["loss_fast"], r[name]["loss_stock"], 1e-4), r[name]
        assert r[name]["grad_rel_max"] < 1e-4, r[name]


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


def _tp2_check(what: str = "tp2", **env: str) -> dict:
    """tests/support/compiled_layer_check.py ``what`` (tp2, tp2-order) under torchrun on two CPU ranks: its JSON result."""
    import os

    proc = subprocess.run([sys.executable, *torchrun_args(2),
                           str(LAYER_CHECK), what], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _assert_tp2_matches_stock(v: dict, rel: float, passes: int = 1) -> None:
    # 4 layers x 2 ranks x forward passes per layer (2 under full recompute)
    assert v["blockers"] == [None] * 4 and v["fast_calls_all_ranks"] == 8 * passes, v
    assert v["one_graph"] == [True] * 4, v
    assert v["loss_diff_max"] <= rel * abs(v["loss_stock"]) and v["grad_rel_max"] < rel, v


def test_tensor_parallel_fast_layer_matches_stock_across_two_ranks():
    """TP=2 (two gloo processes): the one-graph layer with functional collectives, with and
    without sequence parallelism, against the stock megatron layer with the same weights."""
    r = _tp2_check()
    for name, heads_per_rank, groups_per_rank in (("gpt", 2, 2), ("llama-like", 2, 1)):
        v = r[name]
        _assert_tp2_matches_stock(v, rel=1e-5)
        head_dim = 16  # tiny: hidden 64 / 4 heads; each rank holds only its shard of the fused QKV
        assert v["local_qkv_rows"] == (heads_per_rank + 2 * groups_per_rank) * head_dim
    for name in ("gpt+sp", "llama-like+sp", "rope+sp", "gpt+sp+selective", "gpt+full"):
        _assert_tp2_matches_stock(r[name], rel=1e-5, passes=2 if name == "gpt+full" else 1)


def _gemms_in_flight(events: list[str]) -> list[int]:
    """Per collective start in code order: how many GEMMs run before its wait."""
    counts = []
    for i, kind in enumerate(events):
        if kind == "start":
            rest = events[i + 1:]
            counts.append(rest[:rest.index("wait")].count("mm"))
    return counts


def test_tp_backward_collectives_run_under_the_weight_gradient_gemms():
    """parallel.tp_comm_overlap, on inductor's generated backward of the TP=2 layer: each
    input-gradient all-reduce (reduce-scatter under SP) has two weight-gradient GEMMs between
    its start and its wait; without the overlap every collective is waited on at once."""
    r = _tp2_check("tp2-order")
    # backward collectives: TP = [all-reduce dgrad fc1, all-reduce dgrad qkv];
    # SP = [all-gather grad, reduce-scatter dgrad fc1, all-gather grad, reduce-scatter dgrad qkv]
    expected_on = {False: [2, 2], True: [0, 2, 0, 2]}
    for sp, want in expected_on.items():
        on, off = r[f"overlap=True,sp={sp}"], r[f"overlap=False,sp={sp}"]
        assert _gemms_in_flight(on) == want, on
        assert _gemms_in_flight(off) == [0] * len(want), off
        assert on.count("mm") == off.count("mm") == 8, (on, off)  # moved, not added: 4 dgrad + 4 wgrad
    # train.fp8: the weight gradients are FP8 GEMMs (torch._scaled_mm) and the pass moves them too; inductor then
    # fuses the first pair's operand (the FP8 norm output, recomputed in backward) into the norm backward, which
    # waits for the all-reduce, so only part of it runs in flight (the kernel path says so)
    on, off = r["overlap=True,sp=False,fp8=tensorwise"], r["overlap=False,sp=False,fp8=tensorwise"]
    assert sum(_gemms_in_flight(on)) >= 1 and _gemms_in_flight(off) == [0, 0], (on, off)
    assert on.count("mm") == off.count("mm") == 8, (on, off)


@pytest.mark.slow
def test_tensor_parallel_one_graph_layer_under_torch_compile():
    """The same under torch.compile: the collectives stay inside one graph (no graph breaks),
    with the recomputed MLP and under megatron's full recompute too."""
    r = _tp2_check(CHECK_COMPILE="1", CHECK_CASES="gpt+sp,llama-like+sp,gpt+sp+selective,gpt+full")
    assert set(r) == {"gpt+sp", "llama-like+sp", "gpt+sp+selective", "gpt+full"}
    for name, v in r.items():
        _assert_tp2_matches_stock(v, rel=1e-5, passes=2 if name == "gpt+full" else 1)
        assert v["graph_breaks"] == 0, v


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
import json, socket, torch, torch.distributed as dist
from megatron.core.optimizer import clip_grads
from workbench.backend import cpu_mode, optimizer_paths

megatron_clip = clip_grads.clip_grad_by_total_norm_fp32  # before cpu_mode swaps in its own CPU copy
cpu_mode.enable()  # 'cuda' factories -> CPU, CUDA tensor type names: megatron's own code runs on CPU
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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
