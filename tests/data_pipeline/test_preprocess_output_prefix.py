"""``workbench preprocess`` with an ``--output-prefix`` whose directory cannot be written (``/proc``, a path through a
file, a read-only tmpfs) says what is wrong with it (exit 2, before any input is read), not "free disk space"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _preprocess(inp: Path, prefix: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", "preprocess", "--input", str(inp), "--output-prefix",
                           str(prefix), "--tokenizer", "demo", "--quiet"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture()
def corpus(tmp_path) -> Path:
    f = tmp_path / "in.txt"
    f.write_text("the cat sat on the mat\n\na dog ran in the park\n")
    return f


@pytest.mark.parametrize("where", ["proc", "through-a-file"])
def test_an_output_prefix_that_cannot_be_written_names_the_problem(corpus, where):
    prefix = "/proc/nope/p" if where == "proc" else f"{corpus}/p"
    said = "/proc/nope cannot be made: no file can be made in /proc" if where == "proc" else f"{corpus} is a file, not a directory"
    p = _preprocess(corpus, prefix)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"--output-prefix: {prefix}: {said}" in p.stderr and "choose an --output-prefix" in p.stderr, p.stderr
    assert "free disk space" not in p.stderr and "Traceback" not in p.stderr


def test_a_read_only_output_directory_is_refused(corpus, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        p = _preprocess(corpus, ro / "data" / "p")
        assert p.returncode == 2, p.stderr[-2000:]
        assert f"{ro} is on a read-only file system" in p.stderr and "free disk space" not in p.stderr, p.stderr
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
