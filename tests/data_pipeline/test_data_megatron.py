"""megatron-core GPTDataset / BlendedDataset built from workbench configs: lengths, labels, splits, blends."""

from __future__ import annotations

import random

import numpy as np
import pytest

from workbench.config import DatasetEntry, preset
from workbench.data.errors import DataError
from workbench.datasets import build_datasets, dataset_sizes
from workbench.data.preprocess import preprocess
from workbench.data.tokenizer import load_tokenizer


def _write_docs(path, n, word_pool, seed, min_words=20, max_words=120):
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(word_pool) for _ in range(rng.randint(min_words, max_words))) for _ in range(n)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return docs


def _cfg(tmp_path, **overrides):
    base = {"data.cache_dir": str(tmp_path / "cache"), "train.train_iters": 20}
    base.update(overrides)
    return preset("tiny", **base)


def _indexed(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    from workbench.data.demo import ensure_demo_dataset

    cache = tmp_path_factory.mktemp("demo_cache")
    prefix = ensure_demo_dataset(cache)
    return cache, prefix


def test_demo_corpus_dataset_is_the_embedded_text(demo_cache):
    import gzip

    from workbench.data.demo import DEMO_CORPUS

    _, prefix = demo_cache
    chapters = [c for c in gzip.open(DEMO_CORPUS, "rt", encoding="utf-8").read().split("\n\n") if c.strip()]
    tok = load_tokenizer("demo")
    ds = _indexed(prefix)
    assert len(ds) == len(chapters) == 1189  # the 1,189 chapters of the King James Bible
    first, last = ds[0].tolist(), ds[len(ds) - 1].tolist()
    assert first == tok.encode(chapters[0]) + [tok.eod]
    assert tok.decode(first).startswith("Genesis 1\n1 In the beginning God created the heaven and the earth.")
    assert tok.decode(last[:-1]) == chapters[-1].strip()


def test_gpt_samples_have_seq_length_and_shifted_labels(tmp_path, demo_cache):
    cache, prefix = demo_cache
    cfg = _cfg(tmp_path, **{"data.cache_dir": str(cache)})
    train, valid, test = build_datasets(cfg, tmp_path / "run")
    sizes = dataset_sizes(cfg)
    assert len(train) >= sizes.train and len(valid) >= sizes.valid and len(test) >= sizes.test
    ds = _indexed(prefix)
    seq = cfg.model.seq_length
    for i in range(0, 40, 7):
        s = train[i]
        assert s["tokens"].shape == (seq,) and s["labels"].shape == (seq,)
        assert s["position_ids"].tolist() == list(range(seq))
        # rebuild the sample independently from the raw documents megatron-core's indices point at
        j = int(train.shuffle_index[i])
        (d0, off0), (d1, _) = train.sample_index[j], train.sample_index[j + 1]
        stream = np.concatenate([ds[int(train.document_index[k])] for k in range(int(d0), int(d1) + 1)]).astype(np.int64)
        window = stream[int(off0): int(off0) + seq + 1]
        assert s["tokens"].tolist() == window[:-1].tolist()
        assert s["labels"].tolist() == window[1:].tolist()
    # train samples come only from the train split's documents (split 949,50,1 of 1189 chapters)
    n_train_docs = round(0.949 * len(ds))
    assert set(np.unique(train.document_index).tolist()) <= set(range(n_train_docs))
    assert set(np.unique(valid.document_index).tolist()) <= set(range(n_train_docs, round(0.999 * len(ds))))


def test_splits_give_requested_document_proportions(tmp_path):
    _write_docs(tmp_path / "a.txt", 200, ["sun", "moon", "star", "sky", "rain"], seed=0)
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    cfg = _cfg(tmp_path, **{"data.source": "indexed", "data.split": "80,15,5",
                            "data.datasets": [{"prefix": str(tmp_path / "a"), "weight": 1.0}]})
    train, valid, test = build_datasets(cfg, tmp_path / "run")
    assert len(train.indices) == 160 and len(valid.indices) == 30 and len(test.indices) == 10
    assert train.indices.tolist() == list(range(0, 160))
    assert valid.indices.tolist() == list(range(160, 190))
    assert test.indices.tolist() == list(range(190, 200))
    assert not set(train.document_index.tolist()) & set(valid.document_index.tolist())


def test_blend_weights_give_requested_sample_proportions(tmp_path):
    tok = load_tokenizer("demo")
    pool_a, pool_b = ["alpha", "beta", "gamma"], ["river", "mountain", "valley"]
    _write_docs(tmp_path / "a.txt", 60, pool_a, seed=1)
    _write_docs(tmp_path / "b.txt", 60, pool_b, seed=2)
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    preprocess([tmp_path / "b.txt"], tmp_path / "b", progress=False)
    cfg = _cfg(tmp_path, **{"data.source": "indexed", "data.split": "100,0,0", "train.train_iters": 500,
                            "data.datasets": [{"prefix": str(tmp_path / "a"), "weight": 1.0},
                                              {"prefix": str(tmp_path / "b"), "weight": 3.0}]})
    train, valid, test = build_datasets(cfg, tmp_path / "run")
    assert valid is None and test is None  # weight 0 in the split string
    n = dataset_sizes(cfg).train
    assert len(train) == n
    from_a = float(np.mean(train.dataset_index[:n] == 0))
    assert abs(from_a - 0.25) < 0.01
    ids_a = {i for w in pool_a for i in tok.encode(" " + w) + tok.encode(w)}
    ids_b = {i for w in pool_b for i in tok.encode(" " + w) + tok.encode(w)}
    for i in range(30):  # each sample really comes from the dataset the blend index names
        toks = set(train[i]["tokens"].tolist()) - {tok.eod, tok.encode(" ")[0]}
        expected = ids_a if train.dataset_index[i] == 0 else ids_b
        assert toks <= expected


def test_eod_handling_options(tmp_path):
    _write_docs(tmp_path / "a.txt", 80, ["a", "b", "c"], seed=3, min_words=3, max_words=12)  # short docs: many EODs per sample
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    tok = load_tokenizer("demo")
    common = {"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "a")}], "data.split": "90,10,0"}
    plain, _, _ = build_datasets(_cfg(tmp_path, **common), tmp_path / "run")
    reset, _, _ = build_datasets(_cfg(tmp_path, **common, **{"data.reset_position_ids": True, "data.reset_attention_mask": True,
                                                            "data.eod_mask_loss": True}), tmp_path / "run")
    s0, s1 = plain[0], reset[0]
    assert s0["tokens"].tolist() == s1["tokens"].tolist()  # same data, same order; only masks differ
    tokens = s1["tokens"].tolist()
    assert tok.eod in tokens
    assert s0["loss_mask"].tolist() == [1.0] * len(tokens)
    assert s1["loss_mask"].tolist() == [0.0 if t == tok.eod else 1.0 for t in tokens]
    expected_pos, p = [], 0
    for t in tokens:
        expected_pos.append(p)
        p = 0 if t == tok.eod else p + 1
    assert s1["position_ids"].tolist() == expected_pos
    k = tokens.index(tok.eod)
    # megatron-core's mask is True where attention is NOT allowed
    assert not bool(s0["attention_mask"][0, k + 1, k]) and bool(s1["attention_mask"][0, k + 1, k])
    assert not bool(s1["attention_mask"][0, k + 1, k + 1])


def test_index_cache_is_reused(tmp_path):
    _write_docs(tmp_path / "a.txt", 50, ["x", "y"], seed=4)
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    cfg = _cfg(tmp_path, **{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "a")}], "data.split": "90,10,0"})
    first, _, _ = build_datasets(cfg, tmp_path / "run")
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert any(f.endswith("shuffle_index.npy") for f in files)
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    again, _, _ = build_datasets(cfg, tmp_path / "run")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == mtimes
    assert again[3]["tokens"].tolist() == first[3]["tokens"].tolist()
    # without data.cache_dir the cache goes under the run directory
    cfg2 = cfg.replace(**{"data.cache_dir": None})
    build_datasets(cfg2, tmp_path / "run2")
    assert any(p.name.endswith("shuffle_index.npy") for p in (tmp_path / "run2" / "data_cache").iterdir())


