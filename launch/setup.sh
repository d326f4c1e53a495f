#!/usr/bin/env bash
# Create (or reuse) .venv with Python 3.12 and the workbench installed editable.
# Idempotent: a second run with an unchanged pyproject.toml installs nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${WORKBENCH_VENV:-$root/.venv}"

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
  "$py" -m venv "$venv"
fi

stamp="$venv/.workbench-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing the workbench and its dependencies into $venv (first time: a few minutes, ~6 GB with torch)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e ".[dev]"
  "$venv/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
echo "[setup] ready: $venv/bin/python ($("$venv/bin/python" -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")' 2>/dev/null))"
