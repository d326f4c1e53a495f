"""A newest iteration whose ``workbench.json`` was deleted (not corrupted) is refused the way a corrupt one is: exit 2
naming the file and the fix from every reader of "the latest checkpoint" (``inspect``, ``megatron-to-hf``, ``generate``,
the launch pre-check of a run that loads it), never a silent fall-back to the iteration before it.  A save renames an
iteration into place only after writing that file, so its absence is damage, not an interrupted save.

One real checkpoint (``gpt2_checkpoint``); each test deletes the manifest in a private copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT
from workbench.run.checkpoint import CheckpointError, find_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore")


def _cli(argv, capsys) -> tuple[int, str]:
    from workbench.cli import main

    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture(params=["tracker-names-it", "tracker-older"])
def newest_without_manifest(ckpt, request):
    """(root, the older complete iteration, the newer one whose workbench.json is gone).  The tracker names the newer
    one (a finished save) or still the older one (a tracker write that did not happen): the same either way."""
    root, d = ckpt
    newer = root / "iter_0000030"
    shutil.copytree(d, newer)
    meta = json.loads((newer / "workbench.json").read_text())
    (newer / "workbench.json").write_text(json.dumps({**meta, "iteration": 30}))
    if request.param == "tracker-names-it":
        (root / "latest_checkpointed_iteration.txt").write_text("30")
        assert find_checkpoint(root) == newer
    os.remove(newer / "workbench.json")
    return root, d, newer


def test_find_checkpoint_refuses_instead_of_falling_back(newest_without_manifest):
    root, d, newer = newest_without_manifest
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(root)
    msg = str(e.value)
    assert f"{newer / 'workbench.json'} is missing" in msg and f"point at {d}" in msg and "copy the checkpoint again" in msg, msg
    assert find_checkpoint(d) == d  # the older one, asked for explicitly, still loads


def test_every_reader_exits_2_naming_the_missing_manifest(newest_without_manifest, tmp_path, capsys):
    root, d, newer = newest_without_manifest
    want = f"{newer / 'workbench.json'} is missing"
    rc, out = _cli(["convert", "inspect", root], capsys)
    assert rc == 2 and want in out and "iteration: 0" not in out, out
    rc, out = _cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf", "--quiet"], capsys)
    assert rc == 2 and want in out and not (tmp_path / "hf").exists(), out
    rc, out = _cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"], capsys)
    assert rc == 2 and want in out and not (tmp_path / "rs").exists(), out
    rc, out = _cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and want in out and "Traceback" not in out, out


def test_a_run_that_loads_it_is_refused_before_it_starts(newest_without_manifest, tmp_path):
    """``workbench launch --dry-run`` of the config the conversion wrote (``checkpoint.load_dir``: this root), as a real
    process: exit 2 with the field, the file and the fix, where today it passes and the run loads iteration 0."""
    from workbench.config import load_config

    root, d, newer = newest_without_manifest
    cfg = load_config(root / "workbench_config.json").replace(**{"checkpoint.load_dir": str(root)})
    cfg.save(tmp_path / "resume.json")
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", str(tmp_path / "resume.json"), "--dry-run",
                        "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=180, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "checkpoint.load_dir" in p.stderr and f"{newer / 'workbench.json'} is missing" in p.stderr, p.stderr
    assert f"point at {d}" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists()