# ------------------------------------------------------------------ bad input, caught before megatron-core


def test_bad_data_configs_are_refused_with_the_fix(tmp_path):
    _write_docs(tmp_path / "a.txt", 10, ["x", "y"], seed=5)
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    indexed = {"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "a")}]}

    with pytest.raises(DataError, match="4096 exceeds model.vocab_size 1000"):
        build_datasets(_cfg(tmp_path, **indexed, **{"model.vocab_size": 1000}), tmp_path / "run")
    with pytest.raises(DataError, match="not found") as e:
        build_datasets(_cfg(tmp_path, **{**indexed, "data.datasets": [{"prefix": str(tmp_path / "missing")}]}), tmp_path / "run")
    assert "missing" in str(e.value)
    # 10 documents split 949,50,1: the test split would get no document (megatron-core would loop forever)
    with pytest.raises(DataError, match="test split no documents"):
        build_datasets(_cfg(tmp_path, **indexed), tmp_path / "run")
    with pytest.raises(DataError, match="synthetic"):
        build_datasets(_cfg(tmp_path, **{"data.source": "synthetic"}), tmp_path / "run")


def test_data_tokenized_beyond_the_model_vocab_is_refused(tmp_path):
    from workbench.data.indexed import sidecar_path
    from workbench.data.tokenizer import train_tokenizer

    docs = _write_docs(tmp_path / "a.txt", 40, ["zebra", "quartz", "xylophone", "jam"], seed=6)
    small = train_tokenizer(iter(docs), vocab_size=300, out_dir=tmp_path / "small")
    preprocess([tmp_path / "a.txt"], tmp_path / "a", tokenizer="demo", progress=False)  # ids up to ~4k
    cfg = _cfg(tmp_path, **{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "a")}],
                            "data.split": "90,10,0", "data.tokenizer": str(tmp_path / "small"), "model.vocab_size": 320})
    assert small.vocab_size <= 320
    with pytest.raises(DataError, match="was tokenized with 'demo'"):
        build_datasets(cfg, tmp_path / "run")
    sidecar_path(tmp_path / "a").unlink()  # a dataset made elsewhere: the .bin itself is scanned
    with pytest.raises(DataError, match="holds token id"):
        build_datasets(cfg, tmp_path / "run")


