#!/usr/bin/env bash
# Create (or reuse) .venv with Python 3.12 and the workbench installed editable.
# Idempotent: a second run with an unchanged pyproject.toml installs nothing.
#
# CPU-only machines: `bash launch/setup.sh --cpu` (or WORKBENCH_TORCH=cpu) takes torch from PyTorch's
# own CPU wheel index (WORKBENCH_TORCH_INDEX, default https://download.pytorch.org/whl/cpu) instead of
# PyPI's CUDA build, which pulls ~3 GB of CUDA libraries a CPU cannot use.  megatron-core 0.19 imports
# `triton` unconditionally (megatron/core/transformer/moe/ops/paged_stash.py), and the CPU torch wheel
# does not bring it, so the CPU install adds triton from PyPI.  The default (no option) needs PyPI only.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${WORKBENCH_VENV:-$root/.venv}"
torch_variant="${WORKBENCH_TORCH:-default}"
for a in "$@"; do
  case "$a" in
    --cpu) torch_variant=cpu ;;
    --dry-run) WORKBENCH_SETUP_DRY_RUN=1 ;;
    -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option '$a' for launch/setup.sh" >&2
       echo "fix: use --cpu (torch from PyTorch's CPU wheel index), --dry-run (print the install commands) or no option" >&2
       exit 2 ;;
  esac
done
case "$torch_variant" in
  default|cuda|"") torch_variant=default ;;
  cpu) ;;
  *) echo "error: WORKBENCH_TORCH='$torch_variant' is not a torch variant this script knows" >&2
     echo "fix: WORKBENCH_TORCH=cpu for a CPU-only install, or leave it unset for PyPI's default torch" >&2
     exit 2 ;;
esac
torch_index="${WORKBENCH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
dry="${WORKBENCH_SETUP_DRY_RUN:-}"
# run (or, with --dry-run, print) one install step
step() { if [ -n "$dry" ]; then echo "+ $*"; else "$@"; fi; }

find_python312() {
  local c
  # 1. an explicit choice
  if [ -n "${WORKBENCH_PYTHON:-}" ]; then echo "$WORKBENCH_PYTHON"; return 0; fi
  # 2. any python3.12 on PATH that actually runs (pyenv shims fail unless selected)
  for c in python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2]==(3,12)' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  # 3. pyenv-installed 3.12.x
  if command -v pyenv >/dev/null 2>&1; then
    for c in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      if [ -x "$c" ] && "$c" -c 'import sys' >/dev/null 2>&1; then echo "$c"; return 0; fi
    done
  fi
  for c in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -x "$c" ] && "$c" -c 'import sys' >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}

if [ ! -x "$venv/bin/python" ]; then
  py="$(find_python312)" || {
    echo "error: Python 3.12 not found. megatron-core >= 0.17 needs it." >&2
    echo "fix: install it (e.g. 'pyenv install 3.12', 'apt-get install python3.12-venv', or conda) or set WORKBENCH_PYTHON=/path/to/python3.12" >&2
    exit 2
  }
  echo "[setup] creating $venv with $py"
  step "$py" -m venv "$venv"
fi

if [ "$torch_variant" = cpu ] && [ -z "$dry" ]; then
  # a venv that already holds PyPI's CUDA torch keeps it (pip sees torch satisfied): say so, don't half-switch
  have="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
  if [ -n "$have" ] && [[ "$have" != *+cpu ]]; then
    echo "error: $venv already has torch $have (the CUDA build); --cpu installs into a fresh environment" >&2
    echo "fix: WORKBENCH_VENV=.venv-cpu bash launch/setup.sh --cpu   (or remove $venv first)" >&2
    exit 2
  fi
fi

stamp="$venv/.workbench-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1) torch=$torch_variant"
if [ -n "$dry" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ "$torch_variant" = cpu ]; then
    echo "[setup] installing the workbench into $venv with CPU-only torch from $torch_index (~1.5 GB in all)"
  else
    echo "[setup] installing the workbench and its dependencies into $venv (first time: a few minutes, ~6 GB with torch)"
  fi
  step "$venv/bin/python" -m pip install -q --upgrade pip
  if [ "$torch_variant" = cpu ]; then
    # torch first from the CPU index (its '+cpu' build then satisfies the project's torch bound), then
    # triton from PyPI: megatron-core imports it even on a CPU
    # the project's own torch bound (pyproject.toml), so an older +cpu torch is upgraded here, not replaced
    # by PyPI's CUDA build when the project is installed next
    torch_req="$(grep -oE '"torch[<>=!~][^"]*"' pyproject.toml | head -1 | tr -d '"')"
    step "$venv/bin/python" -m pip install -q --upgrade "${torch_req:-torch}" --index-url "$torch_index"
    step "$venv/bin/python" -m pip install -q triton
  fi
  step "$venv/bin/python" -m pip install -q -e ".[dev]"
  if [ -n "$dry" ]; then exit 0; fi
  "$venv/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
# JupyterLab settings the project ships (an overrides.d file of its own, so a person's overrides.json stays theirs):
# the widget manager saves widget state into the notebook, so a saved notebook reopened without a kernel still shows
# what its planner, schedule explorer and config form showed (issue #55; docs/notebooks.md)
for f in launch/jupyterlab/overrides.d/*.json; do
  install -D -m 644 "$f" "$venv/share/jupyter/lab/settings/overrides.d/$(basename "$f")"
done
echo "[setup] ready: $venv/bin/python ($("$venv/bin/python" -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")' 2>/dev/null))"
