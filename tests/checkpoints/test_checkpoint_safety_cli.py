"""``workbench generate`` / ``workbench convert`` as real processes on hostile and damaged checkpoints
(exit 2 naming the file, nothing run), and generation's temporary directory removed after a real
run, successful or not."""

from __future__ import annotations

import builtins
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.support import ROOT
from workbench.checkpoint import find_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore")


class _Payload:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return builtins.exec, (f"open({self.path!r}, 'w').write('pwned')",)


def _workbench(*args, timeout=180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_cli_refuses_a_hostile_checkpoint_without_running_it(gpt2_checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, root)
    meta = find_checkpoint(root) / ".metadata"
    marker = tmp_path / "pwned"
    with open(meta, "rb") as fh:
        md = pickle.load(fh)  # our own file, just written
    md.planner_data = _Payload(marker)
    with open(meta, "wb") as fh:
        pickle.dump(md, fh)

    p = _workbench("generate", "--ckpt", root, "--prompt", "the cat", "--device", "cpu")
    assert p.returncode == 2 and str(meta) in p.stderr and "builtins.exec" in p.stderr, p.stdout + p.stderr
    p = _workbench("convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf")
    assert p.returncode == 2 and str(meta) in p.stderr, p.stdout + p.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_cli_names_a_truncated_data_file(gpt2_checkpoint, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, root)
    f = find_checkpoint(root) / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:1000])
    for args in (("generate", "--ckpt", root, "--prompt", "the cat", "--device", "cpu"),
                 ("convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"),
                 ("convert", "inspect", root)):
        p = _workbench(*args)
        assert p.returncode == 2 and f"{f} is truncated" in p.stderr and "copy the checkpoint again" in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr


def test_generate_removes_its_temp_dir_after_success_and_failure(gpt2_checkpoint, tmp_path, monkeypatch):
    from workbench.generation import generate

    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where generate makes its work dir
    out = generate(gpt2_checkpoint, ["the cat"], max_new_tokens=3, greedy=True, device="cpu", timeout=240)
    assert len(out) == 1 and len(out[0].token_ids) == 3
    assert not list(private.glob("workbench-generate-*"))
    with pytest.raises((subprocess.TimeoutExpired, RuntimeError)):
        generate(gpt2_checkpoint, ["the cat"], max_new_tokens=3, device="cpu", timeout=0.5)  # killed mid-start
    assert not list(private.glob("workbench-generate-*"))


def test_verification_stays_torch_free(gpt2_checkpoint):
    """Launch and generation pre-checks run it in the notebook / CLI process: no torch import."""
    code = ("import sys; from workbench.checkpoint import verify_checkpoint; from workbench.checkpoint import "
            f"find_checkpoint; verify_checkpoint(find_checkpoint({str(gpt2_checkpoint)!r})); print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr
