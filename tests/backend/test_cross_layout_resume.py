"""A training checkpoint written at one layout resumes at another and continues the run that never stopped.

CPU mode under gloo, tiny models, fp32, the backend's own ``Trainer`` (``tests.support.trainer_runs``: several
runs per launch).  GPT saved at TP=2 and at PP=2, BERT saved at TP=2 (step 3 of 6, the run going on to step 6)
resume at DP=2 (two ranks, TP=1), at TP=1 on one rank and at the layout that saved them.  Steps 4-6 of every
resume equal the straight run's: bit for bit at the same layout; within 1e-4 relative at another layout (the
TP / PP partial sums add up in another order), with the same learning rate and samples.  What makes them
equal is that the model, the optimizer's moments and step, the LR schedule and the data position all move
to the new layout: a resume that restarted any of them (fresh Adam moments at the first step after the
resume change the update by far more than 1e-4) would miss.  The GPU proof of the same at bf16 is
``tests/gpu_proofs/two_gpu_proof.py --phase a`` (cases ``resume-*``).
"""

from __future__ import annotations

import pytest

from workbench.config import preset
from workbench.run.reader import read_events

from tests.support.trainer_runs import run_trainers

BASE = {"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6, "train.lr_warmup_iters": 1,
        "train.lr": 1e-2, "train.min_lr": 1e-3,
        "train.global_batch_size": 8, "train.eval_interval": 0, "train.microbatch_timing_interval": 0,
        "checkpoint.save_on_exit": False, "checkpoint.save_interval": 0}
TP2, PP2 = {"parallel.tensor_parallel": 2}, {"parallel.pipeline_parallel": 2}
BAR = 1e-4


def _cfg(name: str, **over):
    return preset(name, **{**BASE, **over})


def _steps(run_dir) -> dict[int, dict]:
    return {e["iteration"]: e for e in read_events(run_dir) if e["event"] == "step" and e.get("loss") is not None}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xlayout")
    ck = lambda src: str(root / src / "checkpoints" / "iter_0000003")  # noqa: E731
    save = {"checkpoint.save_interval": 3}
    two = {
        root / "gpt_tp2": _cfg("tiny", **TP2, **save),
        root / "gpt_pp2": _cfg("tiny", **PP2, **save),
        root / "bert_tp2": _cfg("bert-tiny", **TP2, **save),
        root / "gpt_tp2_at_tp2": _cfg("tiny", **TP2, **{"checkpoint.load_dir": ck("gpt_tp2")}),
        root / "gpt_pp2_at_pp2": _cfg("tiny", **PP2, **{"checkpoint.load_dir": ck("gpt_pp2")}),
        root / "gpt_tp2_at_dp2": _cfg("tiny", **{"checkpoint.load_dir": ck("gpt_tp2")}),
        root / "gpt_pp2_at_dp2": _cfg("tiny", **{"checkpoint.load_dir": ck("gpt_pp2")}),
        root / "bert_tp2_at_dp2": _cfg("bert-tiny", **{"checkpoint.load_dir": ck("bert_tp2")}),
    }
    out = run_trainers(two, nproc=2, timeout=900)
    one = {
        root / "gpt_tp2_at_tp1": _cfg("tiny", **{"checkpoint.load_dir": ck("gpt_tp2")}),
        root / "gpt_pp2_at_tp1": _cfg("tiny", **{"checkpoint.load_dir": ck("gpt_pp2")}),
        root / "bert_tp2_at_tp1": _cfg("bert-tiny", **{"checkpoint.load_dir": ck("bert_tp2")}),
    }
    out += run_trainers(one, nproc=1, timeout=600)
    return root, out


@pytest.mark.parametrize("source, resumed", [("gpt_tp2", "gpt_tp2_at_tp2"), ("gpt_pp2", "gpt_pp2_at_pp2")])
def test_a_resume_at_the_same_layout_repeats_the_straight_run_exactly(runs, source, resumed):
    root, out = runs
    straight, got = _steps(root / source), _steps(root / resumed)
    assert sorted(got) == [4, 5, 6]
    assert {i: got[i]["loss"] for i in got} == {i: straight[i]["loss"] for i in got}
    assert "random states: restored" in out


@pytest.mark.parametrize("source, resumed", [
    ("gpt_tp2", "gpt_tp2_at_dp2"), ("gpt_tp2", "gpt_tp2_at_tp1"),
    ("gpt_pp2", "gpt_pp2_at_dp2"), ("gpt_pp2", "gpt_pp2_at_tp1"),
    ("bert_tp2", "bert_tp2_at_dp2"), ("bert_tp2", "bert_tp2_at_tp1"),
])
def test_a_resume_at_another_layout_continues_the_run_that_never_stopped(runs, source, resumed):
    root, out = runs
    straight, got = _steps(root / source), _steps(root / resumed)
    assert sorted(got) == [4, 5, 6], sorted(got)
    start = next(e for e in read_events(root / resumed) if e["event"] == "run_start")
    assert start["start_iteration"] == 3
    for i in (4, 5, 6):
        ref, e = straight[i], got[i]
        assert abs(e["loss"] - ref["loss"]) <= BAR * abs(ref["loss"]), (resumed, i, e["loss"], ref["loss"])
        assert e["lr"] == pytest.approx(ref["lr"], rel=1e-12) and e["consumed_samples"] == ref["consumed_samples"]
    # the loss moves by far more than the bar over these steps: matching it is not matching a constant
    assert abs(straight[6]["loss"] - straight[3]["loss"]) > 5 * BAR * abs(straight[3]["loss"])


def test_the_random_states_of_another_layout_are_not_used_and_the_run_says_so(runs):
    _root, out = runs
    assert "layout changed (tensor_parallel 2 -> 1)" in out
    assert "layout changed (pipeline_parallel 2 -> 1)" in out
