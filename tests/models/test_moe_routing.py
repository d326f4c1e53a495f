"""MoE routing, dispatch and combine as the workbench builds them, against a dense per-token reference.

``tests/support/moe_routing_check.py`` builds a one-layer ``moe-tiny`` on one gloo rank through the family's
builder and compares megatron's ``MoELayer`` (all-to-all and all-gather dispatchers) with a loop over tokens:
top-1 / top-2 / top-3, softmax over the chosen scores or over all experts, dropless and with a capacity (each
expert keeps its highest-probability tokens; padded to capacity or not), shared experts.  The grouped-GEMM
experts (the kernel rule's ``torch_grouped``, dropless through the workbench's local token dispatch) must give
SequentialMLP's outputs and gradients through megatron's dispatcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT, SUPPORT, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(SUPPORT / "moe_routing_check.py"), str(free_port())], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return {r["case"]: r for r in (json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))}


def test_routing_dispatch_and_combine_equal_the_per_token_reference(rows):
    routed = [r for r in rows.values() if isinstance(r.get("experts"), str)]
    assert len(routed) == 8
    for r in routed:
        assert r["max_diff"] <= 1e-5 * r["scale"], r


def test_capacity_drops_tokens_and_dropless_keeps_all(rows):
    for name, r in ((n, r) for n, r in rows.items() if isinstance(r.get("experts"), str)):
        if "capacity" in name:
            assert r["kept"] < r["asked"], r  # 0.5 capacity: some assignments dropped, as the reference drops them
        elif "dropless" in name or "pre-softmax" in name:
            assert r["kept"] == r["asked"], r


def test_grouped_gemm_experts_equal_sequential_mlp(rows):
    grouped = [r for r in rows.values() if isinstance(r.get("experts"), list)]
    assert len(grouped) == 3
    for r in grouped:
        assert r["experts"] == ["GroupedGemmMLP", "SequentialMLP"], r
        local = "capacity" not in r["case"]  # a capacity drops tokens: megatron's dispatcher
        assert r["dispatch"] == ["LocalTokenDispatcher" if local else "MoEAlltoAllTokenDispatcher", "MoEAlltoAllTokenDispatcher"], r
        assert r["grads"][0] == r["grads"][1] and r["grads"][0] > 10, r
        assert r["max_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, r


def test_grouped_experts_can_add_their_gradients_into_main_grad_themselves(rows):
    # separate main_grad tensors: the stacked gradient into them with one foreach add; views of one flat buffer one
    # distance apart in reverse order (megatron DDP's layout): one add into a strided view of it
    for case, path in (("grouped-main-grad-direct", "foreach"), ("grouped-main-grad-direct-strided", "strided")):
        r = rows[case]
        assert r["path"] == path, r
        assert r["weights"] == 2 * 8 and r["grads_left"] == 0, r  # moe-tiny's 8 experts: fc1 + fc2 each, no .grad left
        assert r["max_diff"] <= 1e-6 * r["scale"], r


def test_the_planners_parameter_count_is_the_built_models(rows):
    for name in ("params-every-layer", "params-shared-every-2nd"):
        assert rows[name]["built"] == rows[name]["derived"], rows[name]
