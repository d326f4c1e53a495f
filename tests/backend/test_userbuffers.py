"""parallel.te_userbuffers: TE's TP comm overlap (megatron's tp_comm_overlap through TE's userbuffers).

The rule (which TP overlap a config gets), its refusals (exit 2 with the field and the fix, before any
process starts), the training-only megatron field, the rank environment and the benchmark rows.  The
userbuffers themselves need two GPUs and TE (``bench/train_throughput.py`` rows ``tp2-te-ub``).
"""

from __future__ import annotations

import pytest

from workbench import kernel_rule
from workbench.cli import main
from workbench.config import preset, rank_environment

#: GPT-2 small at TP=2 on TE's layer with SP: what userbuffers need
TE_TP2 = preset("gpt2-small", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2,
                                 "parallel.sequence_parallel": True, "model.attention_backend": "te"})
UB = TE_TP2.replace(**{"parallel.te_userbuffers": True})


@pytest.fixture
def te_here(monkeypatch):
    monkeypatch.setattr(kernel_rule, "te_available", lambda: True)  # the boundary: a machine with TE installed


def test_each_layer_gets_its_own_tp_overlap():
    compiled = preset("gpt2-small", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    assert kernel_rule.choose(compiled, te=False).tp_overlap == "compiled"
    assert kernel_rule.choose(compiled.replace(**{"parallel.tp_comm_overlap": False}), te=False).tp_overlap == ""
    assert kernel_rule.choose(preset("gpt2-small"), te=False).tp_overlap == ""  # TP = 1: nothing to overlap
    # TE's layer: its collectives are exposed unless userbuffers are asked for
    assert kernel_rule.choose(TE_TP2, te=True).tp_overlap == ""
    ub = kernel_rule.choose(UB, te=True)
    assert ub.tp_overlap == "userbuffers" and "userbuffers" in ub.describe()
    assert kernel_rule.choose(UB.replace(**{"parallel.sequence_parallel": False}), te=True).tp_overlap == ""
    # the compiled layer never takes userbuffers, and TE's layer never the compiled layer's pass
    assert kernel_rule.choose(UB.replace(**{"model.attention_backend": "auto"}), te=True).tp_overlap == "compiled"


def test_userbuffers_validate_where_they_can_run(te_here):
    assert UB.validate() == []


@pytest.mark.parametrize("over, words", [
    ({"parallel.sequence_parallel": False}, "sequence_parallel: true"),
    ({"parallel.tensor_parallel": 1, "parallel.sequence_parallel": False, "parallel.nproc_per_node": 1}, "tensor_parallel >= 2"),
    ({"model.attention_backend": "sdpa"}, "attention_backend: te"),
    ({"parallel.device": "cpu"}, "device: cpu"),
    ({"train.precision": "fp32"}, "precision: bf16"),
])
def test_userbuffers_refusals_name_the_field_and_the_fix(te_here, over, words):
    problems = [p for p in UB.replace(**over).validate() if p.field == "parallel.te_userbuffers"]
    assert problems and any(words in p.fix for p in problems), problems


def test_userbuffers_on_another_layer_exit_2_before_anything_starts(tmp_path, capsys):
    path = UB.replace(**{"model.attention_backend": "auto"}).save(tmp_path / "ub.yaml")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "parallel.te_userbuffers" in err and "attention_backend: te" in err


def test_transformer_engines_layer_without_te_is_refused_before_the_launch(monkeypatch):
    """TE's layer asked for on a GPU machine without a usable TE: a launch problem with the fix, not a rank's
    traceback.  (Whether TE is usable is the machine's question: the config itself stays valid elsewhere.)"""
    from workbench.launch import checks

    monkeypatch.setattr(checks, "detect_gpus", lambda: 2)  # the machine boundary: nvidia-smi
    monkeypatch.setattr(kernel_rule, "te_available", lambda: False)
    problems = [p for p in checks.launch_problems(UB) if p.field == "model.attention_backend"]
    assert problems and "install_te.sh" in problems[0].fix and "te_userbuffers: false" in problems[0].fix
    monkeypatch.setattr(kernel_rule, "te_available", lambda: True)
    assert not [p for p in checks.launch_problems(UB) if p.field == "model.attention_backend"]


def test_t5_is_refused_by_its_family(te_here):
    """T5's cross-attention builds TE linears without a userbuffer name (megatron asserts one under tp_comm_overlap)."""
    t5 = preset("t5-base", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True,
                              "parallel.te_userbuffers": True, "model.attention_backend": "te",
                              "model.decoder_seq_length": 512})
    rules = [p.rule for p in t5.validate() if p.field == "parallel.te_userbuffers"]
    assert any("cross-attention" in r for r in rules), rules
    assert kernel_rule.choose(t5, te=True).tp_overlap == ""  # the rule and the validation agree


