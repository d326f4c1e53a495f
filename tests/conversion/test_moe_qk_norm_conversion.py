"""HF Qwen3-MoE <-> megatron-core on random models with odd shapes (6 heads of head_dim 16 on hidden 48, 2 KV groups,
4 experts of FFN 40, vocab 1100, untied): the per-head q/k norms land in megatron's ``qk_layernorm``, logits match
HF's own class (``norm_topk_prob`` true at EP=1, false at TP=2 x EP=2), the export back to HF is
bit-identical, the published per-expert tensor names give the same tensors as transformers 5's fused ones, and what
megatron-core cannot hold (a q/k norm of the wrong width, e.g. OLMoE's all-heads one in a Qwen3-MoE checkpoint, a
dense q/k-norm model's export, q/k norms on a family without them) is refused with the reason."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support import hf_moe_models as moe

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

V = 1100


def _qwen3_moe(root, norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return moe.save_random(Qwen3MoeForCausalLM, Qwen3MoeConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2), root)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _qwen3_moe(tmp_path_factory.mktemp("qwen3moe") / "hf", norm_topk_prob=True)


@pytest.fixture(scope="module")
def converted(qwen, tmp_path_factory):
    return moe.convert(qwen[0], tmp_path_factory.mktemp("mc") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="module")
def unrenormalised(tmp_path_factory):
    """The ``norm_topk_prob`` false model (HF model) and its conversion at TP=1."""
    root = tmp_path_factory.mktemp("unrenormalised")
    hf_dir, hf = _qwen3_moe(root / "hf", norm_topk_prob=False)
    return hf, moe.convert(hf_dir, root / "ckpt")


@pytest.fixture(scope="module")
def forwards(converted, unrenormalised):
    """Both checkpoints' logits from one launch of four ranks: the renormalising one at EP=1, the other at
    TP=2 x EP=2."""
    return moe.forwards(converted.output, unrenormalised[1].output, V)


def test_the_config_is_qwen3_moes_and_the_planner_counts_its_q_k_norms(qwen, converted):
    from workbench.config import derive

    m = converted.config.model
    assert m.qk_layernorm and m.kv_channels == 16 and m.query_groups == 2 and not m.tie_embeddings
    assert (m.moe.num_experts, m.moe.top_k, m.moe.ffn_hidden_size, m.moe.router_pre_softmax) == (4, 2, 40, False)
    d = derive(converted.config)
    pad_rows = d.padded_vocab_size - V  # the word embedding and the untied output layer, both padded
    assert d.params.total == sum(p.numel() for p in qwen[1].parameters()) + 2 * pad_rows * 48


def test_logits_match_hf(qwen, forwards):
    moe.assert_logits_match(forwards[0], qwen[1], V)


def test_the_unrenormalised_router_converts_and_matches_at_tp2_ep2(unrenormalised, forwards):
    hf, res = unrenormalised
    assert res.config.model.moe.router_pre_softmax
    moe.assert_logits_match(forwards[1], hf, V, tp=2, ep=2)


def test_export_back_to_hf_is_bit_identical(qwen, converted, tmp_path):
    cfg, back = moe.export_back(converted.output, tmp_path / "back")
    assert (cfg["model_type"], cfg["num_experts"], cfg["norm_topk_prob"], cfg["head_dim"]) == ("qwen3_moe", 4, True, 16)
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    moe.assert_same_tensors(qwen[1].state_dict(), back.state_dict())


def test_the_published_per_expert_names_give_the_same_tensors(qwen, converted):
    sd = dict(qwen[1].state_dict())
    fused = moe.rules("qwen3_moe", sd, converted.config)
    per_expert = moe.rules("qwen3_moe", moe.per_expert_names(sd), converted.config)
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in fused
    moe.assert_same_tensors(fused, per_expert)


def test_a_q_norm_over_all_heads_is_refused_naming_the_tensor(qwen, converted):
    from workbench.models.common.conversion_rules import ConversionError

    sd = dict(qwen[1].state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(6 * 16)  # OLMoE's width: every head at once
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_norm\.weight has shape \(96,\), not \(16,\)"):
        moe.rules("qwen3_moe", sd, converted.config)


def test_an_incomplete_olmoe_config_is_refused_through_the_cli_with_the_reason(tmp_path):
    """OLMoE converts (its all-heads q/k norms: test_olmoe_conversion.py); a config.json without its shapes is refused
    naming them, exit 2, no traceback."""
    err = moe.refused_through_cli(tmp_path, json.dumps({"model_type": "olmoe", "hidden_size": 32, "num_experts": 4}))
    assert "OLMoE config without num_attention_heads" in err and "complete OlmoeConfig" in err, err
    assert "config.json" in err, err


def test_a_dense_model_with_qk_norms_is_not_exported_and_other_families_refuse_them():
    from workbench.config import RunConfig, preset, validate
    from workbench.conversion.hf import infer_model_type
    from workbench.models.common.conversion_rules import ConversionError

    cfg = preset("llama-small")
    cfg.model.qk_layernorm = True
    with pytest.raises(ConversionError, match="qk_layernorm on a dense model"):
        infer_model_type(cfg.model)
    cfg.model.moe.num_experts, cfg.model.moe.top_k = 4, 2
    assert infer_model_type(cfg.model) == "qwen3_moe"
    bert = RunConfig.from_dict({"model": {"arch": "bert", "qk_layernorm": True}})
    assert any(p.field == "model.qk_layernorm" for p in validate(bert))
