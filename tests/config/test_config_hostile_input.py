"""Hostile and malformed run configs: each is refused with the field (or the file) and the fix.

Non-finite numbers, empty files, duplicate keys, YAML alias bombs, sizes beyond any real model, wrong
types; and a rule whose premise is an invalid field is not reported (only the root problem is).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import tracemalloc
from typing import get_args, get_type_hints

import pytest
import yaml

from workbench.config import ConfigError, GenerationConfig, RunConfig, load_config, preset


def _refused(path) -> list:
    """The problems of a config file: reading it (the file, types) and validating what was read."""
    try:
        problems = load_config(path).validate()
    except ConfigError as e:
        problems = e.problems
    assert problems, f"{path} was accepted"
    for p in problems:
        assert p.rule and p.fix, p
    return problems


def _float_fields() -> list[str]:
    """Every float-typed field of a run config (dotted; a dataset entry's as data.datasets[0].x)."""
    out = []
    for section, cls in get_type_hints(RunConfig).items():
        if not dataclasses.is_dataclass(cls):
            continue
        for name, tp in get_type_hints(cls).items():
            if tp is float or float in get_args(tp):
                out.append(f"{section}.{name}")
    return out + ["data.datasets[0].weight"]


def _with(d: dict, path: str, value) -> dict:
    if path.startswith("data.datasets[0]."):
        d["data"]["source"] = "indexed"
        d["data"]["datasets"] = [{"prefix": "/nowhere/x_text_document", "weight": 1.0}]
        d["data"]["datasets"][0][path.rsplit(".", 1)[1]] = value
    else:
        section, name = path.split(".")
        d[section][name] = value
    return d


# --------------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize("path", _float_fields())
def test_a_non_finite_number_is_refused_in_every_float_field(path, tmp_path):
    for value, fmt in ((math.nan, "yaml"), (math.inf, "json"), (-math.inf, "yaml")):
        d = _with(preset("tiny").to_dict(), path, value)
        f = tmp_path / f"c.{fmt}"
        f.write_text(yaml.safe_dump(d) if fmt == "yaml" else json.dumps(d))  # .nan / .inf, NaN / Infinity
        problems = _refused(f)
        assert [p.field for p in problems] == [path], (value, fmt, problems)
        assert "finite" in problems[0].rule
    # a config built in Python is validated the same (Run.launch and the config form call validate)
    cfg = RunConfig.from_dict(_with(preset("tiny").to_dict(), path, 1.0))
    section, _, rest = path.partition(".")
    target = getattr(cfg, section) if "[" not in rest else cfg.data.datasets[0]
    setattr(target, rest.rsplit(".", 1)[-1], math.nan)
    assert path in [p.field for p in cfg.validate()]


def test_a_non_finite_number_as_text_is_refused(tmp_path):
    for text in ("'nan'", "'1e999'", "'-inf'"):
        f = tmp_path / "c.yaml"
        f.write_text(f"train: {{lr: {text}}}\n")
        assert [p.field for p in _refused(f)] == ["train.lr"], text


def test_decoding_options_refuse_non_finite_numbers():
    assert [p.field for p in GenerationConfig(temperature=math.nan).validate()] == ["generation.temperature"]
    assert [p.field for p in GenerationConfig(top_p=math.inf).validate()] == ["generation.top_p"]


# --------------------------------------------------------------------------- empty files, duplicate keys


@pytest.mark.parametrize("name, text", [("empty.yaml", ""), ("comments.yaml", "# nothing here\n\n"),
                                        ("blank.json", "  \n"), ("null.json", "null"), ("null.yaml", "~\n")])
def test_an_empty_file_is_refused_naming_it(name, text, tmp_path):
    f = tmp_path / name
    f.write_text(text)
    problems = _refused(f)
    assert [p.field for p in problems] == [str(f)] and "no config" in problems[0].rule, problems


def test_an_empty_mapping_is_the_defaults():  # written on purpose: not an empty file
    assert RunConfig.from_yaml("{}") == RunConfig()


@pytest.mark.parametrize("text, key, line", [
    ("name: a\nname: b\n", "name", 2),
    ("model:\n  num_layers: 2\n  hidden_size: 64\n  num_layers: 3\n", "num_layers", 4),
    ("train: {lr: 0.1, lr: 0.2}\n", "lr", 1),
    ("model: {num_layers: 2}\nparallel: {device: cpu}\nmodel: {hidden_size: 64}\n", "model", 3),
])
def test_a_duplicate_yaml_key_is_refused_with_its_line(text, key, line, tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text(text)
    (p,) = _refused(f)
    assert p.field == str(f) and f"duplicate key '{key}' at line {line}" in p.rule, p


def test_a_duplicate_json_key_is_refused_with_its_path(tmp_path):
    f = tmp_path / "dup.json"
    f.write_text('{"name": "x", "model": {"num_layers": 2, "hidden_size": 64, "num_layers": 30}}')
    (p,) = _refused(f)
    assert p.field == str(f) and "duplicate key 'model.num_layers'" in p.rule, p
    f.write_text('{"name": "a", "name": "b"}')
    assert "duplicate key 'name'" in _refused(f)[0].rule


# --------------------------------------------------------------------------- YAML aliases


def _alias_bomb(levels: int = 7) -> str:
    lines = ["train:", "  hook_kwargs:", '    l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"    l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(_alias_bomb())  # ~480 bytes; expanded: 9**7 strings, a ~30 MB config.json
    assert f.stat().st_size < 600
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        (p,) = _refused(f)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert p.field == str(f) and "aliases expand to more than" in p.rule, p
    assert peak < 20 * 2**20 and time.perf_counter() - t0 < 10, (peak, time.perf_counter() - t0)
    with pytest.raises(ConfigError):
        RunConfig.from_yaml(_alias_bomb())


def test_a_recursive_alias_is_refused(tmp_path):
    f = tmp_path / "loop.yaml"
    f.write_text("train:\n  hook_kwargs: &a {inner: *a}\n")
    (p,) = _refused(f)
    assert "recursive" in p.rule, p


def test_a_small_alias_is_still_read(tmp_path):
    f = tmp_path / "alias.yaml"
    f.write_text("name: aliased\ntrain: {lr: &peak 0.002, min_lr: *peak}\n")
    cfg = load_config(f)
    assert cfg.train.lr == cfg.train.min_lr == 0.002


def test_hook_kwargs_built_in_python_are_bounded_without_expanding_them():
    x: list = ["lol"] * 9
    for _ in range(7):
        x = [x] * 9  # shared lists: 9**8 strings once expanded
    d = preset("tiny").to_dict()
    d["train"]["hook_kwargs"] = {"bomb": x}
    cfg = RunConfig.from_dict(d)
    problems = cfg.validate()
    assert [p.field for p in problems] == ["train.hook_kwargs"] and "values" in problems[0].rule, problems
    loop: dict = {}
    loop["self"] = loop
    d["train"]["hook_kwargs"] = loop
    assert [p.field for p in RunConfig.from_dict(d).validate()] == ["train.hook_kwargs"]
    d["train"]["hook_kwargs"] = {"alpha": math.nan}
    assert [p.field for p in RunConfig.from_dict(d).validate()] == ["train.hook_kwargs.alpha"]


# --------------------------------------------------------------------------- sizes beyond any real model


def test_num_layers_1e9_is_refused_with_the_bound(tmp_path):
    f = tmp_path / "deep.json"
    d = preset("tiny").to_dict()
    d["model"]["num_layers"] = 1e9  # JSON writes 1000000000.0: a whole number, read as an int
    f.write_text(json.dumps(d))
    (p,) = _refused(f)
    assert p.field == "model.num_layers" and "at most 1024" in p.rule and "layers" in p.rule, p


@pytest.mark.parametrize("overrides, field", [
    ({"model.num_layers": 10**9, "parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2}, "model.num_layers"),
    ({"model.seq_length": 10**11, "model.max_position_embeddings": 10**11}, "model.seq_length"),
    ({"model.vocab_size": 10**10}, "model.vocab_size"),
    ({"train.global_batch_size": 10**12}, "train.global_batch_size"),
    ({"parallel.nproc_per_node": 10**6}, "parallel.nproc_per_node"),
    ({"parallel.recompute_num_layers": 10**14}, "parallel.recompute_num_layers"),
])
def test_absurd_sizes_are_refused_at_once_naming_the_bound(overrides, field):
    d = preset("tiny").to_dict()
    for k, v in overrides.items():
        section, name = k.split(".")
        d[section][name] = v
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(d).check()
    assert time.perf_counter() - t0 < 5
    assert field in [p.field for p in e.value.problems]
    p = next(p for p in e.value.problems if p.field == field)
    assert "beyond any real model" in p.rule and "at most" in p.rule, p


def test_heads_beyond_any_model_with_a_tp_that_does_not_divide_them_are_refused_at_once():
    d = preset("tiny").to_dict()
    d["model"].update(num_attention_heads=10**12, hidden_size=10**12)
    d["parallel"].update(tensor_parallel=3, nproc_per_node=3)
    t0 = time.perf_counter()
    fields = [p.field for p in RunConfig.from_dict(d).validate()]
    assert time.perf_counter() - t0 < 5
    assert fields == ["model.hidden_size", "model.num_attention_heads"], fields


def _llama_405b(tp: int, pp: int) -> RunConfig:
    return preset("gpt2-small").replace(**{
        "model.num_layers": 126, "model.hidden_size": 16384, "model.num_attention_heads": 128,
        "model.attention_type": "grouped", "model.num_query_groups": 8, "model.ffn_hidden_size": 53248,
        "model.vocab_size": 128256, "model.activation": "swiglu", "model.normalization": "rmsnorm",
        "model.position_embedding": "rope", "model.add_bias_linear": False, "model.tie_embeddings": False,
        "model.seq_length": 8192, "model.max_position_embeddings": 131072,
        "parallel.tensor_parallel": tp, "parallel.pipeline_parallel": pp, "parallel.nproc_per_node": min(tp * pp, 8),
        "parallel.nnodes": max(tp * pp // 8, 1), "train.micro_batch_size": 1, "train.global_batch_size": 16,
    })


def test_a_model_whose_weights_fit_no_accelerator_is_refused_and_a_large_real_one_is_not():
    cfg = _llama_405b(8, 9)  # the largest open dense model, laid out as it is trained: valid
    assert cfg.validate() == [], cfg.validate()
    alone = _llama_405b(1, 1)  # ~406B parameters on one rank: ~812 GB of bf16 weights
    problems = alone.validate()
    assert [p.field for p in problems] == ["model"], problems
    assert "288 GB" in problems[0].rule and "tensor_parallel" in problems[0].fix


# --------------------------------------------------------------------------- wrong types and ranges


PRESET_T5 = "t5-tiny"
HOSTILE = [  # (file text, the one field reported); each was accepted, or reported against the file, before
    ("data: {source: indexed, datasets: [{}]}", "data.datasets[0].prefix"),
    ("data: {source: indexed, datasets: [abc]}", "data.datasets[0]"),
    ("train: {hook_kwargs: 5}", "train.hook_kwargs"),
    ("train: {lr: " + "1" * 400 + "}", "train.lr"),
    ("train: {seed: -1}", "train.seed"),
    ("train: {seed: 100000000000000000000000}", "train.seed"),
    ("train: {lr_decay_iters: -5}", "train.lr_decay_iters"),
    ("train: {loss_scale: -1, precision: fp16}\nparallel: {device: cuda}", "train.loss_scale"),
    ("model: {norm_epsilon: -1}", "model.norm_epsilon"),
    ("model: {init_method_std: -1}", "model.init_method_std"),
    ("model: {rotary_base: -5, position_embedding: rope}", "model.rotary_base"),
    ("model: {ffn_hidden_size: -5}", "model.ffn_hidden_size"),
    ("model: {kv_channels: 0}", "model.kv_channels"),
    ("model: {attention_type: grouped, num_query_groups: -2}", "model.num_query_groups"),
    ("model: {num_tokentypes: -1}", "model.num_tokentypes"),
    ("data: {num_workers: -1}", "data.num_workers"),
    ("data: {split: 'nan,1,1'}", "data.split"),
    ("data: {split: '1e308,1e308,1e308'}", "data.split"),
    ("data: {source: indexed, datasets: [{prefix: /x, weight: .nan}]}", "data.datasets[0].weight"),
    ("name: \"two\\nlines\"", "name"),
]


@pytest.mark.parametrize("text, field", HOSTILE, ids=[h[1] + f"-{i}" for i, h in enumerate(HOSTILE)])
def test_hostile_values_name_their_field(text, field, tmp_path):
    f = tmp_path / "c.yaml"
    base = yaml.safe_load(preset("tiny").to_yaml())
    base.update({k: {**base.get(k, {}), **v} if isinstance(v, dict) else v for k, v in yaml.safe_load(text).items()})
    f.write_text(yaml.safe_dump(base) if "1" * 400 not in text else text)
    problems = _refused(f)
    assert [p.field for p in problems] == [field], problems


def test_a_dataset_entry_without_a_prefix_is_a_problem_not_a_type_error():
    d = preset("tiny").to_dict()
    d["data"].update(source="indexed", datasets=[{"weight": 2.0}])
    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict(d)
    assert [p.field for p in e.value.problems] == ["data.datasets[0].prefix"]


@pytest.mark.parametrize("make, words", [
    (lambda p: p.mkdir(), "not a file"),
    (lambda p: p.write_text("train: {seed: " + "9" * 5000 + "}\n"), "digits"),
    (lambda p: p.write_bytes(b"name: \xff\xfe\n"), "not UTF-8"),
    (lambda p: p.write_text("# " + "x" * (1 << 20) + "\n"), "bytes"),
])
def test_the_file_itself_is_refused_naming_it(make, words, tmp_path):
    f = tmp_path / "c.yaml"
    make(f)
    (p,) = _refused(f)
    assert p.field == str(f) and words in p.rule, p


# --------------------------------------------------------------------------- the root problem only


@pytest.mark.parametrize("overrides, field", [
    ({"train.lr": -1.0}, "train.lr"),  # not also "min_lr must be in [0, lr] -> lower min_lr"
    ({"train.lr": 0.0}, "train.lr"),
    ({"train.lr_decay_iters": -5}, "train.lr_decay_iters"),  # not "use at most 0 warmup iterations"
    ({"model.num_attention_heads": 0}, "model.num_attention_heads"),
    ({"parallel.tensor_parallel": 0}, "parallel.tensor_parallel"),
    ({"model.ffn_hidden_size": -4, "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2}, "model.ffn_hidden_size"),
])
def test_a_rule_that_reads_an_invalid_field_is_not_reported(overrides, field):
    assert [p.field for p in preset("tiny").replace(**overrides).validate()] == [field]


def test_a_wrong_type_in_a_file_reports_the_root_only(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train: {lr: fast}\n")
    assert [p.field for p in _refused(f)] == ["train.lr"]


def test_an_invalid_field_does_not_hide_independent_problems():
    cfg = preset("tiny").replace(**{"train.lr": -1.0, "train.global_batch_size": 3, "data.split": "x"})
    assert [p.field for p in cfg.validate()] == ["train.lr", "train.global_batch_size", "data.split"]


def _break(value, bound, side):
    if side == "nan":
        return math.nan
    if side == "lo":
        return bound.lo if bound.lo_open else bound.lo - 1
    return bound.hi if bound.hi_open else bound.hi + 1


@pytest.mark.parametrize("family", ["tiny", "bert-tiny", "t5-tiny"])
def test_every_bounded_field_out_of_range_is_the_only_problem(family):
    """Each field's range broken alone, on each family: that field is reported and nothing that reads it."""
    from workbench.config_fields import BOUNDS

    base = preset(family)
    assert base.validate() == []
    checked = 0
    for path, bound in BOUNDS.items():
        for side in ("lo", "hi", "nan"):
            if (side == "lo" and bound.lo is None) or (side == "hi" and bound.hi is None):
                continue
            d = base.to_dict()
            where = path
            if path.startswith("data.datasets."):
                d["data"].update(source="indexed", datasets=[{"prefix": "/nowhere/x", "weight": 1.0}])
                d["data"]["datasets"][0][path.rsplit(".", 1)[1]] = _break(None, bound, side)
                where = "data.datasets[0]." + path.rsplit(".", 1)[1]
            else:
                *sections, name = path.split(".")
                node = d
                for section in sections:  # nested sections too (model.moe.*)
                    node = node[section]
                node[name] = _break(None, bound, side)
            try:
                problems = RunConfig.from_dict(d).validate()
            except ConfigError as e:
                problems = e.problems
            assert [p.field for p in problems] == [where], (path, side, [str(p) for p in problems])
            checked += 1
    assert checked > 100


# --------------------------------------------------------------------------- the deepest valid pipelines


def _brute_force_split(L, pp, layer, head):
    """Every (first, middle..., last) split tried, first then last ascending: the first strictly faster wins."""
    def slowest(split):
        return max(n * layer + (head if r == pp - 1 else 0.0) for r, n in enumerate(split))
    best = tuple([L // pp] * pp) if L % pp == 0 else None
    for first in range(1, L):
        for last in range(1, L - first + 1):
            middle = L - first - last
            if (pp == 2 and middle) or (pp > 2 and (middle < pp - 2 or middle % (pp - 2))):
                continue
            split = (first, *([middle // (pp - 2)] * (pp - 2) if pp > 2 else ()), last)
            if best is None or slowest(split) < slowest(best) - 1e-9:
                best = split
    return best


def test_the_balanced_split_is_the_brute_force_one():
    from workbench.config import layer_and_head_flops, pipeline_stage_layers

    for L in range(2, 41):
        for pp in range(2, min(L, 7) + 1):
            cfg = preset("gpt2-small").replace(**{"model.num_layers": L, "parallel.pipeline_parallel": pp,
                                                   "parallel.nproc_per_node": pp, "train.micro_batch_size": 4, "train.global_batch_size": 4 * pp})
            expected = _brute_force_split(L, pp, *layer_and_head_flops(cfg)) or tuple([max(L // pp, 1)] * pp)
            assert pipeline_stage_layers(cfg) == expected, (L, pp)


def test_the_deepest_valid_pipelines_validate_promptly():
    t0 = time.perf_counter()
    for layers in (1024, 1000, 998):  # the most layers a config may have, on 3 stages: the longest split search
        cfg = preset("gpt2-small").replace(**{"model.num_layers": layers, "parallel.pipeline_parallel": 3,
                                               "parallel.nproc_per_node": 3, "train.micro_batch_size": 4, "train.global_batch_size": 12})
        assert cfg.validate() == []
    assert time.perf_counter() - t0 < 6
