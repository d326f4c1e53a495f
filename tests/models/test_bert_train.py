"""BERT through the real backend in CPU mode (gloo): layouts against one process, resume, eval.

One random initial checkpoint is written first; every run loads it (``checkpoint.finetune``: weights
only, iteration 0), so all layouts start from the same weights.  Per-step losses (masked LM +
sentence order, fp32) of TP=2 + SP, PP=2 (1F1B), PP=2 x VPP=2 (interleaved 1F1B) and DP=2 with the
distributed optimizer must match TP=1/PP=1 within 1e-4 relative; a run resumed from the straight
run's step-3 checkpoint must repeat its steps 4-6 exactly; eval events carry the masked-token
accuracy and the sentence-order loss.  Sequence classification (``model.num_labels``, the synthetic
labelled set) at PP=2 and TP=2 + SP matches its one-process run the same way.

Two launches (``tests.support.trainer_runs``): one process writes the initial checkpoint, runs
TP=1/PP=1 and then the resumed run; one torchrun of two ranks runs the four two-rank layouts one
after another (each the backend's Trainer with its own config and run directory).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import read_events

INIT = r'''
import torch
from workbench.rank.build import build_model
from workbench.checkpoint import save_checkpoint
cfg = load_config(INIT_CONFIG)
distributed.initialize(cfg)  # torchrun set the rank and store
torch.manual_seed(cfg.train.seed)
save_checkpoint(INIT_DIR, 0, [build_model(cfg)], cfg)
cls = load_config(CLS_CONFIG)  # the classification model: its head is in the initial checkpoint too
torch.manual_seed(cls.train.seed)
save_checkpoint(CLS_DIR, 0, [build_model(cls)], cls)
parallel_state.destroy_model_parallel()
'''


def _cfg(**over):
    base = {"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6, "train.global_batch_size": 8,
            "train.micro_batch_size": 2, "train.lr": 3e-3, "train.eval_interval": 3, "train.eval_iters": 1,
            "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0, "checkpoint.save_on_exit": False}
    base.update(over)
    return preset("bert-tiny", **base)


#: sequence classification (synthetic labelled set): the head on the last stage, cross entropy and accuracy
CLS = {"model.num_labels": 2, "model.add_binary_head": False}


def _losses(events, kind="step"):
    return {e["iteration"]: e for e in events if e["event"] == kind and e.get("loss") is not None}


LAYOUTS = {
    "tp2_sp": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True},
    "pp2_1f1b": {"parallel.pipeline_parallel": 2},
    "pp2_vpp2": {"parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2},
    "dp2_distopt": {"parallel.distributed_optimizer": True},
}
#: classification layouts, against the one-process classification run ("cls_tp1")
CLS_LAYOUTS = {"cls_pp2": {"parallel.pipeline_parallel": 2}, "cls_tp2_sp": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Events of every run: the straight TP=1/PP=1 run (checkpoint at step 3), the resumed run and each layout."""
    root = tmp_path_factory.mktemp("bert")
    init_cfg = root / "init.json"
    _cfg().save(init_cfg)
    init = root / "init" / "iter_0000000"
    start = {"checkpoint.load_dir": str(init), "checkpoint.finetune": True}
    cls_cfg = root / "init_cls.json"
    _cfg(**CLS).save(cls_cfg)
    cls_start = {"checkpoint.load_dir": str(root / "init_cls" / "iter_0000000"), "checkpoint.finetune": True, **CLS}
    prelude = (INIT.replace("INIT_CONFIG", repr(str(init_cfg))).replace("INIT_DIR", repr(str(root / "init")))
               .replace("CLS_CONFIG", repr(str(cls_cfg))).replace("CLS_DIR", repr(str(root / "init_cls"))))
    run_trainers({root / "tp1": _cfg(**start, **{"checkpoint.save_interval": 3}),
                  root / "resumed": _cfg(**{"checkpoint.load_dir": str(root / "tp1" / "checkpoints" / "iter_0000003")}),
                  root / "cls_tp1": _cfg(**cls_start)},
                 nproc=1, prelude=prelude)
    run_trainers({**{root / name: _cfg(**start, **over) for name, over in LAYOUTS.items()},
                  **{root / name: _cfg(**cls_start, **over) for name, over in CLS_LAYOUTS.items()}}, nproc=2, timeout=480)
    return {p.name: read_events(p) for p in root.iterdir() if (p / "events").is_dir()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_losses_match_one_process(runs, layout):
    ref_events, ev = runs["tp1"], runs[layout]
    ref, got = _losses(ref_events), _losses(ev)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    start = next(e for e in ev if e["event"] == "run_start")
    want = {"tp": 2 if "tp2" in layout else 1, "pp": 2 if "pp2" in layout else 1}
    assert {k: start["config"]["parallel"][f"{n}_parallel"] for k, n in (("tp", "tensor"), ("pp", "pipeline"))} == want
    for it, e in got.items():
        r = ref[it]
        assert abs(e["loss"] - r["loss"]) <= 1e-4 * r["loss"], (layout, it, e["loss"], r["loss"])
        assert abs(e["sop loss"] - r["sop loss"]) <= 1e-4 * r["sop loss"] + 1e-6, (layout, it, e["sop loss"], r["sop loss"])
    ref_eval, got_eval = _losses(ref_events, "eval"), _losses(ev, "eval")
    assert sorted(got_eval) == [3, 6]
    for it, e in got_eval.items():
        assert abs(e["loss"] - ref_eval[it]["loss"]) <= 1e-4 * ref_eval[it]["loss"]
        assert e["mlm accuracy"] == pytest.approx(ref_eval[it]["mlm accuracy"], abs=1e-6)


def test_straight_run_reports_eval_metrics(runs):
    ev = runs["tp1"]
    start = next(e for e in ev if e["event"] == "run_start")
    assert "SDPA" in start["kernel_path"]["attention"] and start["kernels"]["layer"] == "stock"
    evals = _losses(ev, "eval")
    for e in evals.values():
        assert 0.0 <= e["mlm accuracy"] <= 1.0 and e["sop loss"] > 0
    assert all(0 < e["loss"] < 20 and 0 < e["sop loss"] < 5 for e in _losses(ev).values())


def test_resume_repeats_the_straight_run_exactly(runs):
    ref, got = _losses(runs["tp1"]), _losses(runs["resumed"])
    assert sorted(got) == [4, 5, 6]
    for it, e in got.items():
        assert e["loss"] == ref[it]["loss"] and e["sop loss"] == ref[it]["sop loss"], (it, e["loss"], ref[it]["loss"])
        assert e["lr"] == ref[it]["lr"] and e["consumed_samples"] == ref[it]["consumed_samples"]


@pytest.mark.parametrize("layout", list(CLS_LAYOUTS))
def test_classification_layouts_match_one_process(runs, layout):
    """The classification head (on the last pipeline stage; replicated over TP, pooled output gathered under SP):
    per-step cross entropy and accuracy, and eval, as in one process."""
    ref, got = _losses(runs["cls_tp1"]), _losses(runs[layout])
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    assert "sop loss" not in got[1] and "accuracy" in got[1]
    for it, e in got.items():
        assert abs(e["loss"] - ref[it]["loss"]) <= 1e-4 * ref[it]["loss"], (layout, it, e["loss"], ref[it]["loss"])
        assert e["accuracy"] == pytest.approx(ref[it]["accuracy"], abs=1e-6)
    ref_eval, got_eval = _losses(runs["cls_tp1"], "eval"), _losses(runs[layout], "eval")
    assert sorted(got_eval) == [3, 6]
    for it, e in got_eval.items():
        assert abs(e["loss"] - ref_eval[it]["loss"]) <= 1e-4 * ref_eval[it]["loss"]
        assert e["accuracy"] == pytest.approx(ref_eval[it]["accuracy"], abs=1e-6)
