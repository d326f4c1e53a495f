"""A notebook run in Jupyter (no ``out_dir``) writes its runs, exports and demo files under one git-ignored directory
(``runs/notebooks/`` of the checkout, :func:`workbench.notebook.notebook_dir`), never beside the notebooks
(``notebooks/runs/``, ``bert_hf_export/``, ``t5_conversion_demo/`` were left untracked and not ignored)."""

from __future__ import annotations

import re
import shutil
import subprocess

import nbformat
import pytest

from workbench.notebook import notebook_dir

from tests.support import ROOT
from tests.support.notebook_checks import NOTEBOOKS


def _ignored(path) -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(path)]).returncode == 0


@pytest.mark.parametrize("cwd", ["notebooks", "."])
def test_without_out_dir_every_output_lands_in_one_ignored_directory(monkeypatch, cwd):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    monkeypatch.delenv("WORKBENCH_RUNS", raising=False)
    monkeypatch.chdir(ROOT / cwd)  # Jupyter starts a notebook's kernel in notebooks/; the CLI runs from the root
    base = notebook_dir(None)
    assert base.is_absolute() and base.is_relative_to(ROOT), base
    for part in ("bert", "moe", "t5", "bert_hf_export", "t5_conversion_demo", "demo_models", "conversion", "generation"):
        path = notebook_dir(None, part)
        assert path.parent == base and _ignored(path / "some-file"), path
    assert not _ignored(ROOT / "notebooks" / "10_new.ipynb")  # the notebooks themselves stay tracked


def test_with_out_dir_outputs_go_next_to_the_executed_notebook(tmp_path):
    assert notebook_dir(tmp_path, "bert") == tmp_path / "bert" and notebook_dir(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_choose_output_directories_through_notebook_dir(path):
    """Every place a notebook picks for its outputs comes from notebook_dir: no ``out_dir or "runs"`` / ``"."``,
    no literal directory beside the notebook."""
    nb = nbformat.read(str(path), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
    assert not re.search(r"out_dir\s+or\s", code), f"{path.name}: an output path falls back next to the notebook"
    # (Path(".") / Path(".."): 03 looks for the committed evidence, which it reads)
    assert not re.search(r"""Path\(\s*["']\w[^"']*["']\s*\)""", code), f"{path.name}: a literal relative output path"
    assert not re.search(r"""run_root\s*=\s*["']""", code), f"{path.name}: a literal run root"
