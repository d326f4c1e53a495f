"""``workbench generate`` says on stderr what it is doing while it waits (several seconds pass before the first
result on CPU): a line as each phase starts -- the process start, model parallel, building the model, loading the
checkpoint, generating -- in that order, each before the results; stdout holds the results alone, as before."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")

PHASES = ("starting 1 generation process", "initialising model parallel", "building the model",
          "loading checkpoint", "generating up to 3 tokens for 2 prompt(s)")


def test_each_phase_is_a_stderr_line_in_order_and_stdout_is_unchanged(gpt2_checkpoint):
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "generate", "--ckpt", str(gpt2_checkpoint),
                           "--prompt", "the cat", "--prompt", "a dog ran", "--max-new-tokens", "3", "--greedy",
                           "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("generate: ")]
    at = []
    for phase in PHASES:
        hits = [i for i, line in enumerate(lines) if phase in line]
        assert hits, (phase, proc.stderr[-3000:])
        at.append(hits[0])
    assert at == sorted(at), lines
    assert "loading checkpoint" in lines[at[3]] and str(gpt2_checkpoint) in lines[at[3]], lines
    results = json.loads(proc.stdout)  # stdout: the machine-readable results only
    assert [r["prompt"] for r in results] == ["the cat", "a dog ran"]
    assert all(len(r["token_ids"]) == 3 for r in results), results
