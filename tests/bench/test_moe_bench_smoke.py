"""bench/moe_bench.py on CPU (``--smoke``): the workbench's MoE run (the product's backend under torchrun) and the
plain-PyTorch MoE, each in fresh processes under the protocol at its smallest; rows with repeats, the ratio with its
range and target, labelled as a smoke; a bad ``--phases`` exits 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT

SCRIPT = ROOT / "bench" / "moe_bench.py"


@pytest.mark.slow
def test_smoke_rows_carry_repeats_and_the_ratio_with_its_range(tmp_path):
    out = tmp_path / "moe.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--phases", "workbench-1gpu,torch-compiled", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"workbench-1gpu", "torch-compiled"}
    for r in rows.values():
        assert r["status"] == "ok" and r["smoke"] and "not a measurement" in r["measured"]
        assert r["protocol"]["name"] == "harness-v1" and r["repeats"]["repeats"] == [r["tokens_per_s"]]
        assert r["warmup_steps"] >= r["protocol"]["warmup_min"] and r["tokens_per_s"] > 0
    wb = rows["workbench-1gpu"]
    assert wb["router_cv_per_layer"] and len(wb["router_cv_per_layer"]) == 2  # the smoke's two MoE layers
    plain = rows["torch-compiled"]
    assert "preset" in plain["data"]  # the workbench's micro-batches, not random tokens
    # every step of each repeat, warm-up included (the workbench's run trains the longest warm-up and the timed steps)
    assert len(plain["repeat_rows"][0]["every_step_s"]) == plain["warmup_steps"] + plain["protocol"]["steps"]
    assert len(wb["repeat_rows"][0]["every_step_s"]) >= wb["warmup_steps"] + wb["protocol"]["steps"]
    ratio = plain["workbench_over_torch"]
    assert ratio["target"] == 1.1 and ratio["worst"] <= ratio["ratio"] <= ratio["best"]
    assert ratio["ratio"] == pytest.approx(wb["tokens_per_s"] / rows["torch-compiled"]["tokens_per_s"])


def test_unknown_phase_exits_2_naming_the_choices(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--phases", "workbench-1gpu,bogus", "--out", str(tmp_path / "x")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "bogus" in proc.stderr and "torch-compiled" in proc.stderr
    assert not (tmp_path / "x").exists()
