"""BERT data, offline: the WordPiece tokenizer, sentence-split preprocessing, megatron-core's
BERTMaskedWordPieceDataset on it (masking statistics: 15% of the tokens, 80/10/10 replacement,
sentence order 50/50), ``workbench data inspect`` on sentence-split files, and bad input refused with
exit 2 naming the file and the fix.  The dataset is built in a subprocess (megatron-core needs a
process group to build its sample index).

The bad-input test runs its ``workbench`` commands in this process (``workbench.cli.main``, the code
``python -m workbench.cli`` runs) and one ``workbench launch --dry-run`` as a real subprocess, so the exit
status and message a shell sees are checked too (each CLI process spends seconds importing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.cli import cli_process

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

STATS = r'''
import json, os, sys, numpy as np, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
from workbench.config import preset
from workbench.models.bert.data import build_megatron
from workbench.families.bert.vocab import check_bert_tokenizer
v = check_bert_tokenizer("demo-wordpiece")
cfg = preset("bert-tiny", **{"data.cache_dir": sys.argv[1], "train.train_iters": 250, "model.seq_length": 128,
                            "model.max_position_embeddings": 128})
train, valid, test = build_megatron(cfg, sys.argv[1], v)
special = {v.cls, v.sep, v.pad}
real = masked = as_mask = kept = rand = swapped = specials_masked = 0
n = 1000
for i in range(n):
    it = train[i]
    text, labels, lm = np.asarray(it["text"]), np.asarray(it["labels"]), np.asarray(it["loss_mask"]).astype(bool)
    length = int(np.nonzero(text == v.sep)[0][-1]) + 1
    real += length
    masked += int(lm.sum())
    specials_masked += int(np.isin(labels[lm], list(special)).sum())
    as_mask += int((text[lm] == v.mask).sum())
    kept += int((text[lm] == labels[lm]).sum())
    swapped += int(it["is_random"])
print(json.dumps({"masked_fraction": masked / real, "mask_share": as_mask / masked, "kept_share": kept / masked,
                  "random_share": 1 - (as_mask + kept) / masked, "swapped": swapped / n, "specials_masked": specials_masked,
                  "train": len(train), "valid": len(valid)}))
dist.destroy_process_group()
'''


def _free_port():
    from tests.support import free_port

    return free_port()


def test_masking_statistics_of_the_megatron_bert_dataset(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(STATS), str(tmp_path), str(_free_port())], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["train"] >= 2000 and r["valid"] > 0
    assert 0.13 <= r["masked_fraction"] <= 0.16, r  # 15% of the sequence (the budget counts [CLS]/[SEP] too)
    assert r["mask_share"] == pytest.approx(0.8, abs=0.025), r
    assert r["kept_share"] == pytest.approx(0.1, abs=0.02), r
    assert r["random_share"] == pytest.approx(0.1, abs=0.02), r
    assert r["swapped"] == pytest.approx(0.5, abs=0.05), r
    assert r["specials_masked"] == 0


def _cli_process(*args):
    """``workbench ARGS`` as a shell runs it: a fresh process, its exit status and output."""
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=180)


def test_bad_input_exits_2_naming_the_file_and_the_fix(tmp_path, capsys):
    def _cli(*args):
        return cli_process(args, capsys)

    text = tmp_path / "docs.txt"
    text.write_text("One short document. It has two sentences.\n\nAnother one here. With a second sentence!\n")
    # one sequence per document (no --split-sentences): refused for the binary head
    assert _cli("preprocess", "--input", text, "--output-prefix", tmp_path / "whole", "--tokenizer", "demo-wordpiece", "-q").returncode == 0
    # sentence-split, with the WordPiece vocabulary
    ok = _cli("preprocess", "--input", text, "--output-prefix", tmp_path / "sent", "--tokenizer", "demo-wordpiece",
              "--split-sentences", "--no-append-eod", "-q", "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["sequences"] == 4
    inspect = _cli("data", "inspect", tmp_path / "sent")
    assert inspect.returncode == 0 and "sentence-split: 2.0 sentences/document; 2 of 2 documents" in inspect.stdout, inspect.stdout

    from workbench.config import preset

    def launch_check(run=_cli, **over):
        cfg = preset("bert-tiny", **{"data.split": "100,0,0", "train.eval_interval": 0, **over})
        path = cfg.save(tmp_path / f"cfg{len(list(tmp_path.glob('cfg*')))}.json")
        return run("launch", path, "--dry-run")

    r = launch_check(**{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "whole_text"), "weight": 1.0}]})
    assert r.returncode == 2
    # the same check as a shell sees it: a real process, its exit status 2 and the message on stderr
    r = launch_check(_cli_process, **{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "whole"), "weight": 1.0}]})
    assert r.returncode == 2 and "whole" in r.stderr and "--split-sentences" in r.stderr, r.stderr
    # a vocabulary without [CLS]/[SEP]/[MASK]: the byte-level demo BPE, given as a path
    bpe = ROOT / "workbench" / "data" / "corpus" / "demo-tokenizer"
    r = launch_check(**{"data.source": "indexed", "data.tokenizer": str(bpe),
                        "data.datasets": [{"prefix": str(tmp_path / "sent"), "weight": 1.0}]})
    assert r.returncode == 2 and "[CLS]" in r.stderr and "demo-wordpiece" in r.stderr, r.stderr
    # documents of one sentence each: nothing for the binary head
    single = tmp_path / "single.txt"
    single.write_text("Just one sentence here\n\nAnd only one there\n")
    assert _cli("preprocess", "--input", single, "--output-prefix", tmp_path / "single", "--tokenizer", "demo-wordpiece",
                "--split-sentences", "--no-append-eod", "-q").returncode == 0
    r = launch_check(**{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "single"), "weight": 1.0}]})
    assert r.returncode == 2 and "single" in r.stderr and "two or more sentences" in r.stderr, r.stderr
