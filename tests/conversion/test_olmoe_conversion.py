"""HF OLMoE <-> megatron-core on random models with odd shapes (6 heads of head_dim 8 on hidden 48, 2 KV groups, 4
experts of FFN 40, vocab 1100, untied; the heads' q/k projections scaled unequally, so a norm of the wrong extent
shows): OLMoE's q/k norms over all heads (q_norm 48 wide, k_norm 16 wide) land in ``qk_layernorm`` with
``qk_norm_scope: all_heads``, logits match HF's own class (``norm_topk_prob`` false, the published OLMoE's, at EP=1;
true at TP=2 x EP=2, the norm's sum of squares all-reduced over the TP ranks), a per-head norm would not match, the
export back to HF is bit-identical, and what megatron-core cannot hold (``clip_qkv``, linear biases, a q/k norm of
another width, the scope without the norms or at more TP ranks than KV groups) is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from tests.support import hf_moe_models as moe

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

V, H, HEADS, KV, D = 1100, 48, 6, 2, 8


def _olmoe_config(**kw):
    from transformers import OlmoeConfig

    args = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=40,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, vocab_size=V, max_position_embeddings=64,
                tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    args.update(kw)
    return OlmoeConfig(**args)


def _olmoe(root, norm_topk_prob: bool):
    from transformers import OlmoeForCausalLM

    return moe.save_random(OlmoeForCausalLM, _olmoe_config(norm_topk_prob=norm_topk_prob), root, head_dim=D)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return _olmoe(tmp_path_factory.mktemp("olmoe") / "hf", norm_topk_prob=False)


@pytest.fixture(scope="module")
def converted(olmoe, tmp_path_factory):
    return moe.convert(olmoe[0], tmp_path_factory.mktemp("mc") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="module")
def renormalised(tmp_path_factory):
    """The ``norm_topk_prob`` true model (HF model) and its conversion at TP=1."""
    root = tmp_path_factory.mktemp("renormalised")
    hf_dir, hf = _olmoe(root / "hf", norm_topk_prob=True)
    return hf, moe.convert(hf_dir, root / "ckpt")


@pytest.fixture(scope="module")
def forwards(converted, renormalised):
    """Both checkpoints' logits from one launch of four ranks: the published router at EP=1, the renormalising one
    at TP=2 x EP=2."""
    return moe.forwards(converted.output, renormalised[1].output, V)


def test_the_config_is_olmoes_and_the_planner_counts_its_q_k_norms(olmoe, converted):
    from workbench.config import derive

    m = converted.config.model
    assert m.qk_layernorm and m.qk_norm_scope == "all_heads" and m.kv_channels is None and m.query_groups == KV
    assert (m.moe.num_experts, m.moe.top_k, m.moe.ffn_hidden_size, m.moe.router_pre_softmax) == (4, 2, 40, True)
    assert olmoe[1].model.layers[0].self_attn.q_norm.weight.shape == (HEADS * D,)
    assert olmoe[1].model.layers[0].self_attn.k_norm.weight.shape == (KV * D,)
    d = derive(converted.config)
    pad_rows = d.padded_vocab_size - V  # the word embedding and the untied output layer, both padded
    assert d.params.total == sum(p.numel() for p in olmoe[1].parameters()) + 2 * pad_rows * H


def test_logits_match_hf(olmoe, forwards):
    moe.assert_logits_match(forwards[0], olmoe[1], V)


def test_the_renormalised_router_matches_at_tp2_ep2(renormalised, forwards):
    hf, res = renormalised
    assert not res.config.model.moe.router_pre_softmax
    moe.assert_logits_match(forwards[1], hf, V, tp=2, ep=2)


def test_a_per_head_norm_would_not_match(olmoe, forwards):
    """The same weights with each head normalised on its own (megatron-core's stock qk_layernorm, the weights viewed
    per head) give other logits, far outside the tolerance the conversion meets."""
    from transformers.models.olmoe import modeling_olmoe

    hf = olmoe[1]

    def per_head(self, x):
        heads = x.reshape(*x.shape[:-1], -1, D).float()
        y = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * y.reshape(x.shape).to(x.dtype)

    norms = [m for layer in hf.model.layers for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    try:
        for n in norms:
            n.forward = per_head.__get__(n, modeling_olmoe.OlmoeRMSNorm)
        wrong = moe.hf_logits(hf, V)
    finally:
        for n in norms:
            del n.forward
    assert (wrong - forwards[0][..., :V]).abs().max() > 1e-2
    assert (wrong - moe.hf_logits(hf, V)).abs().max() > 1e-2


def test_export_back_to_hf_is_bit_identical(olmoe, converted, tmp_path):
    cfg, back = moe.export_back(converted.output, tmp_path / "back")
    assert (cfg["model_type"], cfg["num_experts"], cfg["norm_topk_prob"], cfg["intermediate_size"]) == ("olmoe", 4, False, 40)
    assert cfg["clip_qkv"] is None
    assert type(back).__name__ == "OlmoeForCausalLM"
    moe.assert_same_tensors(olmoe[1].state_dict(), back.state_dict())


def test_the_published_per_expert_names_give_the_same_tensors(olmoe, converted):
    """allenai/OLMoE-1B-7B's files name each expert (``mlp.experts.<e>.gate_proj / up_proj / down_proj``)."""
    sd = dict(olmoe[1].state_dict())
    fused = moe.rules("olmoe", sd, converted.config)
    per_expert = moe.rules("olmoe", moe.per_expert_names(sd), converted.config)
    assert fused["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (H,)
    moe.assert_same_tensors(fused, per_expert)


def test_a_per_head_q_norm_in_an_olmoe_checkpoint_is_refused_naming_the_tensor(olmoe, converted):
    from workbench.models.common.conversion_rules import ConversionError

    sd = dict(olmoe[1].state_dict())
    k_norm = moe.rules("olmoe", sd, converted.config)["decoder.layers.1.self_attention.k_layernorm.weight"]
    assert k_norm.shape == (KV * D,)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(D)  # Qwen3's width: one head
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_norm\.weight has shape \(8,\), not \(48,\)"):
        moe.rules("olmoe", sd, converted.config)


@pytest.mark.parametrize("field, value, says", [("clip_qkv", 8.0, "clip_qkv 8.0"), ("attention_bias", True, "attention_bias true")])
def test_what_megatron_cannot_hold_is_refused_through_the_cli(tmp_path, field, value, says):
    err = moe.refused_through_cli(tmp_path, _olmoe_config(**{field: value}).to_json_string())
    assert says in err, err


def test_the_scope_is_validated_and_exports_only_as_olmoe():
    from workbench import kernel_rule
    from workbench.config import preset, validate
    from workbench.conversion.hf import infer_model_type
    from workbench.models.common.conversion_rules import ConversionError
    from workbench.models.gpt import hf_moe

    cfg = preset("olmoe-1b-7b")
    assert cfg.model.qk_layernorm and cfg.model.qk_norm_scope == "all_heads" and not validate(cfg)
    assert infer_model_type(cfg.model) == "olmoe"
    assert "all heads" in kernel_rule.layer_blocker(cfg)  # the kernel path names why megatron's layer runs
    cfg.model.qk_norm_scope = "head"
    assert infer_model_type(cfg.model) == "qwen3_moe"
    with pytest.raises(ConversionError, match="qk_norm_scope all_heads export to OLMoE"):
        hf_moe.hf_config_fields(cfg, "olmoe")

    def problems(**over):
        c = preset("olmoe-1b-7b", **over)
        return {p.field: p for p in validate(c)}

    p = problems(**{"model.qk_layernorm": False})
    assert "model.qk_norm_scope" in p and "qk_layernorm: true" in str(p["model.qk_norm_scope"])
    assert "model.qk_norm_scope" in problems(**{"model.normalization": "layernorm"})
    gqa = {"model.attention_type": "grouped", "model.num_query_groups": 2, "parallel.tensor_parallel": 4,
           "parallel.nproc_per_node": 4}
    assert "tensor_parallel <= 2" in str(problems(**gqa)["model.qk_norm_scope"])
    assert "model.qk_norm_scope" not in problems(**{**gqa, "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
