"""The planner under context parallelism (#53): a rank holds seq_length / cp tokens of each sequence, so its kept
activations fall by cp; the ring attention's K/V blocks, dK/dV accumulators and math-kernel scores are added to the
layer's backward working set; every rank of the tp x cp x pp x dp world has a plan."""

from __future__ import annotations

import pytest

from workbench import planner
from workbench.config import derive, preset
from workbench.families import family_of


def _plan(cp: int, **over):
    cfg = preset("llama3.2-1b", **{"parallel.context_parallel": cp, "parallel.nproc_per_node": cp, "model.seq_length": 8192,
                                   "train.micro_batch_size": 1, "train.global_batch_size": 8, **over})
    return planner.predict(cfg, "H100-80GB", suggest=False)


def test_activations_divide_by_cp_and_the_ring_is_counted():
    p2, p4 = _plan(2), _plan(4)
    a2, a4 = p2.stages[0].components["activations"], p4.stages[0].components["activations"]
    assert a4 == pytest.approx(a2 / 2, rel=1e-3)
    assert p4.layout["cp"] == 4 and p4.layout["dp"] == 1
    assert sorted(r.rank for r in p4.ranks) == [0, 1, 2, 3]
    sh = family_of(preset("llama3.2-1b")).shapes.shape(preset("llama3.2-1b"), derive(preset("llama3.2-1b")))
    import dataclasses

    local = dataclasses.replace(sh, s=8192 // 4, b=1)
    ring = planner.ring_buffers(local, 4)
    assert ring > 0 and planner.ring_buffers(local, 1) == 0
    # K and V: current and next block (bf16); dK/dV accumulators (fp32: received, the block's, their sum, in flight);
    # the math kernel's backward on the step-0 block: scores, probabilities, dP, dP - delta, dS (fp32, at once)
    kv = 1 * 2048 * 8 * 64
    assert ring == 2 * 2 * kv * 2 + 4 * 2 * kv * 4 + 5 * 4 * 1 * 32 * 2048 * 2048


def test_the_distributed_optimizer_shards_over_dp_times_cp():
    """megatron's DDP buffers (and the distributed optimizer's shards) span DP x CP: at DP=1, CP=2 the distributed
    optimizer halves the fp32 master weights and Adam's moments; at CP=4 it quarters them."""
    def state(cp: int, dist: bool) -> tuple[float, float]:
        c = _plan(cp, **{"parallel.distributed_optimizer": dist}).stages[0].components
        return c["master_weights"], c["optimizer_moments"]

    for cp in (2, 4):
        (m_d, o_d), (m, o) = state(cp, True), state(cp, False)
        assert o > 0 and m_d == pytest.approx(m / cp, rel=1e-3) and o_d == pytest.approx(o / cp, rel=1e-3), cp


def test_cp_lowers_the_peak():
    assert _plan(4).stages[0].total < _plan(2).stages[0].total


def test_the_flash_block_kernel_keeps_no_scores():
    """On CUDA in bf16 the ring's blocks run the flash kernel (``impl='auto'``): no s_local^2 scores in the layer's
    backward working set, so CP at long sequences is not dominated by the math kernel's block scores; on CPU (the math
    kernel) they stay."""
    cfg = preset("llama3.2-1b", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "model.seq_length": 32768,
                                   "train.micro_batch_size": 1, "train.global_batch_size": 2})
    sh = family_of(cfg).shapes.shape(cfg, derive(cfg))
    import dataclasses

    local = dataclasses.replace(sh, s=16384)
    assert planner.ring_flash(cfg, local) and not planner.ring_flash(cfg.replace(**{"parallel.device": "cpu"}), local)
    flash, math_ = planner.ring_buffers(local, 2, flash=True), planner.ring_buffers(local, 2)
    assert flash < math_ / 100
    assert planner.predict(cfg, "H200-141GB", suggest=False).fits


def test_bert_under_cp_is_planned_on_the_math_block_kernel():
    """BERT's attention takes a key-padding mask, which the flash block kernel cannot: its ring runs the math kernel
    (``context_parallel._flash_ok``), so the plan keeps the block scores (``Supports.key_padding``)."""
    import dataclasses

    cfg = preset("bert-large", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "parallel.device": "cuda",
                                  "train.precision": "bf16", "model.attention_dropout": 0.0, "model.seq_length": 512,
                                  "train.micro_batch_size": 1, "train.global_batch_size": 2})
    sh = dataclasses.replace(family_of(cfg).shapes.shape(cfg, derive(cfg)), s=256)
    assert sh.e == 2 and sh.head_dim % 8 == 0  # what the flash kernel needs, but for the mask
    assert not planner.ring_flash(cfg, sh)
    gpt = preset("gpt2-medium", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "parallel.device": "cuda",
                                   "train.precision": "bf16"})
    assert planner.ring_flash(gpt, family_of(gpt).shapes.shape(gpt, derive(gpt)))  # the same GPU, causal: flash


def _measured_cp_rows() -> list[dict]:
    """The newest GPU measurement of every (config, rank, allocator) with CP > 1 (``evidence/planner_2gpu.jsonl``,
    ``tests/gpu_proofs/planner_measure.py --only llama1b-cp2-16k,llama1b-cp2-32k``)."""
    import json

    from tests.support import ROOT

    newest = {}
    for line in (ROOT / "evidence" / "planner_2gpu.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("status") == "ok" and r.get("measured_allocated") and r["run_config"]["parallel"].get("context_parallel", 1) > 1:
            newest[(r["config"], r["rank"], str((r.get("kernel_path") or {}).get("allocator")))] = r
    return list(newest.values())


def test_the_plan_holds_the_measured_cp_ranks_within_5_percent():
    """Llama-3.2-1B at 16k and 32k, CP=2 on two H200s: allocated within 5% on every rank and never more than 1% under
    it (the ring's own copy of its output counted: without it the plan fell 1.4% / 2.0% short); reserved within 5% where the ranks ran with
    expandable segments (the rank environment's choice under CP: under the default allocator the plan fell 6.4% / 8.3% short of reserved)."""
    from workbench.planner.evidence import BAR, replan

    rows = _measured_cp_rows()
    assert {r["run_config"]["model"]["seq_length"] for r in rows} >= {16384, 32768}
    assert any("expandable_segments:True" in str(r["kernel_path"].get("allocator")) for r in rows)
    for rec in rows:
        rk = replan(rec).ranks[rec["rank"]]
        assert abs(rk.peak_allocated / rec["measured_allocated"] - 1) <= BAR, (rec["config"], rec["rank"], rec["git_commit"])
        # the direction that runs out of memory: no measured rank more than 1% above its plan
        assert rk.peak_allocated >= 0.99 * rec["measured_allocated"], (rec["config"], rec["rank"], "under-planned")
        if "expandable_segments:True" in str(rec["kernel_path"].get("allocator")):
            assert abs(rk.peak_reserved / rec["measured_reserved"] - 1) <= BAR, (rec["config"], rec["rank"], "reserved")
