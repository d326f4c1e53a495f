"""Optimizer CPU offload (`parallel.optimizer_cpu_offload`) as a layout: the validator's rules (exit 2 naming the
field), megatron's optimizer fields, the planner's device and host bytes, the advisor's offloaded candidates and the
whole-step CUDA graph's refusal.  The run itself needs GPUs (megatron's HybridDeviceOptimizer copies over CUDA
streams): not trained here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from workbench import kernel_rule, planner
from workbench.advisor import advise, format_advice
from workbench.advisor.enumerate import apply_layout, layout_of
from workbench.cli import main
from workbench.config import RunConfig, preset

GiB = 2**30
EIGHT_B = {"parallel.nproc_per_node": 2, "parallel.distributed_optimizer": True, "train.micro_batch_size": 1,
           "train.global_batch_size": 16, "parallel.recompute": "full"}


def _problems(cfg) -> dict[str, str]:
    out: dict[str, str] = {}
    for q in cfg.validate():
        out[q.field] = f"{out[q.field]} | {q.rule}" if q.field in out else q.rule
    return out


def test_the_validator_names_the_field_and_the_fix(tmp_path, capsys):
    gpu = preset("llama3.1-8b", **{"parallel.nproc_per_node": 2})
    assert "parallel.optimizer_cpu_offload" in _problems(gpu.replace(**{"parallel.optimizer_cpu_offload": 1.0}))  # no dist-opt
    assert "fraction" in _problems(gpu.replace(**{"parallel.optimizer_cpu_offload": 1.5,
                                                  "parallel.distributed_optimizer": True}))["parallel.optimizer_cpu_offload"]
    ok = gpu.replace(**{"parallel.optimizer_cpu_offload": 0.5, "parallel.distributed_optimizer": True})
    assert _problems(ok) == {}
    cpu = preset("tiny", **{"parallel.distributed_optimizer": True, "parallel.optimizer_cpu_offload": 1.0})
    assert "CPU mode" in _problems(cpu)["parallel.optimizer_cpu_offload"]
    fp32 = ok.replace(**{"train.precision": "fp32"})  # megatron's offload keeps fp32 copies of 16-bit weights only
    assert "fp32" in _problems(fp32)["parallel.optimizer_cpu_offload"]
    path = cpu.save(tmp_path / "cpu.json")
    assert main(["plan", str(path)]) == 2
    assert "parallel.optimizer_cpu_offload" in capsys.readouterr().err


def test_megatron_gets_its_offload_fields():
    from megatron.core.optimizer import OptimizerConfig

    from workbench.backend.optimizer_paths import offload_fields

    on = preset("llama3.1-8b", **EIGHT_B, **{"parallel.optimizer_cpu_offload": 0.75}).parallel
    ocfg = OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True, use_distributed_optimizer=True, **offload_fields(on))
    assert ocfg.optimizer_cpu_offload and ocfg.optimizer_offload_fraction == 0.75
    assert ocfg.use_precision_aware_optimizer and ocfg.overlap_cpu_optimizer_d2h_h2d
    assert offload_fields(dataclasses.replace(on, optimizer_cpu_offload=0.0)) == {}


def test_the_host_step_gets_the_ranks_share_of_the_cores(monkeypatch):
    import os

    import torch

    from workbench.backend.optimizer_paths import offload_threads

    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert offload_threads() == cores == torch.get_num_threads()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * cores))  # more ranks than cores: one each
        assert offload_threads() == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_the_planner_moves_master_weights_and_moments_to_the_host():
    base = preset("llama3.1-8b", **EIGHT_B)
    plans = {f: planner.predict(base.replace(**{"parallel.optimizer_cpu_offload": f}), "H100-80GB") for f in (0.0, 0.5, 1.0)}
    st = {f: p.worst for f, p in plans.items()}
    shard_state = st[0.0].components["master_weights"] + st[0.0].components["optimizer_moments"]  # 12 bytes a shard parameter
    for f in (0.5, 1.0):
        device_state = st[f].components["master_weights"] + st[f].components["optimizer_moments"]
        assert device_state == pytest.approx((1 - f) * shard_state, rel=1e-6)
        assert st[f].detail["optimizer_host_bytes"] == pytest.approx(f * shard_state * 16 / 12, rel=1e-6)
        for k in ("weights", "gradients", "activations"):  # what stays on the GPU
            assert st[f].components[k] == st[0.0].components[k]
    assert st[0.0].detail["optimizer_host_bytes"] == 0
    assert not plans[0.0].fits and plans[1.0].fits  # 8B at DP=2 on 80 GB: the optimizer state is what does not fit
    offload = [s for s in plans[0.0].suggestions if "optimizer_cpu_offload" in json.dumps(s.overrides)]
    assert offload and offload[0].fits
    text = planner.format_plan(plans[1.0])
    assert "optimizer CPU offload: host memory" in text and f"{st[1.0].detail['optimizer_host_bytes'] / GiB:.2f} GiB" in text
    assert "optimizer CPU offload" not in planner.format_plan(plans[0.0]).split("fits:")[0]


def test_the_whole_step_graph_is_refused_under_offload():
    one = preset("gpt2-small", **{"parallel.distributed_optimizer": True})
    assert kernel_rule.step_graph_blocker(one) is None
    assert "optimizer_cpu_offload" in kernel_rule.step_graph_blocker(one.replace(**{"parallel.optimizer_cpu_offload": 1.0}))


def test_the_advisor_offers_offload_where_nothing_else_fits():
    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 16})
    advice = advise(cfg, 1, gpu="H100-80GB", top=3)  # one 80 GB GPU: no layout fits without offload
    best = advice.best
    assert best is not None and best.layout.offload == 1.0 and best.layout.distributed_optimizer and best.rank == 1
    assert "offload" in best.label and "optimizer CPU offload" in " ".join(advice.notes)
    c = apply_layout(cfg, best.layout, 1)
    assert cfg.replace(**best.overrides).to_dict() == c.to_dict() and layout_of(c) == best.layout
    assert planner.predict(c, "H100-80GB", suggest=False).fits
    # the offloaded step costs the host's time per parameter of the shard (its own row's optimizer time is the larger)
    plain = dataclasses.replace(best.layout, offload=0.0)
    from workbench.advisor.perf_model import Model
    from workbench.advisor.profile import default_profile

    model = Model(cfg, default_profile("H100-80GB"))
    t_off = model.predict(c, 1).breakdown["optimizer"]
    t_on = model.predict(apply_layout(cfg, plain, 1), 1).breakdown["optimizer"]
    assert t_off > t_on
    assert "offload" in format_advice(advice)


def test_the_advisor_keeps_offload_out_where_layouts_fit_without_it():
    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 16})
    advice = advise(cfg, 1, gpu="H200-141GB", top=3)
    assert advice.best is not None and advice.best.layout.offload == 0.0
    speeds = [r.prediction.tokens_per_s for r in advice.rows]
    assert speeds == sorted(speeds, reverse=True)
    assert [r.rank for r in advice.rows if r.fits] == list(range(1, len(advice.fitting()) + 1))


def test_no_offloaded_row_repeats_a_layout_that_fits_without_it():
    """Two nodes of 8 H100s, Llama-3.1-8B: layouts without the distributed optimizer run out of memory where their
    distributed-optimizer twins fit; their offloaded forms would be those twins, slower, and are not even planned.
    The planner's count of layouts stays within the valid ones (offloaded forms are counted apart)."""
    from workbench.advisor.advise import _offloaded
    from workbench.advisor.perf_model import Model
    from workbench.advisor.profile import default_profile

    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 512})
    advice = advise(cfg, 16, gpu="H100-80GB", nodes=2, top=20)
    fitting = {r.layout for r in advice.rows if r.fits}
    oom = [r for r in advice.rows if r.fits is False]
    twin_fits = [r for r in oom if dataclasses.replace(r.layout, distributed_optimizer=True) in fitting]
    assert twin_fits  # the case this test is about occurs here
    out, planned = _offloaded(cfg, advice.rows, Model(cfg, default_profile("H100-80GB")), planner.gpu_spec("H100-80GB"), 8, 2)
    assert planned <= len(oom) - len(twin_fits)
    assert not [o.label for o in out if dataclasses.replace(o.layout, offload=0.0) in fitting]
    assert advice.memory_evaluated <= advice.valid_layouts
    one = advise(preset("llama3.1-8b", **{"train.global_batch_size": 16}), 1, gpu="H100-80GB", top=3)
    assert one.memory_evaluated <= one.valid_layouts and one.offload_evaluated > 0
    assert [r.rank for r in one.rows if r.fits] == [1, 2, 3]
    shown_off = sum(1 for r in one.rows if r.fits and r.layout.offload)
    assert any(n.startswith(f"{shown_off} of the layouts shown fit only with optimizer CPU offload") for n in one.notes)


