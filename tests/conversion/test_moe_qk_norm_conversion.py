"""HF Qwen3-MoE <-> megatron-core on random models with odd shapes (6 heads of head_dim 16 on hidden 48, 2 KV groups,
4 experts of FFN 40, vocab 1100, untied): the per-head q/k norms land in megatron's ``qk_layernorm``, logits match
HF's own class (``norm_topk_prob`` true at EP=1, false at TP=2 x EP=2), the export back to HF is
bit-identical, the published per-expert tensor names give the same tensors as transformers 5's fused ones, and what
megatron-core cannot hold (a q/k norm of the wrong width, e.g. OLMoE's all-heads one in a Qwen3-MoE checkpoint, a
dense q/k-norm model's export, q/k norms on a family without them) is refused with the reason."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support.hf_moe_models import spread

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

V = 1100


def _qwen3_moe(root, norm_topk_prob: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-6,
        bos_token_id=1, eos_token_id=2))
    spread(model).save_pretrained(root)
    return root, model


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _qwen3_moe(tmp_path_factory.mktemp("qwen3moe") / "hf", norm_topk_prob=True)


@pytest.fixture(scope="module")
def converted(qwen, tmp_path_factory):
    from workbench.conversion import hf_to_megatron

    return hf_to_megatron(qwen[0], tmp_path_factory.mktemp("mc") / "ckpt", tp=1, pp=1, device="cpu", progress=False)


@pytest.fixture(scope="module")
def unrenormalised(tmp_path_factory):
    """The ``norm_topk_prob`` false model (HF dir, model) and its conversion at TP=1."""
    from workbench.conversion import hf_to_megatron

    root = tmp_path_factory.mktemp("unrenormalised")
    hf_dir, hf = _qwen3_moe(root / "hf", norm_topk_prob=False)
    return hf, hf_to_megatron(hf_dir, root / "ckpt", device="cpu", progress=False)


def _tokens():
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def forwards(converted, unrenormalised):
    """Both checkpoints' logits from one launch of four ranks (``tests.support.verify_runs``: verify's worker once per
    job): the renormalising one at EP=1 (its other ranks data-parallel replicas), the other at TP=2 x EP=2."""
    from tests.support.verify_runs import forward_logits_many

    return forward_logits_many([dict(ckpt=converted.output, tokens=_tokens()),
                                dict(ckpt=unrenormalised[1].output, tokens=_tokens(), tp=2, ep=2)])


def _logits_match(got, hf, **layout):
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    got = got[..., :V]
    assert ref.abs().max() > 0.5
    assert (got - ref).abs().max() < 1e-4, layout


def test_the_config_is_qwen3_moes_and_the_planner_counts_its_q_k_norms(qwen, converted):
    from workbench.config import derive

    m = converted.config.model
    assert m.qk_layernorm and m.kv_channels == 16 and m.query_groups == 2 and not m.tie_embeddings
    assert (m.moe.num_experts, m.moe.top_k, m.moe.ffn_hidden_size, m.moe.router_pre_softmax) == (4, 2, 40, False)
    d = derive(converted.config)
    pad_rows = d.padded_vocab_size - V  # the word embedding and the untied output layer, both padded
    assert d.params.total == sum(p.numel() for p in qwen[1].parameters()) + 2 * pad_rows * 48


def test_logits_match_hf(qwen, forwards):
    _logits_match(forwards[0], qwen[1])


def test_the_unrenormalised_router_converts_and_matches_at_tp2_ep2(unrenormalised, forwards):
    hf, res = unrenormalised
    assert res.config.model.moe.router_pre_softmax
    _logits_match(forwards[1], hf, tp=2, ep=2)


def test_export_back_to_hf_is_bit_identical(qwen, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.conversion import megatron_to_hf

    _, hf = qwen
    megatron_to_hf(converted.output, tmp_path / "back", progress=False)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_experts"], cfg["norm_topk_prob"], cfg["head_dim"]) == ("qwen3_moe", 4, True, 16)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _rules(model_type, sd, cfg):
    from workbench.models.common.conversion_rules import infos_of, run_rules
    from workbench.models.gpt import hf as gpt_hf

    return run_rules(gpt_hf.hf_to_mcore_rules(infos_of(sd), cfg, model_type), sd)


def test_the_published_per_expert_names_give_the_same_tensors(qwen, converted):
    sd = dict(qwen[1].state_dict())
    old = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, dim=0)
                old[f"{p}{e}.gate_proj.weight"], old[f"{p}{e}.up_proj.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                old[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            old[k] = v
    fused, per_expert = _rules("qwen3_moe", sd, converted.config), _rules("qwen3_moe", old, converted.config)
    assert fused.keys() == per_expert.keys() and "decoder.layers.1.self_attention.k_layernorm.weight" in fused
    for k in fused:
        assert torch.equal(fused[k], per_expert[k]), k


def test_a_q_norm_over_all_heads_is_refused_naming_the_tensor(qwen, converted):
    from workbench.models.common.conversion_rules import ConversionError

    sd = dict(qwen[1].state_dict())
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(6 * 16)  # OLMoE's width: every head at once
    with pytest.raises(ConversionError, match=r"layers\.0\.self_attn\.q_norm\.weight has shape \(96,\), not \(16,\)"):
        _rules("qwen3_moe", sd, converted.config)


def test_an_incomplete_olmoe_config_is_refused_through_the_cli_with_the_reason(tmp_path):
    """OLMoE converts (its all-heads q/k norms: test_olmoe_conversion.py); a config.json without its shapes is refused
    naming them, exit 2, no traceback."""
    import subprocess

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "olmoe", "hidden_size": 32, "num_experts": 4}))
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr + proc.stdout
    assert "OLMoE config without num_attention_heads" in err and "complete OlmoeConfig" in err, err
    assert "config.json" in err and "Traceback" not in err and not (tmp_path / "out").exists(), err


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
