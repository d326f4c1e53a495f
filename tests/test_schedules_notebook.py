"""notebooks/03_pipeline_schedules.ipynb executes headless under papermill, overlay included."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from workbench.schedules import simulate

from tests.test_schedules_overlay import write_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_pipeline_schedules.ipynb"


@pytest.mark.slow
def test_notebook_runs_headless_with_a_run_overlay(tmp_path):
    import nbformat
    import papermill as pm

    run = write_run(tmp_path / "run", {6: simulate("1f1b", 2, 4, forward=9.0, backward=18.0, latency=1.0, unit="ms")})
    out = tmp_path / "out.ipynb"
    t0 = time.time()
    pm.execute_notebook(str(NOTEBOOK), str(out), parameters={"run_dir": str(run), "p": 4, "m": 8, "v": 2},
                        kernel_name="python3", progress_bar=False, cwd=str(tmp_path),
                        execution_timeout=120)
    seconds = time.time() - t0
    nb = nbformat.read(str(out), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 5  # gpipe, 1f1b, comparison, uneven stages, overlay (the widget draws into its state)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "1f1b p=2 v=1 m=4, iteration 6" in text and "measured" in text
    assert seconds < 60, f"notebook took {seconds:.1f} s (budget 20 s in CI)"