def test_the_offloads_copies_back_and_its_start_up_peak_are_planned():
    """The copies back into bf16 weights convert on the GPU (an fp32 temporary of a parameter, two with bf16
    gradients: fp32 gradients need no conversion); at DP = 2 megatron's two builds of the offloading optimizer (the
    first over all the rank's parameters) hold more host memory at start-up than the steady state."""
    base = preset("llama3.1-8b", **EIGHT_B, **{"parallel.optimizer_cpu_offload": 1.0})
    fp32_grads = planner.predict(base.replace(**{"train.grad_reduce_in_fp32": True}), "H100-80GB").worst
    bf16_grads = planner.predict(base.replace(**{"train.grad_reduce_in_fp32": False}), "H100-80GB").worst
    t32, t16 = fp32_grads.detail["optimizer_step_transient"], bf16_grads.detail["optimizer_step_transient"]
    assert t32 > 0 and t16 == pytest.approx(2 * t32, rel=1e-6)
    assert fp32_grads.detail["optimizer_host_startup_bytes"] > fp32_grads.detail["optimizer_host_bytes"] > 0
    assert "while the optimizer is built" in planner.format_plan(planner.predict(base, "H100-80GB"))


def test_an_offloading_optimizers_param_groups_save_as_plain_data():
    """megatron's HybridDeviceOptimizer (a torch Optimizer) keeps its sub-optimizers' classes among its defaults, so in
    every param group of its state dict, which the distributed optimizer stores as common state: the workbench's
    loader (weights_only) refuses such a checkpoint unless the save drops them; the rest of each group is kept."""
    import io

    import torch

    from workbench.checkpoint.dist import plain_param_groups
    from workbench.checkpoint.names import CheckpointError
    from workbench.checkpoint.safe_load import safe_torch_load

    p = torch.nn.Parameter(torch.zeros(3))
    hybrid_like = torch.optim.Optimizer([p], defaults={"lr": 1e-3, "offload_fraction": 1.0,
                                                       "cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": torch.optim.AdamW})
    sd = {"optimizer": {"optimizer": {"param_groups": hybrid_like.state_dict()["param_groups"]}}, "param_state": {}}

    def reload(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return safe_torch_load(buf, source="common state")

    with pytest.raises(CheckpointError, match="more than tensors"):
        reload(sd)
    group = reload(plain_param_groups(sd))["optimizer"]["optimizer"]["param_groups"][0]
    assert group == {"lr": 1e-3, "offload_fraction": 1.0, "params": [0]}


def _measured_offload_rows() -> list[dict]:
    path = Path(__file__).resolve().parents[2] / "evidence" / "planner_2gpu.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    return [r for r in rows if r.get("config") == "g2s-dp2-distopt-offload" and r.get("status") == "ok"]


@pytest.mark.skipif(not _measured_offload_rows(), reason="no offloaded planner row measured on GPUs yet")
def test_the_offloaded_plan_holds_against_the_measured_rows():
    """Full offload keeps no moments on the device, yet the step's small lasting allocations still split a freed
    logits block (measured: two H200s, planner_measure's g2s-dp2-distopt-offload): allocated and reserved within 5%
    on each rank, re-planned from the run's own config."""
    for rec in _measured_offload_rows():
        cfg = RunConfig.from_dict(rec["run_config"])
        plan = planner.predict(cfg, assumptions=planner.PlannerAssumptions(transformer_engine=False))
        assert plan.stages[0].reserved_terms["stranded_by_adam_state"] > 0
        rk = plan.ranks[rec["rank"]]
        for got, measured in ((rk.peak_allocated, rec["measured_allocated"]), (rk.peak_reserved, rec["measured_reserved"])):
            assert abs(got - measured) / measured < 0.05, (rec["rank"], got, measured)
