"""A newest iteration whose ``workbench.json`` was deleted (not corrupted), or whose whole folder was deleted while
the tracker (``latest_checkpointed_iteration.txt``) still names it, is refused the way a corrupt one is: exit 2
naming the file and the fix from every reader of "the latest checkpoint" (``inspect``, ``megatron-to-hf``, ``reshape``,
``verify``, ``generate``, the launch pre-check of a run that loads it and the backend's own start), never a silent
fall-back to the iteration before it.  A save renames an iteration into place only after writing that file, and
writes the tracker last, so their absence is damage, not an interrupted save.

One real checkpoint (``gpt2_checkpoint``); each test deletes the manifest (or the folder) in a private copy.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.support import ROOT
from workbench.checkpoint import CheckpointError, find_checkpoint
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(params=["tracker-names-it", "tracker-older", "folder-deleted"])
def newest_without_manifest(ckpt, request):
    """(root, the older complete iteration, the newer one whose workbench.json is gone).  The tracker names the newer
    one (a finished save) or still the older one (a tracker write that did not happen): the same either way; or the
    tracker names it and its whole folder is gone."""
    root, d = ckpt
    newer = root / "iter_0000030"
    shutil.copytree(d, newer)
    meta = json.loads((newer / "workbench.json").read_text())
    (newer / "workbench.json").write_text(json.dumps({**meta, "iteration": 30}))
    if request.param != "tracker-older":
        (root / "latest_checkpointed_iteration.txt").write_text("30")
        assert find_checkpoint(root) == newer
    if request.param == "folder-deleted":
        shutil.rmtree(newer)
    else:
        os.remove(newer / "workbench.json")
    return root, d, newer


def test_find_checkpoint_refuses_instead_of_falling_back(newest_without_manifest):
    root, d, newer = newest_without_manifest
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(root)
    msg = str(e.value)
    assert f"{newer / 'workbench.json'} is missing" in msg and f"point at {d}" in msg and "copy the checkpoint again" in msg, msg
    assert find_checkpoint(d) == d  # the older one, asked for explicitly, still loads


def test_every_reader_exits_2_naming_the_missing_manifest(newest_without_manifest, gpt2_checkpoint, tmp_path, capfd):
    root, d, newer = newest_without_manifest
    want = f"{newer / 'workbench.json'} is missing"
    rc, out = run_cli(["convert", "inspect", root], capfd)
    assert rc == 2 and want in out and "iteration: 0" not in out, out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf", "--quiet"], capfd)
    assert rc == 2 and want in out and not (tmp_path / "hf").exists(), out
    rc, out = run_cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"], capfd)
    assert rc == 2 and want in out and not (tmp_path / "rs").exists(), out
    rc, out = run_cli(["convert", "verify", "--ckpt", root, "--hf", gpt2_checkpoint.parent / "hf", "--seq-length", "8",
                    "--batch-size", "1"], capfd)
    assert rc == 2 and want in out and "Traceback" not in out, out
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capfd)
    assert rc == 2 and want in out and "Traceback" not in out, out


@pytest.mark.parametrize("newest_without_manifest", ["folder-deleted"], indirect=True)
def test_a_resume_without_a_launch_exits_2_before_its_first_step(newest_without_manifest, tmp_path, capfd, monkeypatch):
    """``torchrun ... -m workbench.rank`` (a SLURM script's line), its rank 0 in this process: the launch's pre-check
    of the checkpoint, exit 2 before any step, where it used to fail in the load with exit 1 and a traceback; so is
    the older iteration once one of its files is damaged (rank 0 checks the checksums)."""
    from workbench.rank.train import main as backend_main
    from workbench.config import load_config

    root, d, newer = newest_without_manifest
    shard = d / "__0_0.distcp"
    monkeypatch.setenv("RANK", "0")
    for load_dir, says in ((root, [f"{newer / 'workbench.json'} is missing", f"point at {d}"]),
                           (d, [f"checkpoint {d} is damaged: {shard} does not match its checksum from the save"])):
        if load_dir == d:
            data = bytearray(shard.read_bytes())
            data[len(data) // 2] ^= 0xFF
            shard.write_bytes(bytes(data))
        cfg = load_config(root / "workbench_config.json").replace(**{"checkpoint.load_dir": str(load_dir)})
        cfg.save(tmp_path / "resume.json")
        try:
            rc = backend_main(["--config", str(tmp_path / "resume.json"), "--run-dir", str(tmp_path / "run")])
        finally:
            faulthandler.unregister(signal.SIGUSR1)  # what the backend's main registers for its stacks
        err = capfd.readouterr().err
        assert rc == 2 and "checkpoint.load_dir" in err and all(s in err for s in says) and "Traceback" not in err, err
        assert not (tmp_path / "run").exists()


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


def test_a_legacy_megatron_lm_tracker_naming_a_deleted_iteration_is_refused(tmp_path, capfd):
    """``workbench convert legacy``: megatron's own tracker names an iteration whose folder is gone, or holds no
    iteration at all: exit 2 naming the tracker and the fix (it said "no mp_rank_XX" of the root, or raised a
    ValueError), never the older iteration beside it."""
    root = tmp_path / "legacy"
    (root / "iter_0000010" / "mp_rank_00").mkdir(parents=True)
    (root / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    tracker = root / "latest_checkpointed_iteration.txt"
    for text, says in (("20", f"{tracker} names iter_0000020, but {root / 'iter_0000020'} is not there"),
                       ("oops", f"{tracker} holds 'oops', not an iteration number or 'release'"),
                       ("\u00b2", f"{tracker} holds '\u00b2', not an iteration number or 'release'")):  # isdigit() takes it
        tracker.write_text(text)
        rc, out = run_cli(["convert", "legacy", "--load", root, "--out", tmp_path / "out"], capfd)
        assert rc == 2 and says in out and "Traceback" not in out, out
        assert not (tmp_path / "out").exists()
