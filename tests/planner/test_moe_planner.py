"""The planner's MoE terms (GPT's shapes, workbench.families.common.moe_shapes): published parameter counts, expert
weights / gradients / optimizer state per EP rank, the distributed optimizer over the expert data-parallel group,
routed activations and the imbalance bound they assume."""

from __future__ import annotations

import pytest

from workbench import planner
from workbench.config import derive, preset
from workbench.families.common import moe_shapes
from workbench.families.common.shapes import shape


@pytest.mark.parametrize("name, billions", [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5), ("olmoe-1b-7b", 6.9)])
def test_published_moe_sizes(name, billions):
    # OLMoE / Qwen3-MoE also have q/k norms (a few thousand parameters), which the workbench model has not
    assert derive(preset(name)).params.total / 1e9 == pytest.approx(billions, rel=0.01)


def test_megatron_flops_count_the_routed_experts_only():
    dense = preset("moe-research", **{"model.moe.num_experts": 0, "model.ffn_hidden_size": 8 * 512})
    moe = preset("moe-research")  # top-8 of 64 experts of 512: the same MLP FLOPs as one 4096-wide MLP
    assert derive(moe).flops_per_step == pytest.approx(derive(dense).flops_per_step)


def _stage(cfg):
    return planner.predict(cfg, gpu="h100").stages[0]


