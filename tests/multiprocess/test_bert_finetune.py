"""BERT sequence classification, fine-tuned from a pretrained checkpoint, through the real backend in CPU mode.

A tiny BERT pretrains (masked LM + sentence order) on the embedded corpus and saves; a second run loads
those weights (``checkpoint.load_dir`` + ``finetune``: the new classification head initialised fresh,
the log says so) with ``model.num_labels: 2`` and fine-tunes on the corpus's verses labelled by
testament.  Held-out verses (other chapters, balanced: chance is 50%) must be classified clearly better
than chance.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import ConfigError, preset
from workbench.run.reader import read_events


def test_finetuned_classifier_beats_chance_on_held_out_verses(tmp_path):
    pre = preset("bert-tiny", **{"train.train_iters": 20, "train.eval_interval": 0, "train.microbatch_timing_interval": 0})
    ckpt = tmp_path / "pretrain" / "checkpoints"
    ft = preset("bert-tiny", **{
        "model.num_labels": 2, "model.add_binary_head": False, "checkpoint.load_dir": str(ckpt), "checkpoint.finetune": True,
        "checkpoint.save_on_exit": False, "train.train_iters": 120, "train.micro_batch_size": 16, "train.global_batch_size": 16,
        "train.lr": 2e-3, "train.min_lr": 1e-4, "train.lr_warmup_iters": 10, "train.eval_interval": 120, "train.eval_iters": 16,
        "train.microbatch_timing_interval": 0, "model.seq_length": 48})
    # both runs in one process (tests.support.trainer_runs: the backend's Trainer once per config)
    out = run_trainers({tmp_path / "pretrain": pre, tmp_path / "finetune": ft})
    pre_steps = [e for e in read_events(tmp_path / "pretrain") if e["event"] == "step"]
    assert len(pre_steps) == 20 and (ckpt / "latest_checkpointed_iteration.txt").is_file()
    assert "initialised fresh: classifier.bias, classifier.weight" in out, out[-2000:]

    events = read_events(tmp_path / "finetune")
    start = next(e for e in events if e["event"] == "run_start")
    assert "testament" in start["data"]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 120 and all(0 <= e["accuracy"] <= 1 for e in steps)
    first, last = sum(e["loss"] for e in steps[:10]) / 10, sum(e["loss"] for e in steps[-10:]) / 10
    assert last < first, (first, last)
    ev = [e for e in events if e["event"] == "eval"][-1]
    # 256 held-out verses (chapters never trained on), half from each testament: chance is 0.5
    assert ev["accuracy"] >= 0.7, ev


def test_classification_config_rules():
    with pytest.raises(ConfigError, match="model.num_labels.*no sequence-classification head"):
        preset("tiny", **{"model.num_labels": 2}).check()
    with pytest.raises(ConfigError, match="demo labelled set has 2 classes"):
        preset("bert-tiny", **{"model.num_labels": 3, "model.add_binary_head": False}).check()
    with pytest.raises(ConfigError, match="sentence-order head would sit unused"):
        preset("bert-tiny", **{"model.num_labels": 2}).check()
    with pytest.raises(ConfigError, match="indexed data has no labels"):
        preset("bert-tiny", **{"model.num_labels": 2, "model.add_binary_head": False, "data.source": "indexed",
                               "data.datasets": [{"prefix": "/x/y_text_document"}]}).check()
    preset("bert-tiny", **{"model.num_labels": 2, "model.add_binary_head": False}).check()
