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
    with pytest.raises(ConfigError, match="overlapped gradient reduction waits"):
        preset("bert-tiny", **{"model.num_labels": 2, "model.add_binary_head": False, "parallel.overlap_grad_reduce": True}).check()
    preset("bert-tiny", **{"model.num_labels": 2, "model.add_binary_head": False}).check()


def test_classification_model_has_the_head_the_planner_counts():
    """The built model (TP=1, CPU) has exactly the parameters derive() counts, with and without a 3-class head,
    and its last stage returns [b, num_labels] logits for a padded batch."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = r"""
import json, torch
from workbench.config import preset, derive
from workbench.models.common.one_process import build_full_model, single_process_group
out = []
for over in ({}, {"model.num_labels": 3, "model.add_binary_head": False}):
    cfg = preset("bert-tiny", **over)
    with single_process_group():
        m = build_full_model(cfg, "fp32").eval()
        tokens = torch.randint(5, 100, (2, 12)); mask = (torch.arange(12)[None] < torch.tensor([[12], [7]])).long()
        with torch.no_grad():
            y = m(tokens, mask, tokentype_ids=torch.zeros_like(tokens))
    shape = list(y.shape) if torch.is_tensor(y) else [list(t.shape) for t in y if t is not None]
    out.append({"built": sum(p.numel() for p in m.parameters()), "derived": derive(cfg).params.total, "shape": shape,
                "head": [n for n, _ in m.named_parameters() if n.startswith("classifier.")]})
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    pre, cls = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pre["built"] == pre["derived"] and cls["built"] == cls["derived"]
    h = 64
    assert cls["built"] - pre["built"] == (3 * h + 3) - (2 * h + 2)  # binary head (2 classes) -> classifier (3)
    assert cls["head"] == ["classifier.weight", "classifier.bias"] and cls["shape"] == [2, 3]
    assert pre["shape"] == [[2, 12, 4096], [2, 2]]
