"""bench/bert_train.py and bench/t5_bench.py run end to end in their CPU smoke mode (tiny presets, 2 steps): the
workbench and the HF yardstick (HF's own BertForPreTraining / T5ForConditionalGeneration on SDPA) side by side,
rows written with their settings and ratio, the ratio table printed; BERT's 2-process TP / PP row runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _smoke(script: str, rows: str, out: Path) -> tuple[list[dict], str]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--cpu-smoke", "--rows", rows, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(l) for l in out.read_text().splitlines()], proc.stdout


def _assert_throughput(row: dict, name: str) -> None:
    assert row["row"] == "throughput" and row["preset"] == name, row
    assert row["protocol"]["name"] == "harness-v1" and row["protocol"]["repeats"] == 1  # the smoke: one repeat a side
    for side in ("workbench", "reference"):
        (only,) = row[side]
        assert "error" not in only, only.get("error")
        assert only["tokens_per_s"] > 0 and len(only["step_times"]) == 2 and only["warmup_steps"] >= 2
        assert only["step_s"] == sorted(only["step_times"])[1]  # the (upper) median of the timed steps
    wb, ref = row["workbench"][0]["tokens_per_s"], row["reference"][0]["tokens_per_s"]
    assert abs(row["ratio"] - wb / ref) < 1e-9 and row["range"] == [row["ratio"], row["ratio"]]
    assert row["settings"]["micro_batch_size"] == 2 and row["commit"] and row["date"]


def test_bert_bench_smoke(tmp_path):
    rows, stdout = _smoke("bert_train.py", "throughput,tp2", tmp_path / "bert.jsonl")
    assert [r["row"] for r in rows] == ["throughput", "tp2"]
    _assert_throughput(rows[0], "bert-tiny")
    assert rows[1]["returncode"] == 0 and rows[1]["error"] is None and rows[1]["last_loss"] is not None, rows[1]
    assert "workbench" in stdout and "ratio" in stdout  # the table


def test_t5_bench_smoke(tmp_path):
    rows, _ = _smoke("t5_bench.py", "throughput", tmp_path / "t5.jsonl")
    assert [r["row"] for r in rows] == ["throughput"]
    _assert_throughput(rows[0], "t5-tiny")
