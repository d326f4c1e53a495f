"""HF OLMoE <-> megatron-core on random models with odd shapes (6 heads of head_dim 8 on hidden 48, 2 KV groups, 4
experts of FFN 40, vocab 1100, untied; the heads' q/k projections scaled unequally, so a norm of the wrong extent
shows): OLMoE's q/k norms over all heads (q_norm 48 wide, k_norm 16 wide) land in ``qk_layernorm`` with
``qk_norm_scope: all_heads``, logits match HF's own class (``norm_topk_prob`` false, the published OLMoE's, at EP=1;
true at TP=2 x EP=2, the norm's sum of squares all-reduced over the TP ranks), a per-head norm would not match, the
export back to HF is bit-identical, and what megatron-core cannot hold (``clip_qkv``, linear biases, a q/k norm of
another width, the scope without the norms or at more TP ranks than KV groups) is refused with the reason."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support.hf_moe_models import spread

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

    torch.manual_seed(0)
    model = OlmoeForCausalLM(_olmoe_config(norm_topk_prob=norm_topk_prob))
    spread(model, head_dim=D).save_pretrained(root)
    return root, model


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return _olmoe(tmp_path_factory.mktemp("olmoe") / "hf", norm_topk_prob=False)


@pytest.fixture(scope="module")
def converted(olmoe, tmp_path_factory):
    from workbench.conversion import hf_to_megatron

    return hf_to_megatron(olmoe[0], tmp_path_factory.mktemp("mc") / "ckpt", tp=1, pp=1, device="cpu", progress=False)


@pytest.fixture(scope="module")
def renormalised(tmp_path_factory):
    """The ``norm_topk_prob`` true model (HF model) and its conversion at TP=1."""
    from workbench.conversion import hf_to_megatron

    root = tmp_path_factory.mktemp("renormalised")
    hf_dir, hf = _olmoe(root / "hf", norm_topk_prob=True)
    return hf, hf_to_megatron(hf_dir, root / "ckpt", device="cpu", progress=False)


def _tokens():
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def forwards(converted, renormalised):
    """Both checkpoints' logits from one launch of four ranks: the published router at EP=1 (its other ranks
    data-parallel replicas), the renormalising one at TP=2 x EP=2."""
    from tests.support.verify_runs import forward_logits_many

    return forward_logits_many([dict(ckpt=converted.output, tokens=_tokens()),
                                dict(ckpt=renormalised[1].output, tokens=_tokens(), tp=2, ep=2)])


def _hf_logits(hf):
    with torch.no_grad():
        return hf(_tokens()).logits.float()


def _logits_match(got, hf, **layout):
    ref = _hf_logits(hf)
    got = got[..., :V]
    assert ref.abs().max() > 0.5
    assert (got - ref).abs().max() < 1e-4, layout


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
    _logits_match(forwards[0], olmoe[1])


def test_the_renormalised_router_matches_at_tp2_ep2(renormalised, forwards):
    hf, res = renormalised
    assert not res.config.model.moe.router_pre_softmax
    _logits_match(forwards[1], hf, tp=2, ep=2)


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
        wrong = _hf_logits(hf)
    finally:
        for n in norms:
            del n.forward
    assert (wrong - forwards[0][..., :V]).abs().max() > 1e-2
    assert (wrong - _hf_logits(hf)).abs().max() > 1e-2


def test_export_back_to_hf_is_bit_identical(olmoe, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.conversion import megatron_to_hf

    _, hf = olmoe
    megatron_to_hf(converted.output, tmp_path / "back", progress=False)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["norm_topk_prob"], cfg["intermediate_size"]) == ("olmoe", 4, False, 40)
    assert cfg["clip_qkv"] is None
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back).__name__ == "OlmoeForCausalLM"
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _rules(sd, cfg):
    from workbench.models.common.conversion_rules import infos_of, run_rules
    from workbench.models.gpt import hf as gpt_hf

    return run_rules(gpt_hf.hf_to_mcore_rules(infos_of(sd), cfg, "olmoe"), sd)


def test_the_published_per_expert_names_give_the_same_tensors(olmoe, converted):
    """allenai/OLMoE-1B-7B's files name each expert (``mlp.experts.<e>.gate_proj / up_proj / down_proj``)."""
    sd = dict(olmoe[1].state_dict())
    old = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                old[f"{p}{e}.gate_proj.weight"], old[f"{p}{e}.up_proj.weight"] = v[e].chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                old[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            old[k] = v
    fused, per_expert = _rules(sd, converted.config), _rules(old, converted.config)
    assert fused.keys() == per_expert.keys() and fused["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (H,)
    for k in fused:
        assert torch.equal(fused[k], per_expert[k]), k


def test_a_per_head_q_norm_in_an_olmoe_checkpoint_is_refused_naming_the_tensor(olmoe, converted):
    from workbench.models.common.conversion_rules import ConversionError

    sd = dict(olmoe[1].state_dict())
    assert _rules(sd, converted.config)["decoder.layers.1.self_attention.k_layernorm.weight"].shape == (KV * D,)
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(D)  # Qwen3's width: one head
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_norm\.weight has shape \(8,\), not \(48,\)"):
        _rules(sd, converted.config)


@pytest.mark.parametrize("field, value, says", [("clip_qkv", 8.0, "clip_qkv 8.0"), ("attention_bias", True, "attention_bias true")])
def test_what_megatron_cannot_hold_is_refused_through_the_cli(tmp_path, field, value, says):
    import subprocess

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(_olmoe_config(**{field: value}).to_json_string())
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr + proc.stdout
    assert says in err and "Traceback" not in err and not (tmp_path / "out").exists(), err


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
