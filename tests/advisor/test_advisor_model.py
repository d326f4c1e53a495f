"""The performance model's arithmetic on a synthetic profile (flat rates, chosen constants), against derive()'s FLOPs,
the schedule simulator's closed forms and the collectives' byte counts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from workbench import schedules
from workbench.advisor.enumerate import Layout, apply_layout
from workbench.advisor.perf_model import REASONS, Constants, Model, flop_split
from workbench.advisor.profile import SCHEMA, ProfileError, default_profile, load_profile, profile_from_dict
from workbench.config import derive, preset

RATE = 500.0  # TFLOP/s, GEMM and attention alike
BW = 2000.0  # GB/s memory
LINK = 100.0  # GB/s bus bandwidth, every size


def _pt(x, v):
    return {"x": x, "value": v, "source": "synthetic"}


def synthetic(link: float = LINK, host_graphs: float = 1.0) -> dict:
    curve = [_pt(1.0, link), _pt(1e12, link)]
    return {"schema": SCHEMA, "device": "synthetic", "gpu": "H100-80GB", "date": "2026-01-01", "git_commit": "x",
            "peak_tflops": 1000.0, "gemm_tflops": [_pt(1.0, RATE)], "fp8_gemm_speedup": _pt(0, 2.0),
            "attention_tflops": [_pt(1024, RATE)], "memory_gbs": _pt(0, BW), "optimizer_ns_per_param": _pt(0, 1e-9),
            "collectives": {op: curve for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")},
            "inter_node": {op: _pt(0, link) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")},
            "host_us_per_layer": {"graphs": _pt(0, host_graphs), "compiled": _pt(0, 1.0), "stock": _pt(0, 1.0)}}


#: nothing but GEMMs and attention
BARE = Constants(ew_factor=0, ew_factor_stock=0, head_factor=0, grad_accum_bytes=0, tp_overlap=0, tp_comm_factor=1,
                 dp_overlap=0, step_ms=0)


def base_cfg(**over):
    return preset("gpt2-medium", **{"model.vocab_size": 51200, "train.global_batch_size": 32, "train.micro_batch_size": 8,
                                    "parallel.device": "cuda", **over})


def predict(cfg, layout, gpus, constants=BARE, profile=None):
    c = apply_layout(cfg, layout, gpus)
    return c, Model(cfg, profile or profile_from_dict(synthetic()), constants).predict(c)


def test_one_gpu_step_is_megatron_flops_over_the_rate():
    cfg = base_cfg()
    c, p = predict(cfg, Layout(1, 1, 1, 1, False, False, "none", 8), 1)
    # (the optimizer's 1e-9 ns per parameter is the only other term)
    assert p.step_s == pytest.approx(derive(c).flops_per_step / (RATE * 1e12), rel=1e-6)
    assert p.mfu == pytest.approx(RATE / 1000.0, rel=1e-6)
    assert p.breakdown["compute"] == pytest.approx(p.step_s) and sum(p.breakdown.values()) == pytest.approx(p.step_s)
    assert set(p.breakdown) == set(REASONS)


def test_flop_split_adds_up_to_derive_and_attention_grows_with_the_sequence():
    cfg = base_cfg()
    fl = flop_split(cfg, 1)
    d = derive(cfg)
    per_token = cfg.model.num_layers * (fl["layer_dense"] + fl["layer_attn"]) + fl["head_dense"] + fl["head_attn"]
    assert per_token * d.tokens_per_step == pytest.approx(d.flops_per_step, rel=1e-12)
    longer = flop_split(cfg.replace(**{"model.seq_length": 512}), 1)
    assert longer["layer_dense"] == pytest.approx(fl["layer_dense"]) and longer["layer_attn"] == pytest.approx(fl["layer_attn"] / 2)


def test_tensor_parallel_halves_the_flops_and_adds_four_all_reduces_per_layer():
    cfg = base_cfg()
    _, one = predict(cfg, Layout(1, 1, 1, 1, False, False, "none", 8), 1)
    c2, two = predict(cfg, Layout(2, 1, 1, 1, False, False, "none", 8), 2)
    m = cfg.model
    act = 2 * m.seq_length * 8 * m.hidden_size  # bf16 [s, b, h]
    ar = 2 * (2 - 1) / 2 * act / (LINK * 1e9)
    micro = derive(c2).num_microbatches
    assert two.breakdown["tp_comm"] == pytest.approx(micro * m.num_layers * 4 * ar, rel=1e-9)
    head_comm = micro * 2 * ar  # the head's input and loss collectives
    assert two.breakdown["compute"] == pytest.approx(one.step_s / 2 + head_comm, rel=1e-6)
    # sequence parallelism: an all-gather + a reduce-scatter per all-reduce, the same bytes on a flat link
    _, sp = predict(cfg, Layout(2, 1, 1, 1, True, False, "none", 8), 2)
    assert sp.breakdown["tp_comm"] == pytest.approx(two.breakdown["tp_comm"], rel=1e-9)


def test_tp_overlap_hides_backward_collectives_under_weight_gradients():
    cfg = base_cfg()
    lay = Layout(2, 1, 1, 1, False, False, "none", 8)
    fast = profile_from_dict(synthetic(link=5000.0))  # backward collectives shorter than the weight-gradient GEMMs
    _, exposed = predict(cfg, lay, 2, profile=fast)
    _, hidden = predict(cfg, lay, 2, dataclasses.replace(BARE, tp_overlap=1.0), profile=fast)
    assert hidden.breakdown["tp_comm"] == pytest.approx(exposed.breakdown["tp_comm"] / 2, rel=1e-9)  # backward fully hidden
    _, off = predict(cfg.replace(**{"parallel.tp_comm_overlap": False}), lay, 2, dataclasses.replace(BARE, tp_overlap=1.0),
                     profile=fast)
    assert off.breakdown["tp_comm"] == pytest.approx(exposed.breakdown["tp_comm"], rel=1e-9)  # the kernel rule's tp_overlap
    # on a slow link only as much hides as the weight-gradient GEMMs last (a third of the layer's GEMM time)
    _, slow = predict(cfg, lay, 2, dataclasses.replace(BARE, tp_overlap=1.0))
    _, slow_exposed = predict(cfg, lay, 2)
    fl = flop_split(cfg, 2)
    wgrad = derive(apply_layout(cfg, lay, 2)).num_microbatches * cfg.model.num_layers * fl["layer_dense"] * cfg.model.seq_length * 8 / 2 / 3 / (RATE * 1e12)
    assert slow_exposed.breakdown["tp_comm"] - slow.breakdown["tp_comm"] == pytest.approx(wgrad, rel=1e-9)


def test_pipeline_bubble_is_the_simulators_and_matches_the_closed_form_for_even_stages():
    cfg = base_cfg(**{"model.vocab_size": 1, "model.make_vocab_size_divisible_by": 1, "parallel.pipeline_split": "even"})
    no_head = dataclasses.replace(BARE)
    fast = profile_from_dict(synthetic(link=1e7))  # p2p latency negligible
    c, p = predict(cfg, Layout(1, 2, 1, 1, False, False, "none", 8), 2, no_head, profile=fast)
    m = derive(c).num_microbatches
    busy = p.breakdown["compute"]
    # the head (vocab 1) is tiny but not zero: the bubble is the simulator's, close to (p-1)/m of the work
    assert p.breakdown["bubble"] == pytest.approx(busy * (2 - 1) / m, rel=0.02)
    assert p.detail["bubble_from"] == "simulator"
    c4, p4 = predict(cfg, Layout(1, 2, 2, 1, False, False, "none", 8), 2, no_head, profile=fast)
    assert p4.breakdown["bubble"] < p.breakdown["bubble"]  # interleaving shrinks it
    assert p4.breakdown["bubble"] == pytest.approx(busy * schedules.closed_form_bubble_fraction("interleaved", 2, m, 2), rel=0.05)


def test_data_parallel_all_reduce_of_fp32_gradients_and_distributed_optimizer():
    cfg = base_cfg(**{"parallel.overlap_grad_reduce": False})
    lay = Layout(1, 1, 1, 2, False, False, "none", 8)
    c = apply_layout(cfg, lay, 2)
    c = c.replace(**{"parallel.overlap_grad_reduce": False})
    p = Model(cfg, profile_from_dict(synthetic()), BARE).predict(c)
    params = derive(c).params_per_stage[0]
    assert p.breakdown["dp_comm"] == pytest.approx(2 * (1 / 2) * 4 * params / (LINK * 1e9), rel=1e-9)
    dopt = c.replace(**{"parallel.distributed_optimizer": True})
    q = Model(cfg, profile_from_dict(synthetic()), BARE).predict(dopt)
    # reduce-scatter of fp32 grads + all-gather of bf16 params: (4 + 2) / 2 bytes per parameter on the wire
    assert q.breakdown["dp_comm"] == pytest.approx((1 / 2) * 6 * params / (LINK * 1e9), rel=1e-9)


def test_full_recompute_costs_one_more_forward():
    cfg = base_cfg()
    _, none = predict(cfg, Layout(1, 1, 1, 1, False, False, "none", 8), 1)
    c, full = predict(cfg, Layout(1, 1, 1, 1, False, False, "full", 8), 1)
    layers = derive(c).num_microbatches * cfg.model.num_layers
    fl = flop_split(cfg, 1)
    per_layer_fwd = (fl["layer_dense"] + fl["layer_attn"]) * cfg.model.seq_length * 8 / 3 / (RATE * 1e12)
    assert full.breakdown["recompute"] == pytest.approx(layers * per_layer_fwd, rel=1e-9)
    assert full.step_s > none.step_s


def test_host_time_shows_only_without_cuda_graphs_and_beyond_device_time():
    cfg = base_cfg()
    prof = synthetic()
    prof["host_us_per_layer"]["compiled"] = _pt(0, 1e6)  # one second per layer: host-bound
    lay = Layout(1, 1, 1, 1, False, False, "none", 8)
    _, graphs = predict(cfg, lay, 1, profile=profile_from_dict(prof))
    _, eager = predict(cfg.replace(**{"train.cuda_graphs": False}), lay, 1, profile=profile_from_dict(prof))
    assert graphs.breakdown["host"] == 0
    layers = 4 * cfg.model.num_layers
    assert eager.step_s == pytest.approx(layers * 1.0, rel=1e-3)  # the host sets the pace


def test_profile_refuses_malformed_files_with_the_field(tmp_path):
    for gpu in ("H100-80GB", "H200-141GB"):
        prof = default_profile(gpu)
        assert prof.constants and prof.gemm_tflops and prof.estimates()
    bad = synthetic()
    bad["collectives"]["all_reduce"][0]["value"] = -1
    f = tmp_path / "p.json"
    f.write_text(json.dumps(bad))
    with pytest.raises(ProfileError) as e:
        load_profile(f)
    assert e.value.field == "collectives.all_reduce[0].value"
    bad = synthetic()
    bad["schema"] = "other"
    f.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="schema"):
        load_profile(f)
    f.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(f)


def test_one_process_replaying_its_whole_step_as_a_graph_spends_no_host_time_per_layer():
    """Per-layer graphs still leave the host launching each layer's replay (its profiled host time per layer); one
    process captures the whole step (kernel_rule's "step"), whose replay is one launch."""
    cfg = base_cfg()
    prof = synthetic()
    prof["host_us_per_layer"]["graphs"] = _pt(0, 1e6)  # one second per graphed layer: host-bound if it counted
    _, one = predict(cfg, Layout(1, 1, 1, 1, False, False, "none", 8), 1, profile=profile_from_dict(prof))
    _, two = predict(cfg, Layout(1, 1, 1, 2, False, False, "none", 8), 2, profile=profile_from_dict(prof))
    assert one.breakdown["host"] == 0
    assert two.breakdown["host"] > 0.5 * cfg.model.num_layers  # two processes: per-layer graphs, the host's pace