def test_expert_state_per_ep_rank():
    one = _stage(preset("moe-research"))
    two = _stage(preset("moe-research", **{"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2}))
    e1, e2 = one.detail["params"]["experts"], two.detail["params"]["experts"]
    assert e1 == 16 * 64 * 3 * 1024 * 512 and e2 == e1 // 2
    assert one.detail["params"]["total"] - e1 == two.detail["params"]["total"] - e2  # the dense part is unchanged
    for key, per_param in (("weights", 2), ("gradients", 4), ("optimizer_moments", 8), ("master_weights", 4)):
        assert one.components[key] - two.components[key] == per_param * (e1 - e2), key


def test_distributed_optimizer_shards_experts_over_expert_data_parallel():
    over = {"parallel.nproc_per_node": 4, "parallel.distributed_optimizer": True, "train.global_batch_size": 64}
    ep2 = _stage(preset("moe-research", **over, **{"parallel.expert_parallel": 2}))
    P, Pe = ep2.detail["params"]["total"], ep2.detail["params"]["experts"]
    # dense DP 4, expert DP = 4 / (ETP 1 x EP 2 x PP 1) = 2
    assert ep2.components["optimizer_moments"] == pytest.approx(8 * (-(-(P - Pe) // 4) + -(-Pe // 2)), abs=8)


def test_routed_activations_follow_top_k_and_state_their_imbalance_bound():
    base = preset("moe-research")
    k2 = preset("moe-research", **{"model.moe.top_k": 2})
    t8, t2 = _stage(base).detail["layer_activation_terms"], _stage(k2).detail["layer_activation_terms"]
    for k in ("expert_input", "expert_fc1_output", "expert_act_output"):
        assert t8[k] == pytest.approx(4 * t2[k], rel=1e-6), k
    assert "fc1_output" not in t8  # every layer is MoE: no dense MLP intermediates
    # EP = 1: every routed token is on the rank, the count is exact; EP = 2 dropless: the stated bound
    sh1 = shape(base, derive(base))
    ep2 = preset("moe-research", **{"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2})
    sh2 = shape(ep2, derive(ep2))
    tokens = base.model.seq_length * base.train.micro_batch_size
    assert moe_shapes.routed_tokens(sh1) == (tokens * 8, tokens * 8)
    planned, worst = moe_shapes.routed_tokens(sh2)
    assert planned == tokens * 8 * moe_shapes.DROPLESS_IMBALANCE and worst == tokens * 2 * 8
    capped = preset("moe-research", **{"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2, "model.moe.capacity_factor": 1.1})
    assert moe_shapes.routed_tokens(shape(capped, derive(capped)))[0] == pytest.approx(tokens * 8 * 1.1)


def test_grouped_gemm_keeps_the_stacked_expert_weights():
    cfg = preset("moe-research")
    grouped = _stage(cfg).detail["layer_activation_terms"]
    seq = _stage(cfg.replace(**{"model.moe.grouped_gemm": False})).detail["layer_activation_terms"]
    assert grouped["grouped_weight_stack"] == 2 * 64 * 3 * 512 * 1024 and "grouped_weight_stack" not in seq


def test_moe_research_fits_one_h100_and_mixtral_needs_expert_parallelism():
    assert _stage(preset("moe-research")).peak_reserved < 70 * 2**30
    one = planner.predict(preset("mixtral-8x7b"), gpu="h100")
    assert one.stages[0].components["weights"] > 80 * 2**30


def test_moe_research_on_one_gpu_within_5_percent_of_its_newest_protocol_row():
    """``bench/moe_bench.py``'s one-GPU row (the run's peak allocated memory over every step, one H200) against the
    planner on the kernel path that row ran: the grouped experts, the workbench's token dispatch, its CUDA graphs."""
    import json

    from tests.support import ROOT

    rows = [json.loads(ln) for ln in (ROOT / "bench" / "results" / "moe_bench.jsonl").read_text().splitlines() if ln.strip()]
    row = [r for r in rows if r["row"] == "workbench-1gpu" and r.get("measured") == "protocol" and r.get("kernels")][-1]
    assert row["kernels"]["experts"] == "torch_grouped" and row["kernels"].get("moe_dispatch") == "workbench", row["kernels"]
    graphs_off = planner.PlannerAssumptions(cuda_graphs=False) if not row["kernels"].get("cuda_graphs_impl") else None
    predicted = planner.predict(preset("moe-research"), gpu="h200", assumptions=graphs_off).stages[0].peak_allocated
    assert abs(predicted / row["mem_peak"] - 1) <= 0.05, (predicted / 2**30, row["mem_peak"] / 2**30, row["git_commit"])


def _measured_moe_planner_rows() -> list[dict]:
    """The newest ``moe_proof.py --phases planner`` record of each (config, rank): real runs of ``moe-research`` at
    EP=1 and EP=2 with their measured peaks (GPU evidence, device, date and commit in each)."""
    import json

    from tests.support import ROOT

    path = ROOT / "evidence" / "moe_proof.jsonl"
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    newest = {(r["config"], r["rank"]): r for r in recs if r.get("phase") == "planner" and r.get("status") == "ok"}
    return list(newest.values())


def test_moe_plan_within_5_percent_of_the_measured_ranks_at_ep1_and_ep2():
    """Allocated on every rank at EP=1 and EP=2, re-planned on the kernel path the run reported; reserved where the
    allocator cannot fragment on changing buffer sizes (EP=1, or EP > 1 under expandable segments: a run before
    those reports no allocator and its EP=2 reserved peaks sit 35% over allocated, which no plan of tensors models)."""
    from workbench.planner.evidence import BAR, replan

    rows = _measured_moe_planner_rows()
    assert {r["run_config"]["parallel"]["expert_parallel"] for r in rows} >= {1, 2}
    for rec in rows:
        rk = replan(rec).ranks[rec["rank"]]
        ep = rec["run_config"]["parallel"]["expert_parallel"]
        assert abs(rk.peak_allocated / rec["measured_allocated"] - 1) <= BAR, (rec["config"], rec["rank"], rec["git_commit"])
        # the direction that runs out of memory: no measured rank (the busiest EP rank among them) above its plan
        assert rk.peak_allocated >= 0.99 * rec["measured_allocated"], (rec["config"], rec["rank"], "under-planned")
        if ep == 1 or "expandable_segments:True" in str(rec["kernel_path"].get("allocator", "")):
            assert abs(rk.peak_reserved / rec["measured_reserved"] - 1) <= BAR, (rec["config"], rec["rank"], "reserved")
