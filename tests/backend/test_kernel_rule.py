"""The one kernel rule is what the backend builds: the real model, for a grid of configs.

``tests/support/kernel_rule_check.py`` builds every model chunk of 2 gloo ranks on CPU (the
compiled fast paths allowed there and run eagerly) for TP 1/2, SP, RoPE / learned / ALiBi, GQA
and MQA, recompute none / selective / full, PP 2 and interleaved PP, dropout, compile off and
stock attention, runs one forward per stage, and reports the core attention, whether every
layer ran the compiled dense path, the norm and the bound cross-entropy; the planner's kernel
path (:func:`workbench.kernel_rule.choose`) must say the same on every rank.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import torchrun_args, SUPPORT

pytestmark = pytest.mark.slow

_NORMS = {"workbench": {"WorkbenchLayerNorm", "WorkbenchRMSNorm"}, "torch": {"torch"}}


@pytest.fixture(scope="module")
def reports(free_port) -> list[dict]:
    out = subprocess.run([sys.executable, *torchrun_args("2"),
                          str(SUPPORT / "kernel_rule_check.py")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 15, out.stdout[-2000:]
    return rows


@pytest.fixture(scope="module")
def free_port() -> int:  # module scope: one torchrun for the whole grid
    from tests.support import free_port as port

    return port()


def test_every_config_builds_what_the_rule_says(reports):
    for row in reports:
        planned, name = row["planned"], row["config"]
        for rank, built in enumerate(row["built"]):
            assert "error" not in built, f"{name} rank {rank}: {built}"
            assert built["attention"] == [planned["attention"]], (name, rank, built, planned)
            assert built["layer"] == [planned["layer"]], (name, rank, built, planned)
            assert set(built["norm"]) <= _NORMS[planned["norm"]], (name, rank, built, planned)
            assert built["cross_entropy"] in ([], [planned["cross_entropy"]]), (name, rank, built, planned)
        # the last pipeline stage holds the loss: its cross-entropy is the one planned
        assert row["built"][-1]["cross_entropy"] == [planned["cross_entropy"]], row


def test_the_grid_covers_both_answers_and_names_why(reports):
    by = {r["config"]: r["planned"] for r in reports}
    assert {p["layer"] for p in by.values()} == {"compiled", "stock"}
    assert by["tp2-sp"]["layer"] == "compiled" and by["tp2"]["cross_entropy"] == "vocab_parallel"
    assert by["rope"]["layer"] == "compiled" and by["alibi"]["layer_reason"] == "ALiBi"
    assert "KV groups" in by["tp2-mqa"]["layer_reason"] and by["dropout"]["layer"] == "compiled"
    assert by["local-attention"]["attention"] == "local" and by["pp2"]["cuda_graphs_reason"].startswith("pipeline")
