#!/usr/bin/env bash
# Transformer Engine for the workbench, from PyPI alone: `bash launch/install_te.sh` (after or instead of
# launch/setup.sh; it runs setup.sh first).  TE is an optional accelerator: without it (or with a broken
# one, which the workbench detects before importing megatron-core) everything runs on the non-TE path.
#
# What it installs into the venv (WORKBENCH_VENV, default .venv), for torch's CUDA major version (12 or 13):
#   transformer-engine-cuXX   prebuilt core library wheel (~276 MB download)
#   transformer-engine        the meta package (import transformer_engine checks its metadata)
#   transformer-engine-torch  TE's PyTorch extension: PyPI has only the source, so it is compiled here
#                             against the venv's torch (C++ only, no CUDA kernels; needs the nvcc / CCCL
#                             headers from NVIDIA's PyPI wheels, installed too): 34 CPU-minutes against
#                             torch 2.14.1+cu130 (about 17 min on 2 cores, a few on 16); ~355 MB installed
# Options: --dry-run prints the steps.  WORKBENCH_TE_VERSION (default 2.20.2), MAX_JOBS (default: all cores).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${WORKBENCH_VENV:-$root/.venv}"
te_version="${WORKBENCH_TE_VERSION:-2.20.2}"
dry=""
for a in "$@"; do
  case "$a" in
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option '$a' for launch/install_te.sh" >&2
       echo "fix: use --dry-run (print the install commands) or no option" >&2
       exit 2 ;;
  esac
done
step() { if [ -n "$dry" ]; then echo "+ $*"; else "$@"; fi; }

if [ -z "$dry" ]; then
  bash launch/setup.sh
fi
py="$venv/bin/python"
# torch's CUDA version decides the TE wheel and the header packages; a CPU torch cannot take TE
cuda="${WORKBENCH_TE_TORCH_CUDA:-$("$py" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || true)}"
torch_v="$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)"
if [ -z "$cuda" ]; then
  echo "error: the venv's torch ($torch_v) is a CPU build: Transformer Engine needs torch built with CUDA 12 or 13" >&2
  echo "fix: install into a venv made without --cpu (WORKBENCH_VENV=.venv bash launch/install_te.sh), or run without TE" >&2
  exit 2
fi
major="${cuda%%.*}"
minor="${cuda#*.}"; minor="${minor%%.*}"
case "$major" in
  13) core="transformer-engine-cu13==$te_version"; headers=("nvidia-cuda-nvcc==13.$minor.*" "nvidia-cuda-cccl==13.$minor.*") ;;
  12) core="transformer-engine-cu12==$te_version"; headers=("nvidia-cuda-nvcc-cu12==12.$minor.*" "nvidia-cuda-cccl-cu12==12.$minor.*") ;;
  *) echo "error: torch $torch_v is built with CUDA $cuda; Transformer Engine's PyPI wheels exist for CUDA 12 and 13 only" >&2
     echo "fix: use a torch built with CUDA 12.x or 13.x (PyPI's default torch is), or run without TE" >&2
     exit 2 ;;
esac
jobs="${MAX_JOBS:-$(nproc 2>/dev/null || echo 2)}"
echo "[te] Transformer Engine $te_version for torch $torch_v (CUDA $cuda) into $venv; the PyTorch extension compiles with MAX_JOBS=$jobs"
t0=$(date +%s)
step "$py" -m pip install -q "transformer-engine==$te_version" "$core" pydantic \
  "nvidia-cudnn-frontend>=1.29" ninja pybind11 "setuptools<82" "${headers[@]}"
# --no-build-isolation: the extension must compile against the venv's own torch (its ABI), not a fresh one
step env NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS="$jobs" \
  "$py" -m pip install -q --no-build-isolation --no-deps "transformer-engine-torch==$te_version"
if [ -n "$dry" ]; then exit 0; fi
echo "[te] installed in $(( $(date +%s) - t0 )) s"
# the workbench's own check (workbench.kernel_rule.te_status): importable, or why not
"$py" - <<'PY'
from workbench.kernel_rule import te_status
st = te_status()
print(f"[te] workbench sees Transformer Engine: {st}")
PY
