"""Preprocessing: text / JSON lines -> .bin/.idx that megatron-core's IndexedDataset reads exactly."""

from __future__ import annotations

import gzip
import json
import os
import random

import numpy as np
import pytest

from workbench.cli import main as cli_main
from workbench.data.errors import DataError
from workbench.data.indexed import check_indexed, read_sidecar
from workbench.data.preprocess import preprocess
from workbench.data.tokenizer import load_tokenizer


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("and the light was good", "unto the land", "naïve café", "Ωμέγα", "🚀", "said he", "river", "1:2")
    out = []
    for _ in range(n):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 3))]
        out.append("\n".join(lines))
    return out


def _indexed(prefix):
    """megatron-core's reader. Keep the object alive while using its items (they view its mmap)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    return IndexedDataset(str(prefix))


@pytest.fixture()
def mixed_inputs(tmp_path):
    """A plain-text file (blank-line documents), a JSON-lines file and a gzipped JSON-lines file."""
    text_docs, json_docs, gz_docs = _docs(30, 1), _docs(25, 2), _docs(10, 3)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n\n\n".join(text_docs) + "\n", encoding="utf-8")
    with open(tmp_path / "in" / "b.jsonl", "w", encoding="utf-8") as fh:
        for i, d in enumerate(json_docs):
            fh.write(json.dumps({"id": i, "text": d}) + "\n")
    with gzip.open(tmp_path / "in" / "c.jsonl.gz", "wt", encoding="utf-8") as fh:
        for d in gz_docs:
            fh.write(json.dumps({"text": d}) + "\n")
    return tmp_path / "in", text_docs + json_docs + gz_docs


@pytest.mark.parametrize("workers", [1, 2])
def test_round_trip_matches_tokenizer_ids(tmp_path, mixed_inputs, workers):
    folder, docs = mixed_inputs
    tok = load_tokenizer("demo")
    summary = preprocess([folder], tmp_path / "out" / "ds", tokenizer="demo", append_eod=True, workers=workers, progress=False)
    ds = _indexed(tmp_path / "out" / "ds")
    assert len(ds) == len(docs) == summary.documents
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == tok.encode(doc) + [tok.eod]
    assert summary.tokens == sum(len(tok.encode(d)) + 1 for d in docs)
    assert ds.index.dtype == np.uint16  # megatron-core's own choice for a 4096-token vocabulary
    assert list(ds.document_indices) == list(range(len(docs) + 1))
    meta = read_sidecar(tmp_path / "out" / "ds")
    assert meta["tokenizer"]["name"] == "demo" and meta["documents"] == len(docs)
    assert meta["max_token_id"] == max(max(tok.encode(d)) for d in docs)


def test_multiprocess_output_is_byte_identical(tmp_path, mixed_inputs):
    folder, _ = mixed_inputs
    preprocess([folder], tmp_path / "one", workers=1, progress=False)
    preprocess([folder], tmp_path / "three", workers=3, progress=False)
    for suf in (".bin", ".idx"):
        assert (tmp_path / f"one{suf}").read_bytes() == (tmp_path / f"three{suf}").read_bytes()


def test_line_mode_glob_and_no_eod(tmp_path):
    lines = ["first line", "second line", "", "third after blank"]
    (tmp_path / "x1.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "x2.txt").write_text("fourth\n", encoding="utf-8")
    tok = load_tokenizer("demo")
    preprocess([str(tmp_path / "x*.txt")], tmp_path / "ds", split_docs="line", append_eod=False, progress=False)
    ds = _indexed(tmp_path / "ds")
    expected = ["first line", "second line", "third after blank", "fourth"]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in expected]


def test_custom_json_key(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"content": t}) for t in ["alpha beta", "gamma"]) + "\n", encoding="utf-8")
    tok = load_tokenizer("demo")
    preprocess([f], tmp_path / "ds", json_key="content", progress=False)
    ds = _indexed(tmp_path / "ds")  # keep it alive: its items are views of its memory map
    assert ds[1].tolist() == tok.encode("gamma") + [tok.eod]


# ------------------------------------------------------------------ bad input


def test_missing_and_empty_inputs(tmp_path):
    with pytest.raises(DataError, match="input file not found") as e:
        preprocess([tmp_path / "nope.txt"], tmp_path / "ds", progress=False)
    assert "nope.txt" in str(e.value)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty file") as e:
        preprocess([tmp_path / "empty.txt"], tmp_path / "ds", progress=False)
    assert "empty.txt" in str(e.value)
    (tmp_path / "blank.txt").write_text("\n\n   \n")
    with pytest.raises(DataError, match="no documents") as e:
        preprocess([tmp_path / "blank.txt"], tmp_path / "ds", progress=False)
    assert "blank.txt" in str(e.value)
    with pytest.raises(DataError, match="glob matches no files"):
        preprocess([str(tmp_path / "*.parquet")], tmp_path / "ds", progress=False)
    assert not list(tmp_path.glob("ds*"))


def test_json_line_without_key_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n\n{"body": "missing"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        preprocess([f], tmp_path / "ds", progress=False)
    assert f"{f}:3" in str(e.value) and "no key 'text'" in str(e.value) and "body" in str(e.value)
    f.write_text('{"text": "ok"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match="not valid JSON") as e:
        preprocess([f], tmp_path / "ds", progress=False)
    assert f"{f}:2" in str(e.value)
    # the same error surfaces unchanged through worker processes
    with pytest.raises(DataError) as e:
        preprocess([f], tmp_path / "ds", workers=2, progress=False)
    assert f"{f}:2" in str(e.value)
    assert not list(tmp_path.glob("ds*"))


def test_invalid_utf8_is_counted_and_reported(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("good line\n".encode() + "caf\xe9 in latin-1\n".encode("latin-1") + b"\nnext doc\n")
    tok = load_tokenizer("demo")
    s = preprocess([f], tmp_path / "rep", progress=False)
    assert s.invalid_utf8 == 1 and s.invalid_utf8_where == [f"{f}:2"]
    assert "invalid UTF-8" in str(s)
    rep = _indexed(tmp_path / "rep")
    assert rep[0].tolist() == tok.encode("good line\ncaf\ufffd in latin-1") + [tok.eod]
    s = preprocess([f], tmp_path / "skip", invalid_utf8="skip", progress=False)
    assert s.invalid_utf8 == 1
    skip = _indexed(tmp_path / "skip")
    assert skip[0].tolist() == tok.encode("good line") + [tok.eod]
    with pytest.raises(DataError, match="invalid UTF-8") as e:
        preprocess([f], tmp_path / "err", invalid_utf8="error", progress=False)
    assert f"{f}:2" in str(e.value)


def test_tokenizer_vocab_larger_than_model_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    with pytest.raises(DataError, match="exceeds the model's vocab_size 1000"):
        preprocess([tmp_path / "a.txt"], tmp_path / "ds", tokenizer="demo", model_vocab_size=1000, progress=False)
    assert not list(tmp_path.glob("ds*"))


def test_idx_bin_mismatch_and_bad_header(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(_docs(20)), encoding="utf-8")
    preprocess([tmp_path / "a.txt"], tmp_path / "ds", progress=False)
    info = check_indexed(tmp_path / "ds")
    assert info.documents == 20
    good_bin = (tmp_path / "ds.bin").read_bytes()
    good_idx = (tmp_path / "ds.idx").read_bytes()

    (tmp_path / "ds.bin").write_bytes(good_bin[:-6])  # a copy cut short
    with pytest.raises(DataError, match="does not match") as e:
        check_indexed(tmp_path / "ds")
    assert "ds.idx" in str(e.value) and "ds.bin" in str(e.value)

    (tmp_path / "ds.bin").write_bytes(good_bin)
    (tmp_path / "ds.idx").write_bytes(b"NOTANIDX!" + good_idx[9:])
    with pytest.raises(DataError, match="wrong header") as e:
        check_indexed(tmp_path / "ds")
    assert "ds.idx" in str(e.value)

    (tmp_path / "ds.idx").write_bytes(good_idx[:-16])
    with pytest.raises(DataError, match="truncated or corrupt"):
        check_indexed(tmp_path / "ds")

    # a .bin from another dataset of the same token count class but different size
    (tmp_path / "ds.idx").write_bytes(good_idx)
    (tmp_path / "ds.bin").write_bytes(good_bin + b"\x00\x00")
    with pytest.raises(DataError, match="does not match"):
        check_indexed(tmp_path / "ds")


def test_failed_run_keeps_the_previous_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(_docs(10)), encoding="utf-8")
    preprocess([tmp_path / "a.txt"], tmp_path / "ds", progress=False)
    before = {s: (tmp_path / f"ds{s}").read_bytes() for s in (".bin", ".idx")}
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"oops": 1}\n')
    with pytest.raises(DataError):
        preprocess([tmp_path / "a.txt", bad], tmp_path / "ds", progress=False)
    assert {s: (tmp_path / f"ds{s}").read_bytes() for s in (".bin", ".idx")} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ds")) == ["ds.bin", "ds.idx", "ds.workbench.json"]


def test_interrupted_commit_never_leaves_a_valid_looking_idx(tmp_path, monkeypatch):
    """Kill the run at the last step (the .idx rename): the old .idx is gone, the pair is refused."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (tmp_path / "a.txt").write_text("\n\n".join(_docs(10)), encoding="utf-8")
    preprocess([tmp_path / "a.txt"], tmp_path / "ds", progress=False)
    (tmp_path / "a.txt").write_text("\n\n".join(_docs(12, seed=5)), encoding="utf-8")
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt  # the process dies right before the .idx lands
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        preprocess([tmp_path / "a.txt"], tmp_path / "ds", progress=False)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "ds.idx").exists()
    assert not IndexedDataset.exists(str(tmp_path / "ds"))
    with pytest.raises(DataError, match="not found"):
        check_indexed(tmp_path / "ds")
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_cli_preprocess_summary_and_errors(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("\n\n".join(_docs(8)), encoding="utf-8")
    rc = cli_main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "ds"), "--json", "-q"])
    out = capsys.readouterr().out
    assert rc == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["documents"] == 8 and summary["tokens"] == check_indexed(tmp_path / "ds").tokens
    assert summary["tokens_per_s"] > 0
    rc = cli_main(["preprocess", "--input", str(tmp_path / "a.txt"), "--output-prefix", str(tmp_path / "ds2"), "--model-vocab-size", "1000", "-q"])
    err = capsys.readouterr().err
    assert rc == 2 and "exceeds" in err and "Traceback" not in err
    rc = cli_main(["preprocess", "--input", str(tmp_path / "zzz.txt"), "--output-prefix", str(tmp_path / "ds3"), "-q"])
    assert rc == 2 and "zzz.txt" in capsys.readouterr().err


def test_utf8_byte_order_mark_is_not_data(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "first"}).encode() + b"\n")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfsecond\n")
    tok = load_tokenizer("demo")
    preprocess([tmp_path / "bom.jsonl", tmp_path / "bom.txt"], tmp_path / "ds", progress=False)
    ds = _indexed(tmp_path / "ds")
    assert [ds[i].tolist() for i in range(2)] == [tok.encode("first") + [tok.eod], tok.encode("second") + [tok.eod]]
