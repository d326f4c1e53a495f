#!/usr/bin/env bash
# The main job: runs notebooks/01_quickstart.ipynb through papermill into a run directory
# (executed notebook + HTML export). Extra args are papermill parameters: -p steps 200 -p tp 2
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
venv="${WORKBENCH_VENV:-$root/.venv}"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
exec "$venv/bin/python" -m workbench.cli notebook run notebooks/01_quickstart.ipynb "$@"
