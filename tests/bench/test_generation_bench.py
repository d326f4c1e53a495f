"""CI runs the generation benchmark's CPU smoke mode: the script works end to end and its
JSON lines carry what the GPU run must record (device, date, commit, both implementations)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generate_throughput_cpu_smoke(tmp_path):
    out = tmp_path / "gen.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_throughput.py"), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["variant"], r["batch"]) for r in rows} == {("workbench", 1), ("workbench", 3), ("hf", 1), ("hf", 3)}
    for r in rows:
        assert r["device"] == "cpu" and r["date"].startswith("20")
        assert len(r["git_commit"]) == 40 or r["git_commit"] == "unknown"
        assert r["tokens_per_s"] > 0 and r["new_tokens"] == 8
        # fp32, same weights: the workbench engine's greedy tokens are HF's
        assert r["agree_prefix"] == r["new_tokens"]
    wb = [r for r in rows if r["variant"] == "workbench"]
    assert all(r["speedup_vs_hf"] > 0 for r in wb)
