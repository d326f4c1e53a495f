"""Mixture-of-experts config: the ``model.moe`` section and ``parallel.expert_parallel`` rules (megatron 0.19's
divisibility and layout rules), each refused with its field and a fix; presets; what megatron is handed; the
kernel rule's expert implementation."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench import kernel_rule
from workbench.cli import main
from workbench.config import ConfigError, RunConfig, preset
from workbench.families.common import moe

MOE_PRESETS = ["moe-tiny", "moe-research", "mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b"]


def _tiny(**over):
    return preset("moe-tiny", **over)


def _fields(cfg):
    return {p.field: p for p in cfg.validate()}


# (overrides that break one rule, the field named, the overrides that fix it)
CASES = [
    ({"model.moe.top_k": 9}, "model.moe.top_k", {"model.moe.top_k": 8}),
    ({"model.moe.top_k": 1}, "model.moe.router_pre_softmax", {"model.moe.top_k": 1, "model.moe.router_pre_softmax": True}),
    ({"parallel.expert_parallel": 3, "parallel.nproc_per_node": 3, "train.global_batch_size": 6}, "parallel.expert_parallel",
     {"parallel.expert_parallel": 4, "parallel.nproc_per_node": 4, "train.global_batch_size": 8}),
    # experts divide, but the expert grid ETP x EP x PP = 1 x 4 x 1 does not divide world 2
    ({"parallel.expert_parallel": 4, "parallel.nproc_per_node": 2}, "parallel.expert_parallel",
     {"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2}),
    # ETP defaults to TP: 2 x 2 x 1 does not divide 2; ETP 1 makes it 1 x 2 x 1
    ({"parallel.expert_parallel": 2, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2},
     "parallel.expert_parallel",
     {"parallel.expert_parallel": 2, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2,
      "parallel.expert_tensor_parallel": 1}),
    ({"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2}, "parallel.sequence_parallel",
     {"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True}),
    ({"model.add_bias_linear": True}, "model.add_bias_linear", {"model.add_bias_linear": False}),
    ({"model.moe.ffn_hidden_size": 63, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2},
     "model.moe.ffn_hidden_size",
     {"model.moe.ffn_hidden_size": 62, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2}),
    ({"model.moe.shared_experts": 1, "model.moe.shared_expert_ffn_hidden_size": 33, "parallel.tensor_parallel": 2,
      "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2, "parallel.expert_tensor_parallel": 1},
     "model.moe.shared_expert_ffn_hidden_size",
     {"model.moe.shared_experts": 1, "model.moe.shared_expert_ffn_hidden_size": 32, "parallel.tensor_parallel": 2,
      "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2, "parallel.expert_tensor_parallel": 1}),
    ({"model.moe.shared_expert_gate": True}, "model.moe.shared_expert_gate", {"model.moe.shared_expert_gate": True, "model.moe.shared_experts": 1}),
    ({"model.moe.pad_to_capacity": True}, "model.moe.pad_to_capacity", {"model.moe.pad_to_capacity": True, "model.moe.capacity_factor": 1.25}),
    ({"parallel.recompute": "selective"}, "parallel.recompute", {"parallel.recompute": "full"}),
    ({"model.moe.num_experts": 0, "parallel.expert_parallel": 2, "parallel.nproc_per_node": 2}, "parallel.expert_parallel",
     {"model.moe.num_experts": 0, "parallel.nproc_per_node": 2}),
    ({"model.moe.capacity_factor": 0.0}, "model.moe.capacity_factor", {"model.moe.capacity_factor": 0.5}),
    ({"model.moe.num_experts": -1}, "model.moe.num_experts", {"model.moe.num_experts": 4}),
]


@pytest.mark.parametrize("bad, field, good", CASES)
def test_each_moe_rule_fails_with_its_field_and_passes_when_fixed(bad, field, good):
    problems = _fields(_tiny(**bad))
    assert field in problems, problems
    assert problems[field].fix
    assert _tiny(**good).validate() == []


def test_moe_on_a_family_without_experts_is_refused():
    cfg = preset("bert-tiny" if "bert-tiny" in __import__("workbench.config").config.PRESETS else "tiny")
    cfg = cfg.replace(**{"model.arch": "bert", "model.moe.num_experts": 4})
    problems = _fields(cfg)
    assert "model.moe.num_experts" in problems and "no mixture-of-experts" in problems["model.moe.num_experts"].rule


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_validate_and_round_trip(name, tmp_path):
    cfg = preset(name)
    assert cfg.validate() == [], name
    path = cfg.save(tmp_path / f"{name}.yaml")
    again = RunConfig.load(path)
    assert again.model.moe == cfg.model.moe and again.model.moe.num_experts > 0


def test_expert_data_parallel_is_megatrons_grid():
    cfg = _tiny(**{"parallel.nproc_per_node": 8, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True,
                   "parallel.expert_parallel": 4, "parallel.expert_tensor_parallel": 1, "train.global_batch_size": 8})
    assert cfg.validate() == []
    assert moe.expert_data_parallel(cfg) == 8 // (1 * 4 * 1)
    assert cfg.derived().data_parallel == 8 // 2  # the dense grid is unchanged


def test_megatron_fields_follow_the_config():
    cfg = _tiny(**{"model.moe.shared_experts": 2, "model.moe.shared_expert_ffn_hidden_size": 32, "model.moe.layer_freq": 2,
                   "model.moe.load_balancing": "none", "model.moe.capacity_factor": 1.5})
    f = moe.transformer_fields(cfg, grouped_te=False)
    assert f["num_moe_experts"] == 8 and f["moe_router_topk"] == 2 and f["moe_ffn_hidden_size"] == 64
    assert f["moe_shared_expert_intermediate_size"] == 64 and f["moe_layer_freq"] == 2
    assert f["moe_aux_loss_coeff"] == 0.0 and f["moe_expert_capacity_factor"] == 1.5 and f["moe_router_dtype"] == "fp32"
    assert moe.transformer_fields(preset("tiny"), grouped_te=False) == {}
    assert moe.moe_layers(cfg) == [True, False]


def test_the_kernel_rule_names_the_experts():
    assert kernel_rule.choose(preset("tiny")).experts == ""
    cpu = _tiny()
    assert kernel_rule.choose(cpu).experts == "sequential" and kernel_rule.choose(cpu).layer == "stock"
    gpu = preset("moe-research")
    assert kernel_rule.choose(gpu, te=False).experts == "torch_grouped"
    assert kernel_rule.choose(gpu.replace(**{"model.attention_backend": "te"}), te=True).experts == "te_grouped"
    assert kernel_rule.choose(gpu.replace(**{"model.moe.grouped_gemm": False}), te=False).experts == "sequential"
    # the compiled layer: its attention half in the MoE layers (their MLP half megatron's), at TP = 1 only
    assert kernel_rule.choose(gpu, te=False).layer == "compiled"
    tp2 = gpu.replace(**{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    assert kernel_rule.choose(tp2, te=False).layer_reason.startswith("mixture of experts at TP > 1")
    # under FP8 the experts' GEMMs (most of the FLOPs) run FP8 on TE's / megatron's layer: the compiled one would not
    fp8 = gpu.replace(**{"train.fp8": "tensorwise"})
    assert kernel_rule.choose(fp8, te=False).layer_reason.startswith("mixture of experts with FP8")
    assert kernel_rule.choose(fp8, te=True).attention == "te"
    kernel_rule.allow_fast_paths_on_cpu(True)
    try:
        assert kernel_rule.choose(cpu).experts == "sequential"  # train.compile_kernels off
        assert kernel_rule.choose(_tiny(**{"train.compile_kernels": True})).experts == "torch_grouped"
    finally:
        kernel_rule.allow_fast_paths_on_cpu(False)


def test_the_kernel_rule_names_who_permutes_the_tokens():
    gpu = preset("moe-research")

    def dispatch(**over):
        return kernel_rule.choose(gpu.replace(**over), te=False).moe_dispatch

    assert kernel_rule.choose(preset("tiny")).moe_dispatch == ""
    assert dispatch() == "workbench"
    assert dispatch(**{"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2}) == "workbench"
    assert dispatch(**{"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.nproc_per_node": 2}) == "megatron"
    assert dispatch(**{"model.moe.capacity_factor": 1.25}) == "megatron"
    assert dispatch(**{"model.moe.grouped_gemm": False}) == "megatron"
    assert dispatch(**{"model.moe.token_dispatcher": "allgather"}) == "megatron"  # asked for by name
    assert "workbench's token dispatch" in kernel_rule.choose(gpu, te=False).describe()


def test_cli_refuses_a_bad_moe_config_with_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    d = _tiny().to_dict()
    d["parallel"].update(expert_parallel=3, nproc_per_node=3)
    bad.write_text(json.dumps(d))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "config", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "parallel.expert_parallel" in r.stderr and "not divisible by expert_parallel 3" in r.stderr


def test_unknown_moe_key_is_named():
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict({"model": {"moe": {"num_expert": 4}}})
    assert "model.moe.num_expert" in str(e.value)


def test_an_moe_step_is_graphed_whole_only_where_nothing_reads_the_routing_on_the_host():
    gpu = preset("moe-research")
    shipped = kernel_rule.choose(gpu, te=False)
    # one process, the workbench's router and token dispatch: the whole step as one graph (never layer by layer)
    assert (shipped.cuda_graphs, shipped.cuda_graphs_impl, shipped.cuda_graphs_reason) == (True, "step", "")
    assert (shipped.moe_router, shipped.moe_dispatch) == ("workbench", "workbench")
    refused = {
        "expert parallel": {"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2},
        "megatron's router": {"model.moe.load_balancing": "seq_aux_loss"},
        "megatron's dispatcher": {"model.moe.capacity_factor": 1.5},
        "fp16's loss scale": {"train.precision": "fp16"},
        "TE's layer": {"model.attention_backend": "te"},
    }
    for why, over in refused.items():
        k = kernel_rule.choose(gpu.replace(**over), te=True)
        assert not k.cuda_graphs and k.cuda_graphs_impl == "", why
        assert k.cuda_graphs_reason.startswith(kernel_rule.MOE_GRAPHS_BLOCKER), (why, k.cuda_graphs_reason)
    assert "megatron's router or token dispatch" in kernel_rule.moe_graphs_blocker(
        gpu.replace(**refused["megatron's router"]))
    assert kernel_rule.moe_graphs_blocker(gpu) is None
