"""`workbench schedule`: JSON output, charts, and clean refusals (exit 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.cli import main
from workbench.schedules import operation_order


def test_json_has_per_rank_ordered_ops_and_metrics(capsys):
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--vpp", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schedule"] == "interleaved" and (d["p"], d["m"], d["v"]) == (2, 4, 2)
    for rank in d["ranks"]:
        ops = rank["ops"]
        assert [(o["kind"], o["microbatch"], o["chunk"]) for o in ops] == operation_order("interleaved", 2, 4, 2,
                                                                                          rank["rank"])
        assert all(o["end"] > o["start"] for o in ops)
        assert all(b["start"] >= a["end"] for a, b in zip(ops, ops[1:]))
    met = d["metrics"]
    assert met["bubble_fraction"] == pytest.approx(1 / 8)
    assert met["closed_form_bubble_fraction"] == pytest.approx(1 / 8)
    assert [r["peak_inflight_chunks"] for r in met["per_rank"]] == [5, 3]


def test_schedule_choice_durations_and_latency(capsys):
    assert main(["schedule", "--pp", "3", "--microbatches", "6", "--schedule", "gpipe", "--forward", "1,2,1",
                 "--backward", "2,4,2", "--latency", "0.25", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schedule"] == "gpipe" and d["latency"] == 0.25
    assert d["forward"] == [1.0, 2.0, 1.0]
    assert [r["peak_inflight_chunks"] for r in d["metrics"]["per_rank"]] == [6, 6, 6]


def test_text_output_and_png_chart(tmp_path, capsys):
    chart = tmp_path / "sched.png"
    assert main(["schedule", "--pp", "4", "--microbatches", "8", "--chart", str(chart)]) == 0
    out = capsys.readouterr().out
    assert "bubble 0.3750" in out and "rank 3:" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_svg_chart(tmp_path, capsys):
    chart = tmp_path / "s.svg"
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--chart", str(chart), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chart"] == str(chart)
    assert "<svg" in chart.read_text()[:2000]


@pytest.mark.parametrize("argv,needle", [
    (["--pp", "4", "--microbatches", "6", "--vpp", "2"], "multiple of 4"),
    (["--pp", "2", "--microbatches", "4", "--vpp", "2", "--schedule", "1f1b"], "--schedule interleaved"),
    (["--pp", "3", "--microbatches", "4", "--forward", "1,2"], "per-stage"),
    (["--pp", "2", "--microbatches", "4", "--chart", "x.txt"], ".png"),
    (["--pp", "0", "--microbatches", "4"], "positive"),
])
def test_bad_input_exits_2_with_the_reason(argv, needle, capsys):
    assert main(["schedule", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize("argv,flag", [
    (["--pp", "2", "--microbatches", "4", "--vpp", "0"], "--vpp 0"),
    (["--pp", "2", "--microbatches", "4", "--vpp", "-2"], "--vpp -2"),
    (["--pp", "0", "--microbatches", "4"], "--pp 0"),
    (["--pp", "-1", "--microbatches", "4"], "--pp -1"),
    (["--pp", "2", "--microbatches", "0"], "--microbatches 0"),
    (["--pp", "2", "-m", "-3"], "--microbatches -3"),
    (["--pp", "2", "--microbatches", "4", "--vpp", "2", "--group-size", "0"], "--group-size 0"),
    (["--pp", "2", "--microbatches", "4", "--forward", "0"], "--forward 0"),
    (["--pp", "2", "--microbatches", "4", "--backward", "inf"], "--backward inf"),
    (["--pp", "2", "--microbatches", "4", "--forward", "1,nan"], "--forward 1,nan"),
    (["--pp", "2", "--microbatches", "4", "--latency", "nan"], "--latency nan"),
    (["--pp", "2", "--microbatches", "4", "--latency", "inf"], "--latency inf"),
])
def test_nonsensical_flags_exit_2_naming_the_flag_and_the_fix(argv, flag):
    """In a subprocess, as typed: exit 2, the flag with its value and a fix, no traceback, no schedule printed."""
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "schedule", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert flag in r.stderr and "->" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


def test_console_entry_point():
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "schedule", "--pp", "2", "--microbatches", "3", "--json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["metrics"]["bubble_fraction"] == pytest.approx(1 / 3)


def test_text_output_gives_times_in_ms(capsys):
    """--forward / --backward / --latency are milliseconds (as --from-run's measured times), and the text says so."""
    assert main(["schedule", "--pp", "2", "--microbatches", "4", "--forward", "1.5", "--backward", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("1f1b: p=2 m=4 v=1  step 22.5 ms  bubble")
    assert "busy 18 ms  idle 4.5 ms" in lines[1]
