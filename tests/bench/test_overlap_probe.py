"""bench/overlap_probe.py on two gloo ranks (its --cpu mode): every NCCL case timed and written, the copy-engine
cases skipped with the reason, the summary's hidden fraction printed.  The GPU numbers come from the device."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT, torchrun_args


def test_the_overlap_probe_times_each_case_on_two_ranks(tmp_path):
    out = tmp_path / "probe.jsonl"
    run = subprocess.run([sys.executable, *torchrun_args(2), "bench/overlap_probe.py", "--cpu", "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    timed = {r["case"]: r["ms"] for r in rows if "ms" in r}
    assert set(timed) == {"gemm", "nccl_ag", "gemm+nccl_ag", "nccl_rs", "gemm+nccl_rs"} and all(v > 0 for v in timed.values())
    assert {r["case"]: r["error"] for r in rows if "error" in r} == dict.fromkeys(("lc_ag", "lc_rs"), "copy engines: GPUs only")
    assert all(r["probe"] == "overlap" and r["git_commit"] and r["tokens"] == 64 for r in rows)
    assert "of the transfer hidden" in run.stdout
