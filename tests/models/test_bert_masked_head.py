"""BERT's masked-LM head on the masked positions only: the same loss and gradients as the head on every position.

The check runs in a subprocess (tests/support/bert_head_check.py): the family's own ``forward_step`` and ``loss`` on
synthetic BERT samples (padding included), the same model with the head on every position as the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import torchrun_args, SUPPORT, free_port

ROOT = Path(__file__).resolve().parents[2]
CHECK = SUPPORT / "bert_head_check.py"


def _run(nproc: int) -> dict:
    cmd = [sys.executable, str(CHECK)] if nproc == 1 else [
        sys.executable, *torchrun_args(str(nproc)), str(CHECK)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CHECK_PORT": str(free_port())})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _same_maths(r: dict) -> None:
    assert r["loss_masked_head"] == r["loss_full_head"], r
    assert r["grad_rel_max"] < 1e-6 and r["same_grad_keys"], r
    assert r["per_token_equal_at_masks"], r


def test_masked_positions_head_gives_the_full_heads_loss_and_gradients():
    r = _run(1)["tp1"]
    _same_maths(r)
    # the head ran on the masked rows only: the other positions' losses are 0 (the full head's are not)
    assert r["zero_elsewhere"] and r["full_head_nonzero_elsewhere"], r
    assert r["masked_rows"] <= 4 * r["masked_per_sequence"] < r["positions"], r
    # a batch with more masked positions than the head's rows stops the step (never a partial loss)
    assert "more masked positions" in (r["overflow_refused"] or ""), r


def test_masked_positions_head_under_tensor_parallelism():
    """TP=2: the selected rows through the vocab-parallel output layer and cross-entropy; with sequence parallelism
    (the hidden states split along the sequence) the head runs on every position."""
    r = _run(2)
    _same_maths(r["tp2"])
    assert r["tp2"]["zero_elsewhere"], r["tp2"]
    _same_maths(r["tp2+sp"])
    assert not r["tp2+sp"]["zero_elsewhere"] and r["tp2+sp"]["overflow_refused"] is None, r["tp2+sp"]
