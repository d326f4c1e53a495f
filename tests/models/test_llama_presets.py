"""The Llama 3.x presets: Meta's published shapes, and the HF Llama configs map onto the same model fields."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from workbench.config import derive, preset

#: preset -> (published parameter count, HF LlamaConfig fields of the published checkpoint)
LLAMA = {
    "llama3.2-1b": (1.24e9, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)),
    "llama3.2-3b": (3.21e9, dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "llama3.1-8b": (8.03e9, dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
}
COMMON = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
              attention_bias=False, mlp_bias=False, initializer_range=0.02)


@pytest.mark.parametrize("name", list(LLAMA))
def test_llama_preset_has_the_published_parameter_count(name):
    cfg = preset(name)
    assert cfg.validate() == []
    m = cfg.model
    assert (m.position_embedding, m.normalization, m.activation, m.add_bias_linear) == ("rope", "rmsnorm", "swiglu", False)
    assert m.query_groups == 8 and m.rotary_base == 500000.0 and m.seq_length == 2048
    assert (cfg.parallel.device, cfg.train.precision) == ("cuda", "bf16")
    d = derive(cfg)
    assert d.padded_vocab_size == 128256  # already a multiple of 128: no padding rows
    published, _ = LLAMA[name]
    assert abs(d.params.total - published) <= 0.01 * published, (name, d.params.total)


@pytest.mark.parametrize("name", list(LLAMA))
def test_hf_llama_config_maps_onto_the_preset(name):
    transformers = pytest.importorskip("transformers")
    from workbench.conversion.hf import run_config_from_hf

    hf = transformers.LlamaConfig(**COMMON, **LLAMA[name][1]).to_dict()
    cfg = run_config_from_hf(hf, base=preset(name))
    assert asdict(cfg.model) == asdict(preset(name).model)


def test_published_llama3_rope_scaling_is_refused_not_ignored():
    """The published 3.1 / 3.2 checkpoints rescale low RoPE frequencies (rope_type llama3); the workbench
    model has plain RoPE only, so their conversion is refused (the presets are shapes for throughput)."""
    transformers = pytest.importorskip("transformers")
    from workbench.conversion.hf import run_config_from_hf
    from workbench.models.common.conversion_rules import ConversionError

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = transformers.LlamaConfig(**COMMON, **LLAMA["llama3.2-1b"][1], rope_scaling=scaling).to_dict()
    with pytest.raises(ConversionError, match="llama3"):
        run_config_from_hf(hf, base=preset("llama3.2-1b"))
