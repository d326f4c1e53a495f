"""The BERT and T5 benchmark rows train the presets as shipped (the headline rows), name any other setting, and
launch only valid configs (no torch needed: the configs and row plans alone)."""

from __future__ import annotations

import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT))

from bench import bert_train, harness, t5_bench  # noqa: E402
from workbench.config import preset  # noqa: E402


@pytest.mark.parametrize("script, name", [(bert_train, "bert-base"), (bert_train, "bert-large"), (t5_bench, "t5-base"),
                                          (t5_bench, "t5-v1_1-base")])
def test_headline_rows_are_the_presets_as_shipped(script, name):
    cfg = script._cfg(name, False)
    shipped = preset(name)
    assert cfg.validate() == []
    st = harness.settings(cfg)
    assert st == harness.settings(shipped)  # dropout, micro-batch and count, lengths, precision: the preset's
    assert st["hidden_dropout"] == 0.1 and cfg.train.compile_kernels and cfg.parallel.device == "cuda"
    assert (cfg.data.source, cfg.train.eval_interval, cfg.checkpoint.save_on_exit) == ("synthetic", 0, False)


def test_the_issue_batches():
    """BERT-base mbs 8 x 8 at seq 512; T5-base mbs 16 x 8 at encoder 512 / decoder 114."""
    assert harness.settings(bert_train._cfg("bert-base", False))["micro_batch_size"] == 8
    assert harness.settings(bert_train._cfg("bert-base", False))["microbatches"] == 8
    t5 = t5_bench._cfg("t5-base", False)
    assert (harness.settings(t5)["micro_batch_size"], harness.settings(t5)["microbatches"], t5.model.decoder_seq) == (16, 8, 114)


def test_rows_at_other_settings_say_so_in_their_name(monkeypatch):
    calls = []

    def fake_measure(script, kind, preset_name, a, over=None, profile=False):
        calls.append((kind, preset_name, over))
        return {"tokens_per_s": 2.0 if kind == "workbench" else 1.0}

    monkeypatch.setattr(harness, "measure", fake_measure)
    a = harness.parser(bert_train.__doc__, rows="throughput,throughput-dropout0", rows_help="", smoke_help="", out="x",
                       preset="bert-base").parse_args([])
    rows = bert_train.rows(a)
    assert [(r["row"], r["preset"]) for r in rows] == [("throughput", "bert-base"), ("throughput", "bert-large"),
                                                       ("throughput-dropout0", "bert-base")]
    assert rows[0]["settings"]["hidden_dropout"] == 0.1 and rows[0]["ratio"] == 2.0 and rows[0]["target"].startswith(">= 1.15")
    assert rows[0]["met"] is True and rows[0]["range"] == [2.0, 2.0] and rows[0]["protocol"]["repeats"] == 3
    assert rows[2]["settings"]["hidden_dropout"] == 0.0 and "dropout 0" in rows[2]["target"] and rows[2]["met"] is None
    # both sides of a row get the same overrides (none for the presets, dropout 0 for the named row), interleaved
    # over the protocol's three repeats
    base, large = ("workbench", "bert-base", None), ("workbench", "bert-large", None)
    assert calls[:6] == [base, ("reference", "bert-base", None)] * 3
    assert calls[6:12] == [large, ("reference", "bert-large", None)] * 3
    assert calls[12:] == [("workbench", "bert-base", harness.DROPOUT0), ("reference", "bert-base", harness.DROPOUT0)] * 3


@pytest.mark.parametrize("smoke", [False, True])
def test_bert_two_gpu_rows_are_valid_configs(smoke):
    for name, over in bert_train.layout_rows(smoke).items():
        cfg = bert_train._cfg("bert-tiny" if smoke else "bert-base", smoke, **over)
        cfg.parallel.nproc_per_node = 2
        assert cfg.validate() == [], (name, [str(p) for p in cfg.validate()])
    assert preset("bert-base").train.lr_warmup_iters >= bert_train.layout_rows(False)["tp2"]["train.train_iters"]  # why


def test_presets_picks_rows_and_refuses_an_unknown_one(monkeypatch, capsys):
    monkeypatch.setattr(harness, "measure", lambda script, kind, name, a, over=None, profile=False: {"tokens_per_s": 1.0})
    ap = harness.parser(t5_bench.__doc__, rows="throughput", rows_help="", smoke_help="", out="x", preset="t5-base")
    rows = t5_bench.rows(ap.parse_args(["--presets", "t5-v1_1-base"]))
    assert [r["preset"] for r in rows] == ["t5-v1_1-base"]
    with pytest.raises(SystemExit) as e:
        t5_bench.rows(ap.parse_args(["--presets", "t5-large"]))
    assert e.value.code == 2 and "t5-large" in capsys.readouterr().err
