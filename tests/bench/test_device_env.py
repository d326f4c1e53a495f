"""tests/gpu_proofs/end_leftovers.sh (sourced first by device_env.sh in every device call): a process of this project
that an earlier call left on the GPUs is ended; this call's own GPU processes and other programs' are only named.
nvidia-smi is a stand-in on PATH (this machine has no GPU) listing the test's processes as GPU holders."""

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLEEP = "import time; time.sleep(60)"


def test_leftovers_of_an_earlier_call_are_ended_and_nothing_else(tmp_path):
    old = subprocess.Popen([sys.executable, "-c", SLEEP, "bench/train_throughput.py"])  # an earlier call's rank
    other = subprocess.Popen([sys.executable, "-c", SLEEP, "someone-elses-job"])
    try:
        time.sleep(1.2)  # clock ticks: both start before the call's session below
        call = f"""
{sys.executable} -c "{SLEEP}" bench/current & NEW=$!
printf '#!/bin/sh\\necho "{old.pid}, 74000"\\necho "{other.pid}, 100"\\necho "'$NEW', 500"\\n' > {tmp_path}/nvidia-smi
chmod +x {tmp_path}/nvidia-smi
source {ROOT}/tests/gpu_proofs/end_leftovers.sh
kill -0 $NEW && echo "this call's process alive"; kill $NEW
"""
        env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        done = subprocess.run(["setsid", "bash", "-c", call], env=env, capture_output=True, text=True, timeout=60)
        assert f"ending pid {old.pid} (74000 MiB)" in done.stdout, done.stdout + done.stderr
        assert "this call's process alive" in done.stdout and "bench/current" in done.stdout  # named, not ended
        assert f"pid {other.pid} (100 MiB" in done.stdout and "still alive" not in done.stdout
        old.wait(timeout=10)
        assert other.poll() is None
    finally:
        for p in (old, other):
            p.kill()
            p.wait()


def test_silent_without_nvidia_smi(tmp_path):
    (tmp_path / "bash").symlink_to("/bin/bash")
    done = subprocess.run(["/bin/bash", "-c", f"source {ROOT}/tests/gpu_proofs/end_leftovers.sh; echo rc=$?"],
                          env=dict(os.environ, PATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "rc=0" and done.stderr == "", done
