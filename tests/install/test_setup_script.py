"""``launch/setup.sh``: the default install (PyPI only) and the CPU-only install (``--cpu``).

The CPU install cannot be run here (PyTorch's CPU wheel index is not reachable from CI), so its
commands are read through ``--dry-run`` and the reason for each non-obvious step is checked against
the installed megatron-core: it imports ``triton`` even on a CPU, which the CPU torch wheel lacks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.support import ROOT

SETUP = ROOT / "launch" / "setup.sh"


def _setup(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_TORCH")} | env
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, env=full, timeout=120)


def _pip_steps(out: str) -> list[str]:
    return [ln[2:] for ln in out.splitlines() if ln.startswith("+ ") and " -m pip install" in ln]


def test_default_install_uses_pypi_only():
    r = _setup("--dry-run")
    assert r.returncode == 0, r.stderr
    steps = _pip_steps(r.stdout)
    assert steps and steps[-1].endswith("-e .[dev]")
    assert not any("--index-url" in s or "download.pytorch.org" in s for s in steps)


def test_cpu_install_takes_torch_from_the_cpu_index_first_then_triton_from_pypi():
    for r in (_setup("--cpu", "--dry-run"), _setup("--dry-run", WORKBENCH_TORCH="cpu")):
        assert r.returncode == 0, r.stderr
        steps = _pip_steps(r.stdout)
        torch_i = next(i for i, s in enumerate(steps) if "--upgrade torch>=" in s and "--index-url https://download.pytorch.org/whl/cpu" in s)
        triton_i = next(i for i, s in enumerate(steps) if s.endswith(" triton"))
        project_i = next(i for i, s in enumerate(steps) if s.endswith("-e .[dev]"))
        # torch before the project, within the project's bound: its +cpu build then satisfies pyproject and no CUDA build is pulled
        assert torch_i < project_i and triton_i < project_i
        assert "--index-url" not in steps[triton_i]  # triton comes from PyPI, the CPU index has none for every torch
    mirror = _setup("--cpu", "--dry-run", WORKBENCH_TORCH_INDEX="http://mirror.example/whl/cpu")
    assert any("--index-url http://mirror.example/whl/cpu" in s for s in _pip_steps(mirror.stdout))


def test_cpu_install_refuses_a_venv_that_holds_the_cuda_torch():
    # the venv running these tests has PyPI's torch (no '+cpu'): switching it in place would keep the CUDA build
    import importlib.metadata as md

    import pytest

    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a venv: setup.sh would create one")
    if md.version("torch").endswith("+cpu"):
        pytest.skip("this venv already has the CPU torch build")
    r = _setup("--cpu", WORKBENCH_VENV=sys.prefix)
    assert r.returncode == 2
    assert "CUDA build" in r.stderr and "WORKBENCH_VENV=.venv-cpu" in r.stderr


def test_bad_options_exit_2_with_the_fix():
    r = _setup("--gpu")
    assert r.returncode == 2 and "--gpu" in r.stderr and "fix: use --cpu" in r.stderr
    r = _setup(WORKBENCH_TORCH="rocm")
    assert r.returncode == 2 and "WORKBENCH_TORCH='rocm'" in r.stderr and "fix:" in r.stderr


def test_megatron_core_needs_triton_importable_even_on_a_cpu(tmp_path):
    # why the CPU install adds triton: hide it and megatron-core's schedules no longer import
    (tmp_path / "triton.py").write_text('raise ImportError("triton hidden by the test")\n')
    code = textwrap.dedent("""
        import megatron.core.pipeline_parallel.schedules
        import megatron.core.models.gpt
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0 and "triton hidden by the test" in r.stderr
    # and with triton present (as both installs provide) the same imports work without a GPU
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
