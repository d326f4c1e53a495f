"""The compiled dense layer under ``torch.compile`` (inductor's CPU code) keeps the stock maths: the layer, the
families (BERT, T5, RoPE GPT) and FP8 GEMMs through the real Trainer.  Split from test_compiled_layer.py (the eager
checks) so the two run on separate test workers: each compile here takes minutes on CPU.  The three checks run in one
process (the ``compiled`` fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import free_port
from tests.support.compiled_layer_run import LAYER_CHECK, ROOT, assert_families_match, close


@pytest.fixture(scope="module")
def compiled() -> dict:
    """``compiled_layer_check.py compiled``: the layer, the families and FP8 under torch.compile in one process (one
    start and one set of imports for the three checks; each starts from empty dynamo caches): their JSON results."""
    proc = subprocess.run([sys.executable, str(LAYER_CHECK), "compiled"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "CHECK_PORT": str(free_port()), "CHECK_COMPILE": "1"})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_families_on_the_compiled_layer_under_torch_compile(compiled):
    assert_families_match(compiled["families"], 1e-4)


@pytest.mark.slow
def test_fp8_gemms_train_on_the_compiled_layer_under_torch_compile(compiled):
    """train.fp8 through the real Trainer (RoPE/GQA/SwiGLU GPT, torch.compile'd layer, CPU): every layer takes the
    compiled path, the kernel path names the recipe, three steps stay within FP8's rounding of the same run
    without FP8 while differing from it (the GEMMs really ran in FP8), and each weight is cast once per step."""
    r = compiled["fp8"]
    off = r["off"]
    assert "fast_fp8" not in off["kernel_path"]
    for recipe in ("tensorwise", "rowwise"):
        run = r[recipe]
        assert f"FP8 GEMMs ({recipe} scaling" in run["kernel_path"]["fast_fp8"]
        assert run["blockers"] == [None] * run["layers"] and run["fast_calls"] == off["fast_calls"] > 0
        assert run["losses"] != off["losses"] and run["grad_norms"] != off["grad_norms"]
        for a, b in zip(run["losses"], off["losses"]):
            assert close(a, b, 1e-3), (recipe, run["losses"], off["losses"])
        for a, b in zip(run["grad_norms"], off["grad_norms"]):
            assert close(a, b, 5e-2), (recipe, run["grad_norms"], off["grad_norms"])
        assert run["losses"][0] != run["losses"][2]
        # each GEMM weight (4 per layer) cast to FP8 once per step, not per micro-batch and GEMM
        assert run["weight_casts"] == 3 * 4 * run["layers"], run["weight_casts"]
    assert off["weight_casts"] == 0


@pytest.mark.slow
def test_compiled_layer_matches_stock_under_torch_compile(compiled):
    r = compiled["layer"]
    for name in ("gpt", "llama-like", "rope", "recompute-selective", "recompute-full"):
        assert r[name]["fast_calls"] == (8 if name == "recompute-full" else 4)
        assert close(r[name]["loss_fast"], r[name]["loss_stock"], 1e-4), r[name]
        assert r[name]["grad_rel_max"] < 1e-4, r[name]
