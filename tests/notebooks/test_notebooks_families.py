"""The model-family notebooks (07_bert, 08_t5, 09_moe) execute headless through papermill with their own defaults, and
show what they should (``tests/support/notebook_checks.py``); every other notebook: ``test_notebooks.py``.  Apart
because they are the longest: the two files can run on two workers side by side.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.notebook_checks import FAMILY_NOTEBOOKS, NOTEBOOKS, run_with_defaults

pytestmark = pytest.mark.slow

FAMILIES = [p for p in NOTEBOOKS if p.stem in FAMILY_NOTEBOOKS]


@pytest.mark.parametrize("path", FAMILIES, ids=[p.stem for p in FAMILIES])
def test_notebook_runs_with_its_own_defaults(path: Path, tmp_path: Path):
    run_with_defaults(path, tmp_path)
