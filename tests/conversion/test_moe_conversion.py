"""HF Mixtral <-> megatron-core MoE conversion on a random model with odd shapes (6 heads, 2 KV groups, 4 experts of
FFN 40, vocab 1100, untied): logits against HF's own class at EP=1, EP=2 and TP=2 x PP=2, the export back to HF
bit-identical, greedy generation from the converted checkpoint equal to HF's greedy tokens, and an OLMoE the
workbench model cannot hold (clip_qkv) refused with the reason (Qwen3-MoE: test_moe_qk_norm_conversion.py; OLMoE:
test_olmoe_conversion.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

V = 1100


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("mixtral")
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, intermediate_size=40,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=V, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=5000.0, sliding_window=None, bos_token_id=1, eos_token_id=2))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
            if p.dim() == 2 and p.shape[0] == 4:  # the routers: spread the logits so top-2 is far from ties
                p.mul_(10.0)
    model.eval().save_pretrained(root / "hf")
    return root / "hf", model


@pytest.fixture(scope="module")
def converted(mixtral, tmp_path_factory):
    from workbench.conversion import hf_to_megatron

    return hf_to_megatron(mixtral[0], tmp_path_factory.mktemp("mc") / "ckpt", tp=1, pp=1, device="cpu", progress=False)


def _tokens():
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))


def test_the_config_is_mixtrals(converted):
    moe = converted.config.model.moe
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.router_pre_softmax) == (4, 2, 40, False)
    assert converted.config.model.query_groups == 2 and not converted.config.model.tie_embeddings


LAYOUTS = [dict(), dict(ep=2), dict(tp=2, pp=2)]


@pytest.fixture(scope="module")
def layout_logits(converted):
    """The converted checkpoint's logits at every layout of :data:`LAYOUTS`, from one launch of four ranks
    (``tests.support.verify_runs``: verify's worker once per layout; EP=1 and EP=2 with the other ranks as
    data-parallel replicas)."""
    from tests.support.verify_runs import forward_logits_many

    return forward_logits_many([dict(ckpt=converted.output, tokens=_tokens(), **layout) for layout in LAYOUTS])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_hf_at_every_layout(layout, mixtral, layout_logits):
    _, hf = mixtral
    tokens = _tokens()
    with torch.no_grad():
        ref = hf(tokens).logits.float()
    got = layout_logits[LAYOUTS.index(layout)][..., :V]
    assert ref.abs().max() > 0.5
    assert (got - ref).abs().max() < 1e-4, layout


def test_export_back_to_hf_is_bit_identical(mixtral, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.conversion import megatron_to_hf

    _, hf = mixtral
    megatron_to_hf(converted.output, tmp_path / "back", progress=False)
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back).__name__ == "MixtralForCausalLM"
    a, b = hf.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_greedy_generation_equals_hf_greedy(mixtral, converted):
    from workbench.generation import generate

    _, hf = mixtral
    prompt = [5, 17, 300, 42]
    outs = generate(converted.output, prompt_ids=[prompt], max_new_tokens=8, greedy=True, device="cpu", timeout=300)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert outs[0].token_ids == ref[0, len(prompt):].tolist()


def test_olmoe_with_clip_qkv_is_refused(tmp_path):
    """OLMoE converts (test_olmoe_conversion.py) except what megatron's attention cannot hold: a clamp of q, k, v."""
    import json

    from workbench.conversion import hf_to_megatron
    from workbench.models.common.conversion_rules import ConversionError

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "olmoe", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 16,
        "vocab_size": 64, "max_position_embeddings": 32, "num_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "clip_qkv": 8.0}))
    with pytest.raises(ConversionError, match="clip_qkv 8.0 -> megatron-core's attention does not clamp"):
        hf_to_megatron(tmp_path, tmp_path / "out", device="cpu", progress=False)


def test_an_moe_the_mixtral_class_cannot_hold_is_not_exported():
    from workbench.config import preset
    from workbench.models.common.conversion_rules import ConversionError
    from workbench.models.gpt import hf_moe

    with pytest.raises(ConversionError, match="router_pre_softmax false"):
        hf_moe.hf_config_fields(preset("olmoe-1b-7b"))
