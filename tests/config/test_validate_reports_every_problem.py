"""`config validate` reports every problem at once (parse, positive-value and divisibility
phases together), one message for a tensor_parallel that does not divide the heads, and the data too."""

from __future__ import annotations

import random

import pytest

from workbench.cli import main
from workbench.config import ConfigError, load_config, preset
from workbench.data.preprocess import preprocess


def test_problems_of_every_phase_are_reported_at_once(tmp_path, capsys):
    path = tmp_path / "four.yaml"
    path.write_text("model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4, vocab_size: 1000, seq_length: 64,\n"
                    "        max_position_embeddings: 64, hiden: 3}\n"
                    "parallel: {tensor_parallel: 3, device: cpu, nproc_per_node: 3}\n"
                    "train: {micro_batch_size: 0, lr: -1}\n")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    for field in ("model.hiden", "train.micro_batch_size", "parallel.tensor_parallel", "train.lr"):
        assert field in err, err
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert {"model.hiden", "train.micro_batch_size", "parallel.tensor_parallel", "train.lr"} <= {p.field for p in e.value.problems}


def test_a_bad_positive_value_does_not_hide_the_other_rules():
    cfg = preset("tiny").replace(**{"train.global_batch_size": 0, "train.lr": -1.0, "data.split": "x"})
    fields = [p.field for p in cfg.validate()]
    assert {"train.global_batch_size", "train.lr", "data.split"} <= set(fields)
    assert fields.count("train.global_batch_size") == 1  # not repeated by the divisibility rule


def test_tp_not_dividing_the_heads_is_one_message_about_tp():
    cfg = preset("tiny").replace(**{"parallel.tensor_parallel": 3, "parallel.nproc_per_node": 3, "train.global_batch_size": 6})
    heads = cfg.model.num_attention_heads
    problems = cfg.validate()
    assert [p.field for p in problems] == ["parallel.tensor_parallel"], problems
    assert "num_query_groups" not in str(problems[0]) and "ffn" not in str(problems[0])
    assert f"divides the heads: one of 1" in problems[0].fix and str(heads) in problems[0].fix
    # an explicit GQA config whose groups tp does not divide still names the groups
    gqa = preset("tiny").replace(**{"model.attention_type": "grouped", "model.num_query_groups": 1,
                                    "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    assert "model.num_query_groups" in {p.field for p in gqa.validate()}


def _dataset(tmp_path, name, tokenizer="demo"):
    rng = random.Random(0)
    text = "\n\n".join(" ".join(rng.choice(["zebra", "quartz", "jam", "tree"]) for _ in range(60)) for _ in range(40))
    (tmp_path / f"{name}.txt").write_text(text + "\n")
    preprocess([tmp_path / f"{name}.txt"], tmp_path / name, tokenizer=tokenizer, progress=False)
    return tmp_path / name


def _indexed_config(tmp_path, prefix, name="run.yaml"):
    cfg = preset("tiny", **{"data.source": "indexed", "data.split": "90,10,0", "data.datasets": [{"prefix": str(prefix)}]})
    return cfg.save(tmp_path / name)


def test_validate_checks_the_data(tmp_path, capsys):
    from workbench.data.tokenizer import train_tokenizer

    good = _dataset(tmp_path, "good")
    path = _indexed_config(tmp_path, good)
    assert main(["config", "validate", str(path)]) == 0
    assert "data checked (indexed" in capsys.readouterr().out
    assert main(["config", "validate", "--no-data", str(path)]) == 0
    assert "data not checked" in capsys.readouterr().out

    # missing files
    missing = _indexed_config(tmp_path, tmp_path / "gone", "missing.yaml")
    assert main(["config", "validate", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "data.datasets[0].prefix" in err and "gone" in err and "->" in err

    # a truncated .bin
    bad = _dataset(tmp_path, "bad")
    binfile = bad.with_suffix(".bin")
    binfile.write_bytes(binfile.read_bytes()[: binfile.stat().st_size // 2])
    assert main(["config", "validate", str(_indexed_config(tmp_path, bad, "bad.yaml"))]) == 2
    err = capsys.readouterr().err
    assert "bad.bin" in err or "bad" in err.split("data.datasets[0].prefix", 1)[1], err

    # tokenized with another vocabulary
    docs = ["zebra quartz jam tree " * 20] * 30
    train_tokenizer(iter(docs), vocab_size=300, out_dir=tmp_path / "small")
    other = _dataset(tmp_path, "other", tokenizer=str(tmp_path / "small"))
    assert main(["config", "validate", str(_indexed_config(tmp_path, other, "other.yaml"))]) == 2
    err = capsys.readouterr().err
    assert "different vocabulary" in err and "Traceback" not in err
