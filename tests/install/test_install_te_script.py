"""``launch/install_te.sh``: Transformer Engine from PyPI for the venv's torch, or a refusal with the fix.

The real install (a ~276 MB wheel and a C++ build) is not part of CI; its steps are read through
``--dry-run`` for each CUDA version torch may be built with (``WORKBENCH_TE_TORCH_CUDA`` stands in
for ``torch.version.cuda``), and the refusals are checked to exit 2 before anything is installed.
"""

from __future__ import annotations

import os
import subprocess

from tests.support import ROOT

SCRIPT = ROOT / "launch" / "install_te.sh"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_TE")} | env
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=120)


def _steps(out: str) -> list[str]:
    return [ln[2:] for ln in out.splitlines() if ln.startswith("+ ")]


def test_cuda13_torch_gets_the_cu13_wheel_and_a_source_build_against_its_own_torch():
    r = _run("--dry-run", WORKBENCH_TE_TORCH_CUDA="13.0")
    assert r.returncode == 0, r.stderr
    deps, build = _steps(r.stdout)
    for pkg in ("transformer-engine==2.20.2", "transformer-engine-cu13==2.20.2", "pydantic", "nvidia-cuda-nvcc==13.0.*",
                "nvidia-cuda-cccl==13.0.*"):
        assert pkg in deps.split(), pkg
    assert "transformer-engine-torch==2.20.2" in build and "--no-build-isolation" in build
    assert "NVTE_PYTORCH_FORCE_BUILD=TRUE" in build and "MAX_JOBS=" in build


def test_cuda12_torch_gets_the_cu12_names_and_the_version_is_a_setting():
    r = _run("--dry-run", WORKBENCH_TE_TORCH_CUDA="12.8", WORKBENCH_TE_VERSION="2.19.0")
    assert r.returncode == 0, r.stderr
    deps = _steps(r.stdout)[0].split()
    assert {"transformer-engine==2.19.0", "transformer-engine-cu12==2.19.0", "nvidia-cuda-nvcc-cu12==12.8.*"} <= set(deps)


def test_torch_without_a_cuda_te_supports_is_refused_with_the_fix():
    r = _run("--dry-run", WORKBENCH_TE_TORCH_CUDA="11.8")
    assert r.returncode == 2 and "CUDA 12 and 13 only" in r.stderr and "fix:" in r.stderr
    assert not _steps(r.stdout)


def test_bad_option_exits_2():
    r = _run("--fp8")
    assert r.returncode == 2 and "'--fp8'" in r.stderr and "fix:" in r.stderr
