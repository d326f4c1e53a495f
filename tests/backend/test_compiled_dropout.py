"""The compiled dense layer under dropout: megatron's hidden dropout (each sublayer's output, bias included, before
its residual add) and attention dropout (on the attention probabilities), with megatron's masks.

Each check runs in a subprocess (tests/support/dropout_check.py: megatron's parallel state is process-global); the
one-process checks and the resume's three Trainer runs share one (the ``one_process_runs`` fixture,
tests/support/dropout_one_process.py), the TP=2 check has its two ranks.
Stock and compiled layers run eagerly on the CPU with the same weights and the random generators seeded alike, so
they draw the same masks only if the compiled layer drops what megatron drops, where it drops it, in the same
order, from the same stream: equal losses and gradients are the proof; the dropout-free (eval) loss differing
from them shows the masks were there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import torchrun_args, SUPPORT, free_port

ROOT = Path(__file__).resolve().parents[2]
CHECK = SUPPORT / "dropout_check.py"


def _run(cmd: list[str], timeout: int = 900, **env: str) -> dict:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "CHECK_PORT": str(free_port()), **env})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


#: the resume check's runs: six steps straight, three steps with a checkpoint, the resume of those to step six
RESUME = ("straight", "first", "resumed")


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """``dropout_check.py one-process`` (the layer, the statistics (eager and compiled), full recompute (compiled) and
    the families, one after another, each from empty dynamo caches and parallel state), then the :data:`RESUME` runs
    on the compiled layer under dropout, in one process: (its JSON result, the runs' root)."""
    from workbench.config import preset

    root = tmp_path_factory.mktemp("dropout-resume")
    straight = preset("tiny", **{"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6,
                                 "train.global_batch_size": 8, "train.eval_interval": 0, "train.compile_kernels": True,
                                 "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0,
                                 "checkpoint.save_on_exit": False, "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1})
    configs = {"straight": straight,
               "first": straight.replace(**{"train.train_iters": 3, "checkpoint.save_on_exit": True}),
               "resumed": straight.replace(**{"checkpoint.load_dir": str(root / "first" / "checkpoints")})}
    for name in RESUME:
        (root / name).mkdir()
        configs[name].save(root / name / "config.json")
    return _run([sys.executable, str(SUPPORT / "dropout_one_process.py"), *(str(root / n) for n in RESUME)],
                timeout=1800), root


@pytest.fixture(scope="module")
def one_process(one_process_runs) -> dict:
    return one_process_runs[0]


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def test_compiled_layer_drops_what_megatrons_layer_drops(one_process):
    """GPT (learned positions, GELU) and a RoPE/GQA/SwiGLU/RMSNorm GPT, hidden and attention dropout alone and
    together, under selective and full recompute: the compiled layer in train mode against megatron's
    TransformerLayer, the same seed before each forward."""
    r = one_process["layer"]
    for name, case in r.items():
        assert case["blockers"] == [None] * 4 and case["fast_calls"] >= 4, (name, case)  # the compiled path ran
        assert _close(case["loss_fast"], case["loss_stock"]), (name, case)
        assert case["grad_rel_max"] < 1e-6, (name, case)
        # with dropout the masks changed the loss (eval mode has none); at p = 0 train and eval agree exactly
        assert (case["loss_fast"] == case["eval_loss_fast"]) == (name == "no-dropout"), (name, case)


def _assert_statistics(r: dict) -> None:
    p = 0.25
    for name in ("hidden", "attention"):
        assert r[name]["values"] == [0.0, round(1 / (1 - p), 4)], r[name]  # dropped, or kept and scaled 1/(1-p)
        assert abs(r[name]["dropped"] - p) < 0.02, r[name]
    assert r["attention_same_over_head_channels"]  # one draw per (query, key, head): a whole head's context
    assert r["none"] == {"values": [1.0], "dropped": 0.0, "n": r["none"]["n"]}


def test_dropout_masks_drop_p_and_scale_the_rest(one_process):
    _assert_statistics(one_process["stats"])


@pytest.mark.slow
def test_dropout_masks_under_torch_compile(one_process):
    """The same statistics from inductor's random numbers (the compiled graph's own dropout)."""
    _assert_statistics(one_process["stats_compiled"])


@pytest.mark.slow
def test_full_recompute_redraws_the_same_masks_under_torch_compile(one_process):
    """megatron's full recompute runs each compiled layer forward without grad (inductor's inference graph), then
    again in backward (the training graph) after restoring the RNG states: the same masks both times, so the loss and
    gradients equal the run's without recompute."""
    r = one_process["recompute"]
    assert r["fast_calls"] == [4, 8], r  # compiled: once per layer, twice under full recompute
    assert r["loss_full"] == r["loss_none"] and r["grad_rel_max"] < 1e-6, r


def test_bert_and_t5_masks_under_dropout_match_the_stock_layers(one_process):
    """BERT (key padding mask) and T5 (relative position bias, padded encoder inputs, causal decoder, cross-attention;
    GEGLU, and ReLU with hidden dropout only): three Trainer steps on the compiled layer against megatron's layers
    under dropout, same losses and gradient norms."""
    r = one_process["families"]
    assert set(r) == {"bert", "t5-padded", "t5-relu-hidden-only"}
    for name, runs in r.items():
        stock, fast = runs["stock"], runs["fast"]
        assert stock["fast_calls"] == 0 and fast["blockers"] == [None] * fast["layers"], (name, fast)
        assert fast["fast_calls"] == fast["layers"] * 2 * 3, (name, fast)  # every layer, micro-batch and step
        for a, b in zip(stock["losses"], fast["losses"]):
            assert _close(a, b, 1e-5), (name, stock["losses"], fast["losses"])
        for a, b in zip(stock["grad_norms"], fast["grad_norms"]):
            assert _close(a, b, 1e-4), (name, stock["grad_norms"], fast["grad_norms"])
        assert "dropout in the graph (hidden 0.1" in fast["kernel_path"].get("fast_layer", ""), fast["kernel_path"]


def test_tensor_parallel_dropout_follows_megatrons_streams():
    """TP=2 with a real per-rank tracker fork: attention dropout on each rank's TP stream, hidden dropout on the
    default stream shared by the ranks holding the same activations (drawn before the forked graph); under SP the
    whole layer on the TP stream (megatron's block forks).  Same losses and gradients as megatron's layers, the
    same loss on both ranks; the fork changed the masks."""
    r = _run([sys.executable, *torchrun_args(2), str(CHECK), "tp2"])
    for name, case in r.items():
        assert case["blockers"] == [None] * 4 and case["fast_calls"] == 8, (name, case)
        assert case["loss_diff_max"] == 0.0 and case["grad_rel_max"] < 1e-6, (name, case)
        assert case["loss_fast_per_rank"][0] == case["loss_fast_per_rank"][1], (name, case)
        if name != "hidden-only":  # attention dropout: the per-rank stream mattered
            assert case["loss_stock_no_fork"] != case["loss_stock"], (name, case)


def test_a_resume_on_the_compiled_layer_under_dropout_repeats_the_straight_run(one_process_runs):
    """The compiled layer draws its masks from the generator whose state training checkpoints carry: a run resumed
    at step 3 repeats the straight run's losses bit for bit (CPU mode: the compiled layer eagerly, CPU generator)."""
    from workbench.run.reader import read_events

    root = one_process_runs[1]

    def losses(run):
        return {e["iteration"]: e["loss"] for e in read_events(root / run) if e["event"] == "step"}

    start = next(e for e in read_events(root / "resumed") if e["event"] == "run_start")
    assert "dropout in the graph" in start["kernel_path"]["fast_layer"], start["kernel_path"]
    ref, got = losses("straight"), losses("resumed")
    assert sorted(got) == [4, 5, 6] and got == {i: ref[i] for i in got}
