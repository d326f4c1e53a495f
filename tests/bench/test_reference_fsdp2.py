"""bench/reference_fsdp2.py, the multi-GPU yardstick (plain FSDP2 Llama), on CPU: two gloo ranks under torchrun train
the tiny Llama sharded, return the harness's result dict, and the loss falls on a fixed batch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "reference_fsdp2.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the keys of bench.harness.train_worker's result (CPU: no MFU)
HARNESS_KEYS = {"preset", "kind", "tokens_per_step", "flops_per_step", "graph_breaks", "cudagraph_skips", "step_times",
                "step_s", "tokens_per_s", "mem_peak", "device"}


def test_cpu_smoke_two_ranks_shard_train_and_the_loss_falls(tmp_path):
    res_path, out = tmp_path / "result.json", tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--fixed-batch", "--steps", "3", "--result", str(res_path),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(res_path.read_text())
    assert json.loads(out.read_text().splitlines()[-1]) == r  # the row appended, stamped
    assert r["ok"] and r["cpu_smoke"] and r["date"] and r["commit"]
    assert HARNESS_KEYS <= set(r), HARNESS_KEYS - set(r)
    assert r["kind"] == "fsdp2" and r["preset"] == "tiny-llama" and r["device"] == "cpu" and r["mem_peak"] is None

    from bench.reference_fsdp2 import bench_cfg
    from workbench.config import derive

    cfg = bench_cfg("tiny-llama", gpus=2, cpu=True, global_batch=r["global_batch_size"])
    d = derive(cfg)
    # two ranks, each its half of every parameter (FSDP2's dim-0 shards), the workbench's architecture and count
    assert r["gpus"] == 2 and r["microbatches"] == d.num_microbatches == 2
    assert r["params_total"] == r["params_derived"] == d.params.total
    assert r["params_local_rank0"] == r["params_total"] // 2
    assert r["tokens_per_step"] == d.tokens_per_step == r["global_batch_size"] * r["seq_length"]
    assert r["flops_per_step"] == d.flops_per_step
    # the protocol: warm-up (at least 2 steps, agreed by both ranks), then the timed steps
    assert len(r["step_times"]) == 3 and r["step_s"] > 0 and r["warmup_steps"] >= 2 and r["steady"] in (True, False)
    assert math.isclose(r["tokens_per_s"], r["tokens_per_step"] / r["step_s"], rel_tol=1e-9)
    assert r["graph_breaks"] == 0 and r["options"]["compile"] is False and r["precision"] == "fp32"
    assert r["torchtitan"]["runs_on_torch_2_11"] is False and "DataParallelMeshDims" in r["torchtitan"]["error"]
    # a fresh model of the padded vocabulary: loss ~ ln(V); one batch trained over and over: it falls every step
    losses = r["losses"]
    assert len(losses) == r["warmup_steps"] + 3 and losses[0] == r["first_loss"]
    assert abs(losses[0] - math.log(d.padded_vocab_size)) < 0.5, losses
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.2, losses


def test_bad_batch_is_an_argument_error_before_any_launch():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--global-batch", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a multiple" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "gpt5"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not one of" in proc.stderr, proc.stderr[-2000:]
