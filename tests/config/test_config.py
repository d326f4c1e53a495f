"""The run-config contract: validation rules, round trips, derived quantities, Accelerate import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.config import (
    PRESETS,
    ConfigError,
    GenerationConfig,
    RunConfig,
    derive,
    load_config,
    pad_vocab_size,
    preset,
)

from tests.support import ACCELERATE_EXAMPLE
from workbench.accelerate_import import from_accelerate

REFERENCE = Path(__file__).resolve().parents[3] / "shared" / "reference" / "accelerate-megatron-lm-guide.md"


def base() -> RunConfig:
    """A valid multi-GPU-shaped config to break one rule at a time."""
    cfg = preset("gpt2-small")
    cfg.parallel.nproc_per_node = 8
    cfg.parallel.tensor_parallel = 2
    cfg.parallel.pipeline_parallel = 2
    cfg.train.micro_batch_size = 2
    cfg.train.global_batch_size = 16
    assert cfg.validate() == [], cfg.validate()
    return cfg


def fields_of(cfg: RunConfig) -> set[str]:
    return {p.field for p in cfg.validate()}


# (dotted override that breaks a rule, field that must be reported, override that fixes it)
RULES = [
    ({"parallel.tensor_parallel": 5, "parallel.nproc_per_node": 10}, "parallel.tensor_parallel", {"parallel.tensor_parallel": 4, "parallel.nproc_per_node": 8, "parallel.pipeline_parallel": 1}),
    ({"model.attention_type": "grouped", "model.num_query_groups": 1}, "model.num_query_groups", {"model.attention_type": "grouped", "model.num_query_groups": 2}),
    ({"model.attention_type": "grouped", "model.num_query_groups": 5}, "model.num_query_groups", {"model.attention_type": "grouped", "model.num_query_groups": 4}),
    ({"model.num_layers": 11, "parallel.pipeline_split": "even"}, "parallel.pipeline_parallel", {"model.num_layers": 10}),
    ({"model.num_layers": 1}, "parallel.pipeline_parallel", {"model.num_layers": 2}),
    ({"parallel.virtual_pipeline_parallel": 4}, "parallel.virtual_pipeline_parallel", {"parallel.virtual_pipeline_parallel": 3}),
    ({"parallel.sequence_parallel": True, "parallel.tensor_parallel": 1, "parallel.nproc_per_node": 4}, "parallel.sequence_parallel", {"parallel.sequence_parallel": True}),
    ({"parallel.nproc_per_node": 6}, "parallel.nproc_per_node", {"parallel.nproc_per_node": 4, "train.global_batch_size": 2}),
    ({"train.global_batch_size": 10}, "train.global_batch_size", {"train.global_batch_size": 12}),
    ({"model.seq_length": 2048}, "model.seq_length", {"model.seq_length": 2048, "model.max_position_embeddings": 2048}),
    ({"train.loss_scale": 1024.0}, "train.loss_scale", {"train.loss_scale": 1024.0, "train.precision": "fp16"}),
    ({"model.hidden_size": 770}, "model.hidden_size", {"model.hidden_size": 780}),
    ({"train.min_lr": 1.0}, "train.min_lr", {"train.min_lr": 0.0}),
    ({"data.split": "90,10"}, "data.split", {"data.split": "90,9,1"}),
    ({"data.source": "indexed"}, "data.datasets", {"data.source": "indexed", "data.datasets": [{"prefix": "/d/x_text_document", "weight": 1.0}]}),
    ({"model.position_embedding": "alibi", "model.attention_backend": "local"}, "model.attention_backend", {"model.position_embedding": "alibi", "model.attention_backend": "sdpa"}),
    ({"checkpoint.finetune": True}, "checkpoint.finetune", {"checkpoint.finetune": True, "checkpoint.load_dir": "/ckpt"}),
    ({"parallel.overlap_param_gather": True}, "parallel.overlap_param_gather", {"parallel.overlap_param_gather": True, "parallel.distributed_optimizer": True}),
    ({"train.micro_batch_size": 0}, "train.micro_batch_size", {"train.micro_batch_size": 1}),
    ({"train.lr_warmup_iters": 1000}, "train.lr_warmup_iters", {"train.lr_warmup_iters": 999}),
]


@pytest.mark.parametrize("bad, field, good", RULES, ids=[r[1] + "-" + "-".join(r[0]) for r in RULES])
def test_each_rule_fails_and_passes(bad, field, good):
    broken = base().replace(**bad)
    problems = broken.validate()
    assert field in {p.field for p in problems}, problems
    for p in problems:
        assert p.rule and p.fix, p
    fixed = base().replace(**good)
    assert fixed.validate() == [], fixed.validate()


def test_interleaving_needs_microbatches_divisible_by_pp():
    cfg = base().replace(**{"parallel.virtual_pipeline_parallel": 2, "train.global_batch_size": 6})  # dp=2, mbs=2 -> 3 micro-batches
    assert "train.global_batch_size" in fields_of(cfg)
    ok = base().replace(**{"parallel.virtual_pipeline_parallel": 2, "train.global_batch_size": 8})  # 2 micro-batches
    assert ok.validate() == []


def test_query_groups_must_divide_by_tp():
    cfg = base().replace(**{"model.attention_type": "multiquery"})  # 1 KV head, tp=2
    assert "model.num_query_groups" in fields_of(cfg)
    assert base().replace(**{"model.attention_type": "multiquery", "parallel.tensor_parallel": 1, "parallel.nproc_per_node": 4}).validate() == []


def test_every_problem_is_reported_at_once():
    cfg = base().replace(**{"model.num_layers": 11, "parallel.pipeline_split": "even", "train.global_batch_size": 10, "data.split": "x", "train.lr": -1.0})
    found = fields_of(cfg)
    assert {"parallel.pipeline_parallel", "train.global_batch_size", "data.split", "train.lr"} <= found
    with pytest.raises(ConfigError) as e:
        cfg.check()
    msg = str(e.value)
    assert "4 problems" in msg or f"{len(cfg.validate())} problems" in msg
    assert "pipeline_parallel" in msg and "->" in msg


def test_unknown_keys_are_errors_with_suggestions():
    d = preset("tiny").to_dict()
    d["train"]["micro_batch_sise"] = 4
    d["modle"] = {}
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(d)
    fields = {p.field for p in e.value.problems}
    assert fields == {"train.micro_batch_sise", "modle"}
    assert "micro_batch_size" in str(e.value) and "model" in str(e.value)


def test_wrong_types_and_literals_are_errors():
    d = preset("tiny").to_dict()
    d["parallel"]["tensor_parallel"] = "two"
    d["train"]["precision"] = "bf32"
    d["parallel"]["sequence_parallel"] = "yes"
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(d)
    fields = {p.field for p in e.value.problems}
    assert fields == {"parallel.tensor_parallel", "train.precision", "parallel.sequence_parallel"}
    assert "'bf16'" in str(e.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip(name, tmp_path):
    cfg = preset(name)
    assert cfg.validate() == [], (name, cfg.validate())
    for suffix in (".json", ".yaml"):
        path = cfg.save(tmp_path / f"c{suffix}")
        again = load_config(path)
        assert again == cfg
        assert again.to_dict() == cfg.to_dict()


def test_yaml_scientific_notation_is_read_as_float(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 3e-4\n  min_lr: 1e-5\n")
    cfg = load_config(p)
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)


def test_bad_files_are_clear(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="broken.json"):
        load_config(p)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


def test_vocab_padding_follows_megatron():
    assert pad_vocab_size(50257, 128, 1) == 50304
    assert pad_vocab_size(50257, 128, 2) == 50432  # multiple of 256
    assert pad_vocab_size(50304, 128, 1) == 50304
    cfg = preset("gpt2-small").replace(**{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "train.global_batch_size": 8})
    assert derive(cfg).padded_vocab_size % 256 == 0


def test_gpt2_parameter_counts_match_the_known_sizes():
    # GPT-2 small has 124,439,808 parameters with vocab 50257; Megatron pads to 50304 (+47*768).
    small = derive(preset("gpt2-small")).params.total
    assert small == 124_439_808 + (50304 - 50257) * 768
    medium = derive(preset("gpt2-medium")).params.total
    assert medium == 354_823_168 + (50304 - 50257) * 1024


def test_megatron_flops_formula_by_hand():
    cfg = preset("gpt2-medium")
    s, L, h, V, B = 1024, 24, 1024, 50304, cfg.train.global_batch_size
    # attention (1 + g/a + s/h) = 3, MLP f/h = 4, logits V/(2Lh)
    expected = 12 * B * s * L * h * h * (3 + 4 + V / (2 * L * h))
    assert derive(cfg).flops_per_step == pytest.approx(expected)


def test_derived_layout():
    cfg = base()
    d = derive(cfg)
    assert (d.world_size, d.data_parallel, d.num_microbatches) == (8, 2, 4)
    assert d.tokens_per_step == 16 * 1024
    assert sum(d.stage_layers) == 12 and len(d.params_per_stage) == 2
    even = derive(cfg.replace(**{"parallel.pipeline_split": "even"}))
    assert even.stage_layers == (6, 6)
    # the last stage of a tied model keeps its own copy of the word embeddings when pp > 1
    assert even.params_per_stage[0] - even.params_per_stage[1] == even.params.embedding - even.padded_vocab_size * 768 - even.params.final_norm
    # a layer moved between stages moves its parameters with it
    moved = d.stage_layers[0] - 6
    assert d.params_per_stage[0] - even.params_per_stage[0] == moved * d.params.per_layer
    assert even.params_per_stage[1] - d.params_per_stage[1] == moved * d.params.per_layer


def _stage_flops(cfg, split):
    """Per-stage FLOPs from megatron's formula: the layers' share, plus the output layer on the last stage."""
    L = cfg.model.num_layers
    total, head_only = derive(cfg).flops_per_step, derive(cfg.replace(**{"model.num_layers": 1})).flops_per_step
    one_layer_and_head = head_only
    per_layer = (total - one_layer_and_head) / (L - 1)
    head = one_layer_and_head - per_layer
    return [n * per_layer + (head if r == len(split) - 1 else 0) for r, n in enumerate(split)]


@pytest.mark.parametrize("name,pp", [("gpt2-small", 2), ("gpt2-medium", 2), ("gpt2-medium", 3), ("gpt2-large", 4), ("llama-small", 2)])
def test_balanced_pipeline_split_evens_out_the_stages(name, pp):
    cfg = preset(name, **{"parallel.pipeline_parallel": pp, "parallel.nproc_per_node": pp})
    split = derive(cfg).stage_layers
    assert sum(split) == cfg.model.num_layers and min(split) >= 1
    assert len(set(split[1:-1])) <= 1  # megatron splits the middle stages evenly
    # the output layer costs layers' worth of FLOPs: the last stage holds fewer layers
    assert split[-1] < split[0]
    slowest = max(_stage_flops(cfg, split))
    # moving one layer onto or off the last stage (from / to the first) makes the slowest stage slower
    for d in (-1, 1):
        other = (split[0] + d, *split[1:-1], split[-1] - d)
        if min(other) >= 1:
            assert max(_stage_flops(cfg, other)) >= slowest
    assert slowest < max(_stage_flops(cfg, derive(cfg.replace(**{"parallel.pipeline_split": "even"})).stage_layers))
    assert cfg.validate() == []


def test_balanced_split_allows_indivisible_layer_counts_and_interleaving_stays_even():
    cfg = preset("gpt2-medium", **{"parallel.pipeline_parallel": 5, "parallel.nproc_per_node": 5})  # 24 layers on 5 stages
    assert cfg.validate() == [] and sum(derive(cfg).stage_layers) == 24
    problems = cfg.replace(**{"parallel.pipeline_split": "even"}).validate()
    assert [p.field for p in problems] == ["parallel.pipeline_parallel"] and "pipeline_split: balanced" in problems[0].fix
    vpp = preset("gpt2-medium", **{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2, "parallel.virtual_pipeline_parallel": 2,
                                   "train.global_batch_size": 16})
    assert derive(vpp).stage_layers == (12, 12)


def test_llama_preset_shape():
    cfg = preset("llama-small")
    m = cfg.model
    assert (m.normalization, m.activation, m.position_embedding, m.query_groups, m.tie_embeddings) == ("rmsnorm", "swiglu", "rope", 4, False)
    assert m.ffn_size % 64 == 0 and m.ffn_size > 2 * m.hidden_size


def test_unknown_preset():
    with pytest.raises(ConfigError, match="gpt2-small"):
        preset("gpt2-smal")


def test_generation_rules():
    assert GenerationConfig().validate() == []
    cases = [
        (dict(top_k=5, top_p=0.9), "generation.top_k"),
        (dict(temperature=0.0), "generation.temperature"),
        (dict(num_beams=4, top_k=5), "generation.num_beams"),
        (dict(top_p_decay=0.5), "generation.top_p_decay"),
        (dict(max_new_tokens=0), "generation.max_new_tokens"),
    ]
    for kwargs, field in cases:
        assert field in {p.field for p in GenerationConfig(**kwargs).validate()}, kwargs
    assert GenerationConfig(num_beams=4, length_penalty=1.5).validate() == []
    assert GenerationConfig(top_p=0.8, top_p_decay=0.5, top_p_bound=0.1).validate() == []


def test_accelerate_example_from_the_reference_guide(tmp_path):
    text = ACCELERATE_EXAMPLE
    if REFERENCE.exists():  # take the YAML straight from the guide when it is beside the checkout
        guide = REFERENCE.read_text()
        start = guide.index("compute_environment: LOCAL_MACHINE")
        text = guide[start: guide.index("```", start)]
    src = tmp_path / "megatron_gpt_config.yaml"
    src.write_text(text)
    cfg = from_accelerate(src)
    p, t = cfg.parallel, cfg.train
    assert (p.tensor_parallel, p.pipeline_parallel, p.world_size) == (2, 2, 4)
    assert derive(cfg).num_microbatches == 2
    assert p.sequence_parallel and p.distributed_optimizer and p.recompute == "selective"
    assert t.clip_grad == 1.0 and t.precision == "bf16"
    assert cfg.validate() == []


def test_accelerate_without_megatron_section(tmp_path):
    src = tmp_path / "a.yaml"
    src.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    with pytest.raises(ConfigError, match="megatron_lm_config"):
        from_accelerate(src)


def test_config_is_json_serialisable_and_stable():
    cfg = preset("llama-small")
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


@pytest.mark.parametrize("key", ["tp_collectives_in_graph", "tp_overlap_batch_halves"])
def test_retired_keys_of_older_configs_load_with_a_warning(key):
    d = preset("gpt2-small").to_dict()
    d["train"][key] = True  # written by configs saved before it was retired
    with pytest.warns(UserWarning, match=f"train.{key} is ignored"):
        cfg = RunConfig.from_dict(d)
    assert cfg.to_dict() == preset("gpt2-small").to_dict()
    del d["train"][key]
    d["train"][key[:4] + key[5:]] = True  # a typo is still an error
    with pytest.raises(ConfigError, match=key[:4] + key[5:]):
        RunConfig.from_dict(d)
