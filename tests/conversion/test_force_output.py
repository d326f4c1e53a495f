"""``--force`` replaces only an output that a conversion wrote earlier (the marker it leaves), never anything else:
a folder of the user's files, the input checkpoint, a folder holding it or one inside it, a symbolic link's target,
a file.  Each is refused with exit 2 naming the path and the fix, and every file is left as it was.

One real checkpoint (``gpt2_checkpoint``: a random HF GPT-2 through ``hf_to_megatron``); each test works on a copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")

MARKER = ".workbench-convert.json"


def _tree(d: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``d``: relative path -> (size, mtime in ns); what a refused conversion must leave alone."""
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture()
def root(gpt2_checkpoint, tmp_path) -> Path:
    """A copy of the checkpoint root with a second iteration (as a training run leaves several)."""
    import json

    r = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, r)
    later = r / "iter_0000005"
    shutil.copytree(r / "iter_0000000", later)
    meta = json.loads((later / "workbench.json").read_text())
    (later / "workbench.json").write_text(json.dumps({**meta, "iteration": 5}))
    (r / "latest_checkpointed_iteration.txt").write_text("5")
    return r


def test_force_never_replaces_a_folder_that_no_conversion_wrote(root, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "sub" / "code.py").write_text("print('mine')\n")
    before = _tree(mine)
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", mine, "--force", "--quiet"], capsys)
    assert rc == 2, out
    assert f"--out {mine} holds files that no conversion wrote" in out and MARKER in out and "choose a new directory" in out, out
    assert "Traceback" not in out
    assert _tree(mine) == before


def test_force_replaces_an_earlier_conversion_output(root, tmp_path, capsys):
    out_dir = tmp_path / "hf"
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", out_dir, "--quiet"], capsys)
    assert rc == 0, out
    assert (out_dir / MARKER).is_file() and (out_dir / "config.json").is_file()
    (out_dir / "stale.txt").write_text("left from the first export")
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", out_dir, "--force", "--quiet"], capsys)
    assert rc == 0, out
    assert (out_dir / MARKER).is_file() and not (out_dir / "stale.txt").exists()


def test_megatron_to_hf_never_writes_over_its_input_checkpoint(root):
    """The reported loss: ``--out <the input checkpoint root> --force`` deleted every iteration.  As a real process."""
    (root / MARKER).write_text("{}")  # even a root that an earlier conversion wrote (hf-to-megatron) is an input here
    before = _tree(root)
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "megatron-to-hf", "--ckpt", str(root),
                        "--out", str(root), "--force", "--quiet"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 2, p.stdout + p.stderr[-3000:]
    assert f"--out {root} is the input --ckpt {root}" in p.stderr and "choose an --out outside" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert _tree(root) == before


@pytest.mark.parametrize("where", ["iteration", "parent", "iter-dir-given"])
def test_reshape_never_replaces_an_input_a_folder_holding_it_or_one_inside_it(root, where, capsys):
    holder = root.parent
    ckpt, out = {"iteration": (root, root / "iter_0000000"),  # inside the input: an older iteration
                 "parent": (root, holder),  # a folder holding the input
                 "iter-dir-given": (root / "iter_0000005", root)}[where]  # the root of the iteration given
    before = _tree(holder)
    rc, text = run_cli(["convert", "reshape", "--ckpt", ckpt, "--out", out, "--tp", "1", "--pp", "1", "--force"], capsys)
    assert rc == 2, text
    said = {"iteration": f"--out {out} lies inside the input --ckpt {root}",
            "parent": f"--out {out} holds the input --ckpt {root}",
            "iter-dir-given": f"--out {out} holds the input --ckpt {ckpt}"}[where]
    assert said in text and "choose an --out outside" in text, text
    assert _tree(holder) == before


def test_hf_to_megatron_never_writes_into_its_hf_directory(gpt2_checkpoint, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(gpt2_checkpoint.parent / "hf", hf)
    before = _tree(hf)
    for out in (hf, hf / "mcore"):
        rc, text = run_cli(["convert", "hf-to-megatron", "--hf", hf, "--out", out, "--force", "--quiet"], capsys)
        assert rc == 2 and f"--out {out}" in text and f"the input --hf {hf}" in text, text
    assert _tree(hf) == before


def test_force_never_replaces_a_symbolic_links_target(root, tmp_path, capsys):
    target = tmp_path / "earlier-export"
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", target, "--quiet"], capsys)
    assert rc == 0, out
    (target / "notes.txt").write_text("added by hand")
    link = tmp_path / "link"
    link.symlink_to(target)
    before = _tree(target)
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", link, "--force", "--quiet"], capsys)
    assert rc == 2, out
    assert f"--out {link} is a symbolic link to {target}" in out and "never replaces a link's target" in out, out
    assert _tree(target) == before and link.is_symlink()


def test_an_out_that_is_a_file_is_refused(root, tmp_path, capsys):
    f = tmp_path / "model.bin"
    f.write_bytes(b"keep")
    for extra in ([], ["--force"]):
        rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", f, "--quiet", *extra], capsys)
        assert rc == 2 and f"--out {f} is a file" in out and "Traceback" not in out, out
    assert f.read_bytes() == b"keep"


def test_an_export_into_the_run_directory_given_as_ckpt_is_written(root, tmp_path, capsys):
    """A run directory given as ``--ckpt`` may hold the export (only its checkpoint folder is an input)."""
    import json

    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"checkpoint": {"save_dir": None}}))
    shutil.move(str(root), run / "checkpoints")
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", run, "--out", run / "hf", "--quiet"], capsys)
    assert rc == 0 and (run / "hf" / "config.json").is_file(), out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", run, "--out", run / "checkpoints" / "hf", "--quiet"], capsys)
    assert rc == 2 and f"lies inside the input --ckpt {run / 'checkpoints'}" in out, out
