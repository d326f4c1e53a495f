"""README.md's "A ten-line tour" runs as written (read from README.md, never copied here) and shows learning: the
loss clearly falls and two different prompts get different greedy continuations; run as a script, ``watch`` names
the saved figure files instead of printing an image object's repr."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## A ten-line tour"


def tour() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert HEADING in text, f"README.md has no section {HEADING!r}"
    blocks = re.findall(r"^```python\n(.*?)^```$", text.split(HEADING, 1)[1].split("\n## ", 1)[0], re.M | re.S)
    assert len(blocks) == 1, blocks
    return blocks[0]


@pytest.mark.slow
def test_the_tour_trains_until_prompts_get_their_own_continuations(tmp_path):
    env = dict(os.environ)
    env.pop("WORKBENCH_RUNS", None)
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run([sys.executable, "-c", tour()], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "<IPython" not in out, out[-3000:]
    figures = re.findall(r"^figure: (.+)$", proc.stdout, re.M)
    assert figures and Path(figures[0]).is_file(), proc.stdout[-3000:]
    said = {p: text for p, _, text in re.findall(r"^(In the beginning|And the LORD said) -> (['\"])(.*)\2$", proc.stdout, re.M)}
    assert len(said) == 2, proc.stdout[-3000:]
    assert said["In the beginning"] != said["And the LORD said"], said
    runs = list((tmp_path / "runs").glob("tiny-*"))
    assert len(runs) == 1, runs
    losses = [json.loads(line)["loss"] for line in (runs[0] / "events" / "rank-0.jsonl").read_text().splitlines()
              if '"event": "step"' in line]
    assert len(losses) == 300, len(losses)
    last = sum(losses[-20:]) / 20
    assert last < losses[0] - 2.0, (losses[0], last)
