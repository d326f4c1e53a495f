"""BERT sequence classification, fine-tuned from a pretrained checkpoint, through the real backend in CPU mode.

A tiny BERT pretrains (masked LM + sentence order) on the embedded corpus and saves; a second run loads
those weights (``checkpoint.load_dir`` + ``finetune``: the new classification head initialised fresh,
the log says so) with ``model.num_labels: 2`` and fine-tunes on the corpus's verses labelled by
testament.  Held-out verses (other chapters, balanced: chance is 50%) must be classified clearly better
than chance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import free_port
from workbench.config import ConfigError, preset
from workbench.run.reader import read_events

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


# both runs in one rank process (RANK 0 of 1, gloo): the backend's own Trainer, once per config; one
# interpreter start instead of two (most of a tiny CPU run's wall time is importing torch and megatron)
DRIVER = r"""
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
from workbench.backend import distributed
from workbench.backend.train import Trainer
from workbench.config import load_config
for run_dir in sys.argv[2:]:
    code = Trainer(load_config(os.path.join(run_dir, "config.json")), run_dir).run()
    distributed.destroy()
    assert code == 0, (run_dir, code)
"""


def _run(configs: dict, timeout: int = 240) -> str:
    for run_dir, cfg in configs.items():
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save(run_dir / "config.json")
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(free_port()), *map(str, configs)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_finetuned_classifier_beats_chance_on_held_out_verses(tmp_path):
    pre = preset("bert-tiny", **{"train.train_iters": 20, "train.eval_interval": 0, "train.microbatch_timing_interval": 0})
    ckpt = tmp_path / "pretrain" / "checkpoints"
    ft = preset("bert-tiny", **{
        "model.num_labels": 2, "model.add_binary_head": False, "checkpoint.load_dir": str(ckpt), "checkpoint.finetune": True,
        "checkpoint.save_on_exit": False, "train.train_iters": 120, "train.micro_batch_size": 16, "train.global_batch_size": 16,
        "train.lr": 2e-3, "train.min_lr": 1e-4, "train.lr_warmup_iters": 10, "train.eval_interval": 120, "train.eval_iters": 16,
        "train.microbatch_timing_interval": 0, "model.seq_length": 48})
    out = _run({tmp_path / "pretrain": pre, tmp_path / "finetune": ft})
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
