"""The longest notebooks (the model families' demos) run through "Run All" in JupyterLab with their defaults, checked as
every other notebook is (``test_notebook_runs_browser.py``); a file of their own, so that two workers share the runs."""

from __future__ import annotations

import pytest

from tests.support.browser_notebooks import LONG, runs_with_its_defaults_and_keeps_its_figures
from tests.support.notebook_checks import BROWSER_RUNS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", [n for n in LONG if n in BROWSER_RUNS])
def test_long_notebook_runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name):
    runs_with_its_defaults_and_keeps_its_figures(lab_page, browser, artefacts, name)