def test_data_made_with_another_tokenizer_is_refused(tmp_path):
    from workbench.data.tokenizer import train_tokenizer

    docs = _write_docs(tmp_path / "a.txt", 40, ["zebra", "quartz", "xylophone", "jam"], seed=7)
    train_tokenizer(iter(docs), vocab_size=300, out_dir=tmp_path / "small")
    preprocess([tmp_path / "a.txt"], tmp_path / "a", tokenizer=str(tmp_path / "small"), progress=False)
    cfg = _cfg(tmp_path, **{"data.source": "indexed", "data.datasets": [{"prefix": str(tmp_path / "a")}], "data.split": "90,10,0"})
    assert cfg.data.tokenizer == "demo"
    with pytest.raises(DataError, match="different vocabulary") as e:
        build_datasets(cfg, tmp_path / "run")
    assert str(tmp_path / "small") in str(e.value)
    train, _, _ = build_datasets(cfg.replace(**{"data.tokenizer": str(tmp_path / "small")}), tmp_path / "run")
    assert len(train) > 0


def test_demo_source_follows_data_tokenizer(tmp_path):
    import gzip

    from workbench.data.demo import DEMO_CORPUS
    from workbench.data.tokenizer import train_tokenizer

    chapters = [c for c in gzip.open(DEMO_CORPUS, "rt", encoding="utf-8").read().split("\n\n") if c.strip()]
    small = train_tokenizer(iter(chapters[:50]), vocab_size=512, out_dir=tmp_path / "small")
    cfg = _cfg(tmp_path, **{"data.tokenizer": str(tmp_path / "small")})
    train, _, _ = build_datasets(cfg, tmp_path / "run")
    built = [p for p in (tmp_path / "cache" / "demo").iterdir() if p.name.endswith(".idx")]
    assert len(built) == 1
    ds = _indexed(str(built[0])[:-4])
    assert ds[0].tolist() == small.encode(chapters[0]) + [small.eod]
    assert max(int(train[i]["tokens"].max()) for i in range(10)) < small.vocab_size


@pytest.mark.parametrize("split", ["949,50,1", "80,15,5", "100,0,0", "90/10/0", "1,1,1", "0,1,0", "98,2", "7"])
@pytest.mark.parametrize("n", [1, 10, 1189])
def test_split_ranges_equal_megatron_cores(split, n):
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    from workbench.datasets import split_ranges

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    expected = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
    assert split_ranges(split, n) == expected


def test_check_data_reports_problems_before_launch(tmp_path):
    import subprocess
    import sys

    from workbench.datasets import check_data

    _write_docs(tmp_path / "a.txt", 10, ["x", "y"], seed=8)
    preprocess([tmp_path / "a.txt"], tmp_path / "a", progress=False)
    good = _cfg(tmp_path, **{"data.source": "indexed", "data.split": "90,10,0", "data.datasets": [{"prefix": str(tmp_path / "a")}]})
    assert check_data(good) == []
    assert check_data(preset("tiny")) == []  # the demo corpus and its tokenizer fit the tiny preset
    assert check_data(preset("tiny", **{"data.source": "synthetic", "data.tokenizer": "/nowhere"})) == []

    bad = good.replace(**{"data.split": "949,50,1",
                          "data.datasets": [{"prefix": str(tmp_path / "a")}, {"prefix": str(tmp_path / "gone")}]})
    problems = check_data(bad)
    assert [p.field for p in problems] == ["data.datasets[0].prefix", "data.datasets[1].prefix"]
    assert "test split no documents" in str(problems[0]) and "gone" in str(problems[1])
    small = check_data(good.replace(**{"model.vocab_size": 1000}))
    assert small[0].field == "model.vocab_size" and "exceeds model.vocab_size 1000" in str(small[0])
    assert [p.field for p in check_data(good.replace(**{"data.tokenizer": "gpt2"}))] == ["data.tokenizer"]

    # light enough for a notebook kernel or the launcher: no torch, no megatron-core
    code = ("import sys; from workbench.config import preset; from workbench.datasets import check_data; "
            "assert check_data(preset('tiny')) == []; "
            "assert not [m for m in ('torch', 'megatron') if m in sys.modules]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
