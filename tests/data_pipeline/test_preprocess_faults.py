"""`workbench preprocess` killed (SIGKILL) mid-write or out of disk (a file size limit: writes
fail with EFBIG) never leaves a .bin/.idx pair that loads; a previous dataset at the prefix is untouched."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.data.errors import DataError
from workbench.data.indexed import check_indexed
from workbench.data.preprocess import preprocess

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "cloud", "seven", "north"]


def _corpus(path: Path, docs: int, words: int = 200, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(docs):
            fh.write(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n\n")
    return path


def _cmd(inp: Path, prefix: Path) -> list[str]:
    return [sys.executable, "-m", "workbench.cli", "preprocess", "--input", str(inp), "--output-prefix", str(prefix),
            "--tokenizer", "demo", "--quiet"]


def _previous(tmp_path: Path) -> tuple[Path, dict]:
    prefix = tmp_path / "ds"
    preprocess([_corpus(tmp_path / "old.txt", 20, seed=1)], prefix, progress=False)
    return prefix, {s: (tmp_path / f"ds{s}").read_bytes() for s in (".bin", ".idx")}


def _assert_previous_intact(tmp_path: Path, prefix: Path, before: dict) -> None:
    assert {s: (tmp_path / f"ds{s}").read_bytes() for s in (".bin", ".idx")} == before
    assert check_indexed(prefix).sequences == 20


def test_out_of_disk_leaves_no_half_written_dataset(tmp_path):
    big = _corpus(tmp_path / "big.txt", 2000)  # ~400k tokens: the .bin passes the 256 KiB limit

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.RLIM_INFINITY))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    fresh = subprocess.run(_cmd(big, tmp_path / "fresh"), env=env, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 1, fresh.stderr[-2000:]
    assert "File too large" in fresh.stderr and "free disk space" in fresh.stderr and "Traceback" not in fresh.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fresh")]  # nothing half-written, no temp files
    with pytest.raises(DataError, match="not found"):
        check_indexed(tmp_path / "fresh")

    prefix, before = _previous(tmp_path)  # over an existing dataset: the old one stays whole
    again = subprocess.run(_cmd(big, prefix), env=env, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1
    _assert_previous_intact(tmp_path, prefix, before)


def test_killed_mid_write_leaves_the_previous_dataset_and_no_loadable_pair(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix, before = _previous(tmp_path)
    big = _corpus(tmp_path / "big.txt", 8000)  # long enough to be killed while writing
    proc = subprocess.Popen(_cmd(big, prefix), env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    tmp_bin = None
    while time.time() < deadline and proc.poll() is None:
        tmp_bin = next((p for p in tmp_path.iterdir() if p.name.startswith("ds.bin.tmp-")), None)
        if tmp_bin is not None and tmp_bin.stat().st_size > 0:
            break
        time.sleep(0.02)
    assert proc.poll() is None and tmp_bin is not None, "preprocess finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _assert_previous_intact(tmp_path, prefix, before)
    assert IndexedDataset.exists(str(prefix))  # the old pair, not a new half one
    # a fresh prefix killed the same way: nothing that loads
    proc = subprocess.Popen(_cmd(big, tmp_path / "new"), env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while time.time() < deadline + 60 and proc.poll() is None:
        if any(p.name.startswith("new.bin.tmp-") and p.stat().st_size > 0 for p in tmp_path.iterdir()):
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "new.idx").exists() and not (tmp_path / "new.bin").exists()
    with pytest.raises(DataError, match="not found"):
        check_indexed(tmp_path / "new")
    # the next run on the prefix cleans the killed run's temporary files and succeeds
    preprocess([_corpus(tmp_path / "small.txt", 10, seed=3)], tmp_path / "new", progress=False)
    assert check_indexed(tmp_path / "new").sequences == 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("new") and ".tmp-" in p.name]
