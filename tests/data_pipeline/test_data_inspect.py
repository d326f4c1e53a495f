"""`workbench data inspect/check/demo`: the numbers a person sees match the data that was written."""

from __future__ import annotations

import json

import pytest

from workbench.cli import main as cli_main
from workbench.data.errors import DataError
from workbench.data.inspect import inspect_dataset, plot_lengths
from workbench.data.preprocess import preprocess
from workbench.data.tokenizer import load_tokenizer

DOCS = [
    "short one",
    "a somewhat longer document about rivers, mountains and the sea",
    "x",
    "the last document of the set\nwith a second line",
] + [f"filler document number {i} " * (1 + i % 7) for i in range(40)]


@pytest.fixture()
def dataset(tmp_path):
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n", encoding="utf-8")
    preprocess([tmp_path / "docs.jsonl"], tmp_path / "ds", progress=False)
    return tmp_path / "ds"


def test_report_counts_lengths_and_decoded_samples(dataset):
    tok = load_tokenizer("demo")
    lengths = [len(tok.encode(d)) + 1 for d in DOCS]
    r = inspect_dataset(dataset, samples=5, bins=8)
    assert r.documents == r.sequences == len(DOCS)
    assert r.tokens == sum(lengths)
    assert (r.length_min, r.length_max) == (min(lengths), max(lengths))
    assert r.length_mean == pytest.approx(sum(lengths) / len(lengths))
    assert sum(r.hist_counts) == len(DOCS) and len(r.hist_edges) == len(r.hist_counts) + 1
    assert r.tokenizer == "demo"  # taken from the sidecar preprocess wrote
    assert len(r.samples) == 5
    for s in r.samples:
        assert s["text"] == DOCS[s["index"]] + "<|endoftext|>"
        assert s["length"] == lengths[s["index"]]
    text = str(r)
    assert f"documents {len(DOCS)}" in text and "length histogram" in text


def test_plot_is_written(dataset, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot_lengths(inspect_dataset(dataset, samples=0), tmp_path / "plots" / "lengths.png")
    plt.close(fig)
    data = (tmp_path / "plots" / "lengths.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_without_a_known_tokenizer_samples_show_ids(dataset):
    from workbench.data.indexed import sidecar_path

    sidecar_path(dataset).unlink()
    r = inspect_dataset(dataset, samples=2)
    assert r.tokenizer is None and r.samples[0]["text"] is None
    tok = load_tokenizer("demo")
    assert r.samples[0]["ids"] == (tok.encode(DOCS[r.samples[0]["index"]]) + [tok.eod])[:32]


def test_cli_inspect_check_and_errors(dataset, tmp_path, capsys):
    assert cli_main(["data", "inspect", str(dataset), "--plot", str(tmp_path / "h.png"), "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert f"documents {len(DOCS)}" in out and (tmp_path / "h.png").is_file()
    assert cli_main(["data", "inspect", str(dataset) + ".idx", "--json", "--samples", "1"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["documents"] == len(DOCS)
    assert cli_main(["data", "check", str(dataset)]) == 0
    assert "ok" in capsys.readouterr().out
    raw = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(b"XXXXXXXXX" + raw[9:])
    assert cli_main(["data", "check", str(dataset)]) == 2
    err = capsys.readouterr().err
    assert "ds.idx" in err and "header" in err
    assert cli_main(["data", "inspect", str(tmp_path / "nothing")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(DataError):
        inspect_dataset(dataset)


def test_cli_demo_builds_once_and_reuses(tmp_path, capsys):
    assert cli_main(["data", "demo", "--cache-dir", str(tmp_path), "-q"]) == 0
    prefix = capsys.readouterr().out.strip().splitlines()[-1]
    assert prefix.startswith(str(tmp_path / "demo"))
    mtime = (tmp_path / "demo" / (prefix.split("/")[-1] + ".idx")).stat().st_mtime_ns
    assert cli_main(["data", "demo", "--cache-dir", str(tmp_path), "-q"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == prefix
    assert (tmp_path / "demo" / (prefix.split("/")[-1] + ".idx")).stat().st_mtime_ns == mtime
