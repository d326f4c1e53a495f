"""bench/preprocess_throughput.py keeps working: one JSON line per worker count, identical data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_preprocess_throughput_smoke(tmp_path):
    out = tmp_path / "pt.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "preprocess_throughput.py"), "--workers", "1", "2",
                           "--limit-docs", "60", "--repeat", "1", "--trials", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["workers"] for r in rows] == [1, 2]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 10_000 and rows[0]["documents"] == 60
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_cpu_s"] > 0
        assert r["device"] and r["date"] and r["git_commit"]
    assert rows[0]["speedup_vs_1"] == 1.0
    assert "tokens/s" in proc.stdout
