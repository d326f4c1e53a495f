"""Every notebook in notebooks/ executes headless through papermill with its own defaults, and shows what it should
(the running and the checks: ``tests/support/notebook_checks.py``).  The model-family notebooks (07-09, the longest)
are in ``test_notebooks_families.py``, so the two files can run on two workers side by side; this file runs every
other notebook, and the ``workbench notebook run`` / ``sweep`` commands on a tiny notebook.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from workbench.cli import main

from tests.support.notebook_checks import FAMILY_NOTEBOOKS, NOTEBOOKS, run_with_defaults

pytestmark = pytest.mark.slow

OTHERS = [p for p in NOTEBOOKS if p.stem not in FAMILY_NOTEBOOKS]


def test_there_are_notebooks():
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
    assert {p.stem for p in NOTEBOOKS} >= set(FAMILY_NOTEBOOKS)  # test_notebooks_families.py runs these


@pytest.mark.parametrize("path", OTHERS, ids=[p.stem for p in OTHERS])
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
