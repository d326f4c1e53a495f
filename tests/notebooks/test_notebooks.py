"""Every notebook runs with its defaults headless through papermill (``workbench notebook run``), the path of
``papermill`` users and of the README's main command, where the widgets take their headless paths (static tables and
figures, no widget state): the quickstart (``PAPERMILL_RUNS`` in ``tests/support/notebook_checks.py``) with its own
checks, which read the ``metrics.json`` and the run directory that papermill's injected ``out_dir`` puts next to the
executed notebook, and the command's output; every other notebook (``BROWSER_RUNS``) with the checks its "Run All" in
JupyterLab gets (``check_shows``; ``test_notebooks_headless.py``, a file of its own so that the two test workers share
the runs; ``tests/browser/test_notebook_runs_browser.py`` runs them in JupyterLab too).  Also here: the
``workbench notebook run`` / ``sweep`` commands on a tiny notebook.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from workbench.cli import main

from tests.support.notebook_checks import BROWSER_RUNS, NOTEBOOKS, PAPERMILL_RUNS, run_with_defaults

pytestmark = pytest.mark.slow

PAPERMILL = [p for p in NOTEBOOKS if p.stem in PAPERMILL_RUNS]


def test_there_are_notebooks():
    """Every notebook is one of the two kinds: the quickstart (papermill, its own checks) or a "Run All" notebook (also
    headless, ``test_notebooks_headless.py``)."""
    names = [p.stem for p in NOTEBOOKS]
    assert "01_quickstart" in names and "01_quickstart" in PAPERMILL_RUNS
    assert set(PAPERMILL_RUNS) <= set(names), f"PAPERMILL_RUNS names a notebook that is not in notebooks/: {PAPERMILL_RUNS}"
    assert sorted([p.stem for p in PAPERMILL] + list(BROWSER_RUNS)) == sorted(names)


@pytest.mark.parametrize("path", PAPERMILL, ids=[p.stem for p in PAPERMILL])
def test_notebook_runs_with_its_own_defaults(path: Path, tmp_path: Path):
    run_with_defaults(path, tmp_path)


def _tiny_notebook(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("x = 1\ny = 2\nci = False\nout_dir = None", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("from workbench.notebook import record_metrics\nrecord_metrics({'product': x * y, 'sum': x + y}, out_dir)"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_cli_notebook_run_and_sweep(tmp_path, capsys):
    import pandas as pd

    nb = _tiny_notebook(tmp_path / "one.ipynb")
    out = tmp_path / "out"
    assert main(["notebook", "run", str(nb), "-p", "x", "4", "-p", "y", "2.5", "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "one.ipynb") in printed and str(out / "one.html") in printed
    assert json.loads((out / "metrics.json").read_text()) == {"product": 10.0, "sum": 6.5}
    assert main(["notebook", "run", str(nb), "-p", "z", "1", "--out", str(tmp_path / "o2")]) == 2
    assert "no parameter(s) z" in capsys.readouterr().err
    # a failing notebook: exit 1, and the executed notebook is still written for inspection
    assert main(["notebook", "run", str(nb), "-p", "x", "'text'", "-p", "y", "[1]", "--out", str(tmp_path / "o3"), "--quiet"]) == 1
    assert (tmp_path / "o3" / "one.ipynb").exists()
    # sweep: one executed notebook per grid point, their metrics.json collected into one CSV
    assert main(["sweep", str(nb), "--grid", "x=1,3", "-p", "y", "10", "--out", str(tmp_path / "sw")]) == 0
    assert "sweep.csv" in capsys.readouterr().out
    table = pd.read_csv(tmp_path / "sw" / "sweep.csv")
    assert table[["x", "y", "product", "sum"]].values.tolist() == [[1, 10, 10, 11], [3, 10, 30, 13]]
    assert table["ok"].all()
