"""Every notebook but the quickstart (``BROWSER_RUNS``) runs with its defaults headless through papermill
(``workbench notebook run``, the widgets on their headless paths: static tables and figures) with the checks its
"Run All" in JupyterLab gets (``check_shows``, ``tests/support/notebook_checks.py``): no error, nothing on stderr, every
cell run, and the notebook's own checks of what it shows.  The quickstart's papermill run is ``test_notebooks.py``'s."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.notebook_checks import BROWSER_RUNS, NOTEBOOKS, run_with_defaults

pytestmark = pytest.mark.slow

HEADLESS = [p for p in NOTEBOOKS if p.stem in BROWSER_RUNS]


@pytest.mark.parametrize("path", HEADLESS, ids=[p.stem for p in HEADLESS])
def test_notebook_runs_headless_with_its_defaults(path: Path, tmp_path: Path):
    """The notebooks JupyterLab's "Run All" checks in the browser, headless through papermill with the same checks."""
    run_with_defaults(path, tmp_path)
