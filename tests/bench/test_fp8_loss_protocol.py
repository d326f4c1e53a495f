"""The FP8-vs-bf16 loss protocol's arithmetic (tests/gpu_proofs/fp8_loss.py): smoothing, the judged mean of the bf16 runs,
which earlier runs count as bf16 for a comparison.  The GPU runs themselves are device-only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu_proofs"))
import fp8_loss  # noqa: E402


def _row(recipe, losses, lr=1e-4, sha="abc", **kw):
    return {"recipe": recipe, "losses": losses, "returncode": 0, "model": "m", "micro_batch_size": 4,
            "global_batch_size": 16, "seq_length": 2048, "lr": lr, "steps": len(losses), "date": f"d{len(kw)}",
            "git_commit": "c0ffee0", "corpus": {"sha256": {"x.bin": sha}}, **kw}


def test_fp8_is_judged_against_the_mean_of_the_bf16_runs_and_each_run_is_reported():
    n = 60
    a = [2.0] * n
    b = [2.0 * 1.02] * n  # a bf16 run 2% above the other
    f = [2.0 * 1.012] * n  # FP8: 1.2% from a, 0.8% from b, 0.2% from their mean (2.02)
    cmp = fp8_loss.against([_row("off", a), _row("off", b)], _row("delayed", f), window=10)
    assert cmp["max_rel_smoothed"] == pytest.approx(0.002 / 1.01, abs=1e-9) and cmp["within_bar"]
    assert cmp["each"] == pytest.approx([0.012, abs(1.012 / 1.02 - 1)], abs=1e-9)
    assert len(cmp["base"]) == 2
    far = fp8_loss.against([_row("off", a)], _row("delayed", [2.0 * 1.016] * n), window=10)
    assert not far["within_bar"] and far["max_rel_smoothed"] == pytest.approx(0.016, abs=1e-9)


def test_the_smoothing_is_a_centred_moving_average_and_the_first_window_is_not_judged():
    assert fp8_loss.smoothed([0, 0, 3, 0, 0], 3) == [0, 1, 1, 1, 0]
    spike = [1.0] * 40
    spike[2] = 2.0  # inside the first window: not judged
    assert fp8_loss.compare([1.0] * 40, spike, window=10)["max_rel_smoothed"] == 0.0
    spike[20] = 1.2  # later: judged, averaged over the window (0.2 / 11)
    assert fp8_loss.compare([1.0] * 40, spike, window=10)["max_rel_smoothed"] == pytest.approx(0.2 / 11)


def test_judge_reads_a_file_counting_only_bf16_runs_of_the_same_settings_and_data(tmp_path, capsys):
    n = 40
    rows = [_row("off", [2.0] * n), _row("off", [2.0 * 1.02] * n), _row("tensorwise", [2.0 * 1.012] * n),
            _row("off", [3.0] * n, lr=3e-4),  # other settings: never a base here
            _row("off", [2.0 * 1.5] * n, sha="other")]  # other data: never a base here
    path = tmp_path / "curves.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fp8_loss.judge(path, window=10) == 0
    out = capsys.readouterr().out
    assert "tensorwise" in out and "vs the mean of 2 bf16 runs: 0.20%" in out
    rows.append(_row("rowwise", [2.0 * 1.04] * n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fp8_loss.judge(path, window=10) == 1  # 3% from the mean: over the bar


def test_base_runs_must_match_the_settings_and_data_or_the_call_stops_with_exit_2(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(_row("off", [2.0] * 300)) + "\n" + json.dumps(_row("off", [2.1] * 300, sha="z")) + "\n")
    a = argparse.Namespace(model="m", micro_batch_size=4, global_batch_size=16, seq_length=2048, lr=1e-4, steps=300)
    assert len(fp8_loss.find_bases(path, a, {"sha256": {"x.bin": "abc"}})) == 1
    with pytest.raises(SystemExit) as e:
        fp8_loss.find_bases(path, argparse.Namespace(**{**vars(a), "lr": 3e-4}), {"sha256": {"x.bin": "abc"}})
    assert e.value.code == 2


def test_judge_refuses_a_file_whose_fp8_run_has_no_bf16_run_to_be_judged_against(tmp_path):
    path = tmp_path / "only_fp8.jsonl"
    path.write_text(json.dumps(_row("delayed", [2.0] * 40)) + "\n" + json.dumps(_row("off", [2.0] * 40, lr=3e-4)) + "\n")
    assert fp8_loss.judge(path, window=10) == 2  # nothing judged is not a pass
