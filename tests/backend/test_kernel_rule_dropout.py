"""The kernel rule under dropout: the compiled dense layer serves the presets as shipped (BERT's and T5's dropout 0.1
included), BERT fine-tuning, GPT with dropout and TP with and without sequence parallelism; with or without
Transformer Engine installed."""

from __future__ import annotations

import pytest

from workbench import kernel_rule
from workbench.config import preset

PRESETS = ["bert-base", "bert-large", "t5-base", "t5-v1_1-base", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl",
           "llama3.2-1b", "llama3.2-3b"]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("te", [False, True])
def test_presets_at_their_defaults_train_on_the_compiled_layer(name, te):
    cfg = preset(name)
    assert cfg.parallel.device == "cuda" and cfg.train.compile_kernels  # the presets' own GPU defaults
    k = kernel_rule.choose(cfg, te=te, apex=False)
    assert (k.attention, k.layer, k.layer_reason, k.cuda_graphs_impl) == ("sdpa", "compiled", "", "step"), k.describe()


def test_bert_and_t5_presets_ship_with_dropout():
    """What the rows above prove matters: BERT's and T5's published dropout is in the presets."""
    for name in ("bert-base", "bert-large", "t5-base", "t5-v1_1-base"):
        assert preset(name).model.hidden_dropout == 0.1, name
    assert preset("bert-base").model.attention_dropout == 0.1


@pytest.mark.parametrize("over", [
    {"model.num_labels": 2, "model.add_binary_head": False},  # sequence classification fine-tuning
    {"model.num_labels": 2, "model.add_binary_head": False, "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2},
    {"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True},
    {"parallel.recompute": "selective"},
])
def test_bert_with_dropout_in_other_layouts_takes_the_compiled_layer(over):
    cfg = preset("bert-base", **over)
    assert cfg.validate() == []
    k = kernel_rule.choose(cfg, te=True, apex=False)
    assert (k.layer, k.layer_reason) == ("compiled", ""), k.describe()


def test_gpt_with_dropout_takes_the_compiled_layer_and_runs_fp8_there():
    drop = preset("llama3.2-1b", **{"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1})
    assert kernel_rule.choose(drop, te=True).layer == "compiled"
    fp8 = drop.replace(**{"train.fp8": "delayed"})
    k = kernel_rule.choose(fp8, te=True)
    assert (k.layer, k.fp8, k.fp8_impl) == ("compiled", "delayed", "torch")
    assert kernel_rule.fp8_problems(fp8) == []


def test_what_still_keeps_the_layer_stock_is_named():
    for over, why in (({"model.position_embedding": "alibi"}, "ALiBi"),
                      ({"data.reset_attention_mask": True}, "per-document attention mask"),
                      ({"train.compile_kernels": False}, "compile_kernels is off"),
                      ({"parallel.device": "cpu"}, "GPU-only")):
        k = kernel_rule.choose(preset("gpt2-small", **{"model.hidden_dropout": 0.1, **over}), te=False)
        assert k.layer == "stock" and why in k.layer_reason, (over, k.layer_reason)
