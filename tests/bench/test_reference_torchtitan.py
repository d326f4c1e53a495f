"""bench/reference_torchtitan.py, the torchtitan yardstick: torchtitan's Llama-3 model, parallelize_llama (FSDP2),
loss and optimizer driven under the benchmark protocol.  The variant is planned without torchtitan; the rest needs
torchtitan importable (CI does not install it: ``pip install torchtitan==0.3.0`` or the carried ``.whl/titan`` wheels,
bench/README.md) and skips with that reason otherwise."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reference_torchtitan.py"

needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                 reason="torchtitan is not installed (CI does not carry it; see bench/README.md)")


def test_torchtitan_variant_is_planned_beside_fsdp2():
    sys.path.insert(0, str(ROOT))
    from bench import train_throughput as tt

    rows = {v.name: v for v in tt.plan(["llama3.2-3b", "gpt2-medium"], gpus=2, have_te=False, microbatches=4)}
    v = rows["torchtitan/llama3.2-3b"]
    assert (v.kind, v.gpus, v.baseline) == ("torchtitan", 2, "workbench/llama3.2-3b")
    assert tt.bench_config(v).train.global_batch_size == rows["fsdp2/llama3.2-3b"].microbatches * 2 * tt.MODELS["llama3.2-3b"]
    assert "torchtitan/gpt2-medium" not in rows  # Llama models only
    assert not any(n.startswith("torchtitan/") for n in (v.name for v in tt.plan(["llama3.2-1b"], 1, False, 4)))


@needs_titan
def test_torchtitan_llama_shapes_are_the_presets():
    """torchtitan's registry flavors 1B / 3B have exactly the workbench presets' parameter count (meta device)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench import reference_torchtitan as rt
    from bench.reference_fsdp2 import bench_cfg
    from workbench.config import derive

    found = rt.import_torchtitan()
    assert found["version"].startswith("0.3")
    for model, flavor in (("llama3.2-1b", "1B"), ("llama3.2-3b", "3B")):
        cfg = bench_cfg(model, gpus=2, global_batch=16, micro_batch=2)
        got, mc = rt.titan_model_config(cfg, rt.Options(), model)
        with torch.device("meta"):
            n = sum(p.numel() for p in mc.build().parameters())
        assert got == flavor and n == derive(cfg).params.total, (model, n)
        assert all(layer.attention.rope.max_seq_len == 2048 for layer in mc.layers)


@needs_titan
def test_cpu_smoke_two_gloo_ranks(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--result", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["ok"] and r["kind"] == "torchtitan" and r["gpus"] == 2 and r["device"] == "cpu"
    assert r["torchtitan_version"].startswith("0.3") and r["yardstick"].startswith("torchtitan ")
    assert r["params_total"] == r["params_derived"]
    assert len(r["step_times"]) == 2 and r["tokens_per_s"] > 0
    assert r["losses"] and all(math.isfinite(x) for x in r["losses"])
    assert r["kernel_path"]["parallel"].startswith("torchtitan parallelize_llama")
