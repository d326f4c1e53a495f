"""A model is built from one kernel decision: :func:`workbench.backend.model.transformer_config` asks the kernel rule
once and carries the answer (``workbench_kernels``); every spec builder of every family reads that answer
(:func:`workbench.kernel_rule.decided`) instead of deciding again, so a decision passed in (the trainer's) is the one
the model is built with."""

from __future__ import annotations

import dataclasses

import pytest

from workbench import kernel_rule
from workbench.config import preset


def _counting(monkeypatch) -> list:
    calls: list = []
    real = kernel_rule.choose

    def choose(cfg, **kw):
        calls.append(kw)
        return real(cfg, **kw)

    monkeypatch.setattr(kernel_rule, "choose", choose)
    return calls


@pytest.mark.parametrize("name", ["tiny", "bert-tiny", "t5-tiny"])
def test_building_a_model_asks_the_kernel_rule_once(dist_group, monkeypatch, name):
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    cfg = preset(name)
    calls = _counting(monkeypatch)
    tc = transformer_config(cfg)
    build_model(cfg, config=tc)
    assert len(calls) == 1, calls
    assert tc.workbench_kernels == kernel_rule.choose(cfg)


def test_the_decision_passed_in_is_the_one_built(dist_group, monkeypatch):
    """The stock norm ('torch': megatron's local spec in every layer) passed in where the rule picks the workbench's."""
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    cfg = preset("tiny")
    ruled = kernel_rule.choose(cfg)
    assert ruled.norm != "torch"
    calls = _counting(monkeypatch)
    passed = build_model(cfg, config=transformer_config(cfg, dataclasses.replace(ruled, norm="torch")))
    assert calls == []  # nothing decided again
    ruled_model = build_model(cfg, config=transformer_config(cfg))

    def layer_norms(model):
        return {type(layer.input_layernorm).__name__ for layer in model.decoder.layers}

    assert layer_norms(passed) == {"LayerNorm"}
    assert layer_norms(ruled_model) == {"WorkbenchLayerNorm"}
