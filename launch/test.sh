#!/usr/bin/env bash
# The test command: sets up .venv (if needed) and runs the CPU test suite.
# GPU proof scripts (tests/gpu_proofs) are not pytest tests: they run on GPU machines (bench/README.md says how).
# One folder alone: `bash launch/test.sh tests/launch` (any folder of tests/README.md's map, or one file).
# Parallel: WORKBENCH_TEST_WORKERS pytest-xdist workers (default 2; 0 runs in this process), each test file whole
# on one worker (its module fixtures built once).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash launch/setup.sh
venv="${WORKBENCH_VENV:-$root/.venv}"
# one OpenMP thread per process (tests/conftest.py says why: the workers' processes share two cores)
export MPLBACKEND=Agg PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
set +e
# a private basetemp: another pytest session on the machine must not clean up this one's tmp dirs
basetemp="$(mktemp -d -t workbench-tests-XXXXXX)"
"$venv/bin/python" -m pytest -q "${@:-tests}" -n "${WORKBENCH_TEST_WORKERS:-2}" --dist loadfile --ignore=tests/gpu_proofs -p no:cacheprovider --basetemp="$basetemp" --durations=15
rc=$?
set -e
rm -rf "$basetemp"
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