def test_the_rule_and_the_validation_agree_on_auto(te_here):
    """auto with FP8 resolves to TE's layer (where TE is usable): userbuffers run, and validation lets them."""
    auto_fp8 = UB.replace(**{"model.attention_backend": "auto", "train.fp8": "delayed",
                              "data.reset_attention_mask": True})
    assert kernel_rule.choose(auto_fp8, te=True).tp_overlap == "userbuffers"
    assert [p for p in auto_fp8.validate() if p.field == "parallel.te_userbuffers"] == []


def test_initialize_userbuffers_asks_te_for_the_training_shape(te_here, monkeypatch):
    """What the backend hands TE's initialize_ub (TE is not installed here: its module is the boundary)."""
    import sys
    import types

    import torch

    from workbench.backend import tp_overlap

    calls = []
    base = types.SimpleNamespace(
        UserBufferQuantizationMode=types.SimpleNamespace(NONE="none", FP8="fp8"),
        initialize_ub=lambda **kw: calls.append(("init", kw)), destroy_ub=lambda: calls.append(("destroy", {})))
    module = types.ModuleType("transformer_engine.pytorch.module")
    module.base = base
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.module", module)
    monkeypatch.setenv("UB_SKIPMC", "1")
    assert tp_overlap.initialize_userbuffers(TE_TP2) is None  # no userbuffers asked for: TE untouched
    line = tp_overlap.initialize_userbuffers(UB.replace(**{"train.fp8": "delayed"}))
    (kind, kw), = calls
    m, t = UB.model, UB.train
    assert kw == {"shape": [m.seq_length * t.micro_batch_size, m.hidden_size], "tp_size": 2, "quantization_modes": ["fp8"],
                  "dtype": torch.bfloat16, "bootstrap_backend": "nccl"}
    assert "FP8" in line and "UB_SKIPMC" in line
    tp_overlap.destroy_userbuffers()
    tp_overlap.destroy_userbuffers()  # idempotent
    assert [c[0] for c in calls] == ["init", "destroy"]


def test_only_the_training_step_asks_megatron_for_tp_comm_overlap(te_here):
    from workbench.backend import model

    fields = model.training_step_fields(UB)
    assert fields.get("tp_comm_overlap") is True
    assert "tp_comm_overlap" not in model.training_step_fields(TE_TP2)
    # generation, conversion and verification build from the plain config: no userbuffers there
    assert model.transformer_config(UB).tp_comm_overlap is False
    assert model.transformer_config(UB, **fields).tp_comm_overlap is True
    assert "userbuffers" in model.kernel_path(UB)["tp_comm_overlap"]
    # the compiled layer's own overlap is a workbench field, never megatron's userbuffers
    compiled = preset("gpt2-small", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    tc = model.transformer_config(compiled, **model.training_step_fields(compiled))
    assert (tc.tp_comm_overlap, tc.workbench_tp_comm_overlap) == (False, True)


def test_userbuffers_keep_multicast_off_where_the_launch_does(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert rank_environment(UB) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert rank_environment(UB) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UB_SKIPMC": "1"}
    assert "UB_SKIPMC" not in rank_environment(TE_TP2)


def test_the_benchmark_has_the_te_tp2_rows_with_and_without_userbuffers(te_here):
    from bench import train_throughput as tt

    rows = {v.name: v for v in tt.plan(["gpt2-medium"], gpus=2, have_te=True, microbatches=4)}
    names = ("tp2-te", "tp2-te-ub", "tp2-te-ub-nograph", "tp2-te-fp8", "tp2-te-ub-fp8")
    for name in names:
        v = rows[f"{name}/gpt2-large"]
        cfg = tt.bench_config(v)
        assert cfg.validate() == [], (name, cfg.validate())
        choice = kernel_rule.choose(cfg)
        assert (choice.attention, cfg.parallel.tensor_parallel, cfg.parallel.sequence_parallel) == ("te", 2, True)
        assert (choice.tp_overlap == "userbuffers") == ("-ub" in name), name
        assert (v.env.get("UB_SKIPMC") == "1") == ("-ub" in name), name  # never NVLink multicast on shared hosts
        assert v.baseline == "workbench/gpt2-large"
    assert not {f"{n}/gpt2-large" for n in names} & {v.name for v in tt.plan(["gpt2-medium"], 2, False, 4)}
