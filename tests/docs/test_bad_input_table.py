"""docs/bad-input.md's table cannot drift: every row's command runs (the CLI in this process, in a directory
holding the files the page describes) and must exit with the row's status and print the row's message verbatim,
with no traceback.  The page is linked from docs/index.md."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import time

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.filterwarnings("ignore")

DOC = ROOT / "docs" / "bad-input.md"
ROW = re.compile(r"^\| (?P<what>.+?) \| `workbench (?P<cmd>[^`]+)` \| (?P<rc>\d+) \| `(?P<msg>[^`]+)` \|$")


def _rows() -> list[dict]:
    return [m.groupdict() for line in DOC.read_text().splitlines() if (m := ROW.match(line))]


def _files(work, ckpt_root):
    """The files docs/bad-input.md names, in ``work``."""
    from workbench.cli import main
    from workbench.config import load_config, preset
    from workbench.run import writer
    from workbench.checkpoint import TRACKER_FILE

    tiny = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1})
    tiny.save(work / "tiny.yaml")
    text = (work / "tiny.yaml").read_text()
    edits = {"typo.yaml": ("hidden_size:", "hiden_size:"), "heads.yaml": ("num_attention_heads: 4", "num_attention_heads: 5"),
             "batch.yaml": ("global_batch_size: 4", "global_batch_size: 5"), "tp2.yaml": ("tensor_parallel: 1", "tensor_parallel: 2")}
    for name, (old, new) in edits.items():
        assert old in text, old
        (work / name).write_text(text.replace(old, new, 1))
    (work / "nodata.yaml").write_text(text.replace("source: demo", "source: indexed")
                                      .replace("datasets: []", "datasets: [{prefix: missing/corpus, weight: 1}]"))
    (work / "broken.yaml").write_text("model: [unclosed\n")
    for name in ("ckpt", "damaged", "edited"):
        shutil.copytree(ckpt_root, work / name)
    shutil.copytree(ckpt_root.parent / "hf", work / "hf")
    shard = work / "damaged" / "iter_0000000" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    meta_file = work / "edited" / "iter_0000000" / "workbench.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["num_layers"] += 1
    meta_file.write_text(json.dumps(meta))
    load_config(work / "damaged" / "workbench_config.json").replace(
        **{"checkpoint.load_dir": "damaged", "parallel.device": "cpu"}).save(work / "resume-damaged.yaml")
    shutil.copytree(ckpt_root, work / "gone")
    (work / "gone" / TRACKER_FILE).write_text("30")  # the tracker names an iteration whose folder is not there
    load_config(work / "gone" / "workbench_config.json").replace(
        **{"checkpoint.load_dir": "gone", "parallel.device": "cpu"}).save(work / "resume-gone.yaml")
    tiny.replace(**{"checkpoint.save_dir": "owned"}).save(work / "owned.yaml")
    (work / "owned").mkdir()  # claimed by a live run: this process, as a bare backend's rank 0 (run/writer.py)
    me = os.getpid()
    (work / "owned" / writer.OWNER_FILE).write_text(json.dumps(
        {"run_dir": str(work / "other-run"), "host": writer.host_name(), "pid": me, "create_time": writer.process_started(me),
         "claimed": time.time(), "by": writer.RANK0}))
    (work / "notmine").mkdir()
    (work / "notmine" / "keep.txt").write_text("mine")
    (work / "docs.txt").write_text("the cat sat on the mat\n\na dog ran in the park\n")
    (work / "blank.txt").write_text("\n\n\n")
    assert main(["preprocess", "--input", "docs.txt", "--output-prefix", "data/corpus", "--tokenizer", "demo", "--quiet"]) == 0
    bin_file = work / "data" / "corpus.bin"
    bin_file.write_bytes(bin_file.read_bytes()[: bin_file.stat().st_size // 2])


def test_the_page_is_linked_and_its_rows_are_a_modest_few():
    rows = _rows()
    body = [ln for ln in DOC.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| Bad input")]
    assert len(rows) == len(body), [ln for ln in body if not ROW.match(ln)]  # every row in the checked form
    assert 20 <= len(rows) <= 40
    assert "(bad-input.md)" in (ROOT / "docs" / "index.md").read_text()


def test_every_row_exits_and_says_what_the_page_says(gpt2_checkpoint, tmp_path, monkeypatch, capsys):
    from workbench.cli import main

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    _files(work, gpt2_checkpoint)
    capsys.readouterr()
    wrong = []
    for row in _rows():
        try:
            rc = main(shlex.split(row["cmd"]))
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
        out = capsys.readouterr()
        text = out.out + out.err
        if rc != int(row["rc"]) or row["msg"] not in text or "Traceback" in text:
            wrong.append(f"workbench {row['cmd']}: exit {rc} (the page: {row['rc']})\n{text[-1500:]}")
    assert not wrong, "\n\n".join(wrong)
    for name in ("exported", "reshaped", "run", "out"):
        assert not (work / name).exists(), name  # refused: nothing written
    assert (work / "notmine" / "keep.txt").read_text() == "mine"
    assert json.loads((work / "owned" / ".workbench-writer.json").read_text())["pid"] == os.getpid()  # the owner's claim kept
