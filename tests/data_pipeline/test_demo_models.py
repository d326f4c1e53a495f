"""``tools/train_demo_models.py``: a run still going at ``--deadline`` is stopped (it saves) and exported as it stands,
and the shipped demo models carry their provenance.  A real CPU training run (gloo), its real export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.data.demo import DEMO_MODELS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_still_going_at_the_deadline_is_stopped_and_exported_as_it_stands(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "train_demo_models.py"), "--device", "cpu", "--only",
                          "gpt-tiny-kjv", "--steps", "100000", "--batch", "2", "--deadline", "30", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped at the 30 s deadline" in out.stdout, out.stdout
    model = tmp_path / "gpt-tiny-kjv"
    prov = json.loads((model / "provenance.json").read_text())
    assert 0 < prov["steps"] < 100000 and f"trained {prov['steps']} of 100000 steps" in prov["summary"], prov
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".*.partial"))  # the half-made export was swapped in whole
    assert len(prov["examples"]) == 3 and all("->" in e for e in prov["examples"]), prov


@pytest.mark.parametrize("name", ["gpt-tiny-kjv", "bert-tiny-kjv", "t5-tiny-kjv"])
def test_each_shipped_demo_model_says_how_it_was_made(name):
    prov = json.loads((DEMO_MODELS / name / "provenance.json").read_text())
    assert prov["name"] == name and prov["device"] and len(prov["commit"]) >= 7 and prov["date"], prov
    assert prov["overrides"]["train.train_iters"] >= prov["steps"] > 0 and prov["final_train_loss"] > 0, prov
    assert "tools/train_demo_models.py" in prov["summary"] and prov["examples"], prov
