"""bench/train_throughput.py runs end to end (tiny config, CPU, 2 steps) and writes honest rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "train_throughput.py"


def test_cpu_smoke_writes_one_row_per_variant(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["reference/tiny", "workbench/tiny"]
    sys.path.insert(0, str(ROOT))
    from workbench.config import derive, preset

    cfg = preset("tiny")
    for r in rows:
        assert r["ok"], r
        for key in ("device", "date", "git_commit"):
            assert r[key], key
        assert r["steps_timed"] == 2 and r["step_s"] > 0
        # FLOPs come from the config contract; throughput and MFU follow from the measured step time
        d = derive(cfg.replace(**{"train.global_batch_size": r["global_batch_size"]}))
        assert r["flops_per_step"] == d.flops_per_step
        assert math.isclose(r["tokens_per_s"], r["tokens_per_step"] / r["step_s"], rel_tol=1e-9)
        assert math.isclose(r["mfu"], r["flops_per_step"] / r["step_s"] / (r["peak_tflops"] * 1e12), rel_tol=1e-9)
        assert r["microbatches"] == 2 and r["tokens_per_step"] == 2 * cfg.train.micro_batch_size * cfg.model.seq_length
        # both sides train a freshly initialised model of the padded vocabulary: loss ~ ln(V)
        assert abs(r["first_loss"] - math.log(d.padded_vocab_size)) < 0.5, r["first_loss"]
    ref, wb = rows
    assert ref["ratio_to_reference"] == 1.0
    assert math.isclose(wb["ratio_to_reference"], wb["tokens_per_s"] / ref["tokens_per_s"])
    assert wb["kernel_path"]["schedule"] == "no pipelining"
    cost = wb["stream_cost"]
    assert cost["step_s_bare"] > 0 and cost["n"] == 3 and cost["loop_s_2n"] > 0 and cost["loop_s_n"] > 0
    assert math.isclose(cost["step_s_loop_events_timing_every_step"], (cost["loop_s_2n"] - cost["loop_s_n"]) / 3)
    assert "workbench/tiny" in proc.stdout and "tok/s" in proc.stdout  # the table


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    for args, needle in ((["--models", "gpt5"], "unknown model"), (["--cpu-smoke", "--variants", "nope"], "matches nothing"),
                         (["--cpu-smoke", "--steps", "0"], "--steps")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "x.jsonl")], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)
