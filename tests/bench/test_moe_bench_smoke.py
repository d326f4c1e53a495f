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
    assert len(plain["router_cv_per_layer"]) == 2 and all(cv >= 0 for cv in plain["router_cv_per_layer"])
    # the plain model's first micro-batch is the workbench run's first: the backend's own data module, same config
    import argparse
    import types

    from bench.moe_bench import bench_config, tokens_digest
    from workbench.rank.data import MicroBatchStream, build_datasets

    proto = types.SimpleNamespace(**plain["protocol"])
    cfg = bench_config(argparse.Namespace(smoke=True, proto=proto))
    train_ds, _valid, _desc = build_datasets(cfg, tmp_path / "data", log=lambda *_: None)
    assert plain["first_tokens_sha256"] == tokens_digest(next(MicroBatchStream(train_ds, cfg, 0))["tokens"])
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


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_the_plain_moe_follows_the_workbench_runs_learning_rates(style):
    """``moe_bench.scheduled_lr`` gives each optimizer step the rate megatron's scheduler gives the workbench's run
    (the Trainer builds it so and steps it once after each optimizer step)."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from bench.moe_bench import scheduled_lr
    from workbench.config import preset

    t = preset("moe-research", **{"train.train_iters": 40, "train.lr_warmup_iters": 4, "train.lr_decay_iters": 30,
                                  "train.lr_decay_style": style}).train
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
                                    lr_decay_steps=t.lr_decay_iters, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=t.lr_decay_iters, wd_incr_style="constant")
    for k in range(t.train_iters):
        assert scheduled_lr(t, k) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15), (style, k)
        sched.step(increment=1)
