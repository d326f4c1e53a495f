"""`workbench plan` exit status when the plan does not fit; `workbench schedule`'s
interleaved text timeline, the m < p warning, and --chart into a missing directory."""

from __future__ import annotations

import json
import re

from workbench.cli import main
from workbench.config import preset
from workbench.schedules import simulate, text_chart


def test_plan_exit_status_says_whether_it_fits(tmp_path, capsys):
    path = preset("gpt2-medium").save(tmp_path / "run.yaml")
    assert main(["plan", str(path), "--gpu", "H100"]) == 0
    assert main(["plan", str(path), "--gpu", "1GiB"]) == 1
    captured = capsys.readouterr()
    assert "OOM" in captured.out and "does not fit" in captured.err
    assert main(["plan", str(path), "--gpu", "1GiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
    assert main(["plan", str(path)]) == 0  # no GPU given: nothing to fit


def test_interleaved_text_timeline_names_every_op():
    tl = simulate("interleaved", 4, 8, 2)
    text = text_chart(tl)
    for r, line in enumerate(text.splitlines()):
        body = line.split("|", 1)[1]
        labels = re.findall(r"[FB]\d+c\d+", body)
        assert len(labels) == len(tl.ops[r]) == 2 * 8 * 2, body
        # nothing but whole labels, their fill and idle space
        assert re.fullmatch(r"(?:[FB]\d+c\d+[-=]+| )*\|", body), body
    assert "FF" not in text


def test_schedule_warns_when_microbatches_are_fewer_than_stages(tmp_path, capsys):
    assert main(["schedule", "--pp", "4", "-m", "2"]) == 0
    err = capsys.readouterr().err
    assert "m=2 < p=4" in err and "at least m=4" in err
    assert main(["schedule", "--pp", "4", "-m", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"]
    assert main(["schedule", "--pp", "4", "-m", "8"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_chart_into_a_missing_directory_is_refused(tmp_path, capsys):
    target = tmp_path / "nonexistent" / "dir" / "x.png"
    assert main(["schedule", "--pp", "2", "-m", "4", "--chart", str(target)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "nonexistent").exists()
    assert main(["schedule", "--pp", "2", "-m", "4", "--chart", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").stat().st_size > 0
