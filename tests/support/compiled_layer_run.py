"""Running ``tests/support/compiled_layer_check.py`` and judging its results: shared by the compiled-layer test files
(tests/backend/test_compiled_layer*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import SUPPORT, torchrun_args

ROOT = Path(__file__).resolve().parents[2]
LAYER_CHECK = SUPPORT / "compiled_layer_check.py"


def run_check(*args: str, port: int) -> dict:
    # a test process's own rendezvous variables (tests that initialise one process set RANK, WORLD_SIZE, MASTER_*)
    # are not the check's: it starts its own process groups
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.run([sys.executable, str(LAYER_CHECK), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**env, "CHECK_PORT": str(port)})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1.0)


def assert_families_match(r: dict, rel: float) -> None:
    for name, runs in r.items():
        stock, fast = runs["stock"], runs["fast"]
        assert stock["fast_calls"] == 0 and stock["layers"] == 0, name  # megatron's own layers
        # every layer (T5: encoder and decoder) took the compiled path, each micro-batch of each step
        assert fast["blockers"] == [None] * fast["layers"] and fast["fast_calls"] == fast["layers"] * 2 * 3, (name, fast)
        for a, b in zip(stock["losses"], fast["losses"]):
            assert close(a, b, rel), (name, stock["losses"], fast["losses"])
        for a, b in zip(stock["grad_norms"], fast["grad_norms"]):
            assert close(a, b, 10 * rel), (name, stock["grad_norms"], fast["grad_norms"])
        assert fast["losses"][0] != fast["losses"][2]  # the optimizer really stepped


def tp2_check(what: str = "tp2", **env: str) -> dict:
    """tests/support/compiled_layer_check.py ``what`` (tp2, tp2-order) under torchrun on two CPU ranks: its JSON result."""
    proc = subprocess.run([sys.executable, *torchrun_args(2),
                           str(LAYER_CHECK), what], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_tp2_matches_stock(v: dict, rel: float, passes: int = 1) -> None:
    # 4 layers x 2 ranks x forward passes per layer (2 under full recompute)
    assert v["blockers"] == [None] * 4 and v["fast_calls_all_ranks"] == 8 * passes, v
    assert v["one_graph"] == [True] * 4, v
    assert v["loss_diff_max"] <= rel * abs(v["loss_stock"]) and v["grad_rel_max"] < rel, v


def gemms_in_flight(events: list[str]) -> list[int]:
    """Per collective start (an all-to-all "exchange" too) in code order: how many GEMMs run before its wait."""
    counts = []
    for i, kind in enumerate(events):
        if kind in ("start", "exchange"):
            rest = events[i + 1:]
            counts.append(sum(rest[:rest.index("wait")].count(k) for k in ("mm", "gemm")))
    return counts
