"""The T5 family without a process group: config rules (pipeline refused with megatron-core 0.19's reason,
every T5-specific problem with field and fix), presets, shapes and FLOPs, the kernel rule, the planner,
span-corruption statistics and the sentinel tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from workbench import kernel_rule
from workbench.config import ConfigError, derive, preset
from workbench.families import FAMILIES, all_presets
from workbench.families.t5.spans import (check_t5_tokenizer, corrupt, input_and_target_lengths, random_spans_noise_mask,
                                       span_problems)


def _fields(cfg):
    return {p.field: p for p in cfg.validate()}


def test_presets_validate_and_are_t5():
    names = [n for n, (f, _) in all_presets().items() if f.name == "t5"]
    assert {"t5-tiny", "t5-small", "t5-base", "t5-v1_1-small", "t5-v1_1-base"} <= set(names)
    for n in names:
        cfg = preset(n)
        assert cfg.validate() == [], (n, cfg.validate())
        assert cfg.model.arch == "t5" and cfg.model.position_embedding == "relative"
    assert preset("t5-base").model.activation == "relu" and preset("t5-base").model.tie_embeddings
    assert preset("t5-v1_1-base").model.activation == "geglu" and not preset("t5-v1_1-base").model.tie_embeddings


def test_pipeline_parallel_refused_with_the_reason_and_fix():
    cfg = preset("t5-tiny", **{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2})
    p = _fields(cfg)["parallel.pipeline_parallel"]
    assert "removed in megatron-core 0.14" in p.rule and "Pipeline parallelism is not supported for T5" in p.rule
    assert "tensor_parallel" in p.rule and "pipeline_parallel: 1" in p.fix
    with pytest.raises(ConfigError):
        cfg.check()


@pytest.mark.parametrize("over,field", [
    ({"model.attention_backend": "te", "parallel.recompute": "selective"}, "parallel.recompute"),
    ({"model.attention_backend": "local"}, "model.attention_backend"),
    ({"model.attention_type": "grouped", "model.num_query_groups": 2}, "model.attention_type"),
    ({"model.position_embedding": "rope"}, "model.position_embedding"),
    ({"model.relative_attention_num_buckets": 7}, "model.relative_attention_num_buckets"),
    ({"model.relative_attention_max_distance": 4}, "model.relative_attention_max_distance"),
    ({"model.decoder_seq_length": 8}, "model.decoder_seq_length"),
    ({"model.decoder_num_layers": 0}, "model.decoder_num_layers"),
    ({"model.seq_length": 3}, "model.seq_length"),
    ({"data.noise_density": 1.2}, "data.noise_density"),
    ({"data.mean_noise_span_length": 0.5}, "data.mean_noise_span_length"),
    ({"data.tokenizer": "demo"}, "data.tokenizer"),
    ({"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True,
      "model.decoder_seq_length": 25}, "model.decoder_seq_length"),
])
def test_t5_rules_name_field_and_fix(over, field):
    problems = _fields(preset("t5-tiny", **over))
    assert field in problems, (over, problems)
    assert problems[field].fix


def test_other_families_refuse_t5_only_settings():
    gpt = _fields(preset("tiny", **{"model.position_embedding": "relative", "model.activation": "geglu"}))
    assert "model.position_embedding" in gpt and "model.activation" in gpt


def test_kernel_rule_puts_t5_on_the_compiled_layer_with_sdpa_with_and_without_dropout():
    kernel_rule.allow_fast_paths_on_cpu(True)
    try:
        pretrain = kernel_rule.choose(preset("t5-base"), te=True, apex=False)  # T5's published dropout 0.1
        bench = kernel_rule.choose(preset("t5-base", **{"model.hidden_dropout": 0.0}), te=True, apex=False)
        explicit = kernel_rule.choose(preset("t5-base", **{"model.attention_backend": "te"}), te=True, apex=False)
    finally:
        kernel_rule.allow_fast_paths_on_cpu(False)
    assert pretrain.attention == "sdpa" and pretrain.layer == "compiled" and pretrain.layer_reason == ""
    assert bench.attention == "sdpa" and bench.layer == "compiled" and bench.layer_reason == ""
    assert pretrain.norm == bench.norm == "workbench"  # auto never takes TE's T5 layer (its speed is unmeasured)
    assert (explicit.attention, explicit.layer, explicit.norm) == ("te", "stock", "te")  # an explicit te builds it


def test_t5_on_transformer_engine_is_a_config_the_t5_rules_accept_without_recompute():
    from workbench.families.t5 import rules

    te = preset("t5-tiny", **{"model.attention_backend": "te"})
    assert [f for f, *_ in rules(te)] == []
    assert [f for f, *_ in rules(te.replace(**{"parallel.recompute": "full"}))] == ["parallel.recompute"]
    assert [f for f, *_ in rules(preset("t5-tiny", **{"parallel.recompute": "full"}))] == []


def test_param_counts_match_hf_t5_small_and_base():
    # published sizes: t5-small 60.5M, t5-base 222.9M (vocab 32128, tied); v1.1 base 247.6M (untied)
    for name, want in (("t5-small", 60_506_624), ("t5-base", 222_903_552), ("t5-v1_1-base", 247_577_856)):
        cfg = preset(name, **{"model.make_vocab_size_divisible_by": 1})
        assert derive(cfg).params.total == want, (name, derive(cfg).params.total)


def test_flops_count_encoder_and_decoder():
    cfg = preset("t5-base")
    d = derive(cfg)
    m = cfg.model
    h, f, V, b = m.hidden_size, m.ffn_size, d.padded_vocab_size, cfg.train.global_batch_size
    se, sd = m.seq_length, m.decoder_seq
    enc = se * (4 * h * h + 2 * h * f) + 2 * se * se * h
    dec = sd * (6 * h * h + 2 * h * f) + se * 2 * h * h + 2 * sd * sd * h + 2 * sd * se * h
    want = 6 * b * (m.num_layers * enc + m.decoder_layers * dec + sd * h * V)
    assert d.flops_per_step == pytest.approx(want, rel=1e-9)


def test_planner_plans_t5_with_both_stacks():
    from workbench.planner import predict as plan

    small = plan(preset("t5-base", **{"model.decoder_num_layers": 1}))
    full = plan(preset("t5-base"), gpu="H100-80GB")
    assert full.largest_micro_batch and full.largest_micro_batch > 0
    assert full.stages[0].peak_allocated > small.stages[0].peak_allocated
    terms = full.stages[0].detail["layer_activation_terms"]
    assert "decoder_layers_share" in terms


def test_span_statistics_match_the_configured_values():
    rng = np.random.default_rng(0)
    raw, tgt, spans = input_and_target_lengths(512, 0.15, 3.0)
    assert (raw, tgt) == (568, 114)  # T5's numbers for 512 encoder tokens
    noise = n_spans = total = 0
    for _ in range(300):
        mask = random_spans_noise_mask(raw, 0.15, 3.0, rng)
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        noise += int(mask.sum())
        n_spans += int(starts.sum())
        total += raw
        assert not mask[0]  # a sample starts with text
    assert abs(noise / total - 0.15) < 0.002
    assert abs(noise / n_spans - 3.0) < 0.1


def test_corruption_is_invertible_and_fills_the_encoder():
    rng = np.random.default_rng(1)
    raw, tgt_len, _ = input_and_target_lengths(64, 0.15, 3.0)
    tokens = np.arange(10, 10 + raw)
    mask = random_spans_noise_mask(raw, 0.15, 3.0, rng)
    sentinels = [1000 - i for i in range(100)]
    inp, tgt = corrupt(tokens, mask, sentinels, eos=1)
    assert len(inp) == 64 and len(tgt) == tgt_len
    spans: dict[int, list[int]] = {}
    cur = None
    for t in tgt[:-1]:
        if t in sentinels:
            cur = int(t)
            spans[cur] = []
        else:
            spans[cur].append(int(t))
    rebuilt = [x for t in inp[:-1] for x in (spans[int(t)] if t in sentinels else [int(t)])]
    assert rebuilt == tokens.tolist()


def test_sentinel_tokenizer_and_clear_errors(tmp_path):
    v = check_t5_tokenizer("demo-t5")
    assert len(v.sentinels) == 100 and v.pad is not None and v.eos is not None
    assert v.tokenizer.encode("<extra_id_7>") == [v.sentinels[7]]
    from workbench.data.errors import DataError

    with pytest.raises(DataError, match="sentinel"):
        check_t5_tokenizer("demo")
    cfg = preset("t5-tiny", **{"model.vocab_size": 4096})
    with pytest.raises(DataError, match="vocab_size"):
        check_t5_tokenizer("demo-t5", cfg)


def test_a_prompt_with_a_sentinel_tokenizes_as_span_corruption_made_the_training_input():
    """A prompt written with spaces round its sentinel ("created the <extra_id_0> and") is the encoder input span
    corruption makes of the verse: the space before the sentinel went with the masked word (byte-level BPE: 'Ġheaven'),
    so the sentinel takes no stray 'Ġ' of its own, which a model never saw in training."""
    v = check_t5_tokenizer("demo-t5")
    tok = v.tokenizer
    verse = tok.encode("In the beginning God created the heaven and the earth.")
    heaven = tok.encode(" heaven")
    at = next(i for i in range(len(verse)) if verse[i:i + len(heaven)] == heaven)
    mask = [at <= i < at + len(heaven) for i in range(len(verse))]
    inp, tgt = corrupt(verse, mask, v.sentinels, v.eos)
    prompt = tok.encode("In the beginning God created the <extra_id_0> and the earth.") + [v.eos]
    assert prompt == inp.tolist()
    assert tgt.tolist() == [v.sentinels[0], *heaven, v.eos]


def test_span_rule_says_what_decoder_length_is_needed():
    cfg = preset("t5-tiny", **{"model.decoder_seq_length": 10})
    (field, rule, fix), = [p for p in span_problems(cfg)]
    assert field == "model.decoder_seq_length" and "decoder_seq_length >= " in fix
    assert FAMILIES["t5"].supports.generation


def test_a_local_t5_style_tokenizer_directory_is_found(tmp_path):
    """A local HF T5-style tokenizer (</s>, <pad>, <unk>, <extra_id_i>) works as data.tokenizer, offline."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<pad>", "</s>", "<unk>"] + [f"<extra_id_{i}>" for i in range(100)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["in the beginning god created the heaven and the earth"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}))
    v = check_t5_tokenizer(str(tmp_path))
    assert (v.pad, v.eos) == (0, 1) and v.sentinels[:2] == [3, 4] and len(v.sentinels) == 100
    problems = preset("t5-tiny", **{"data.tokenizer": str(tmp_path)}).validate()
    assert problems == []


def test_hf_export_of_a_corpus_trained_checkpoint_carries_its_tokenizers_special_ids():
    """A T5 trained on the corpus with ``demo-t5`` (pad 1, EOS 0) exports a config HF ``generate`` starts the
    decoder with pad 1 and stops at EOS 0, as training and the workbench's generation did; synthetic data's ids
    are HF T5's defaults; an imported HF config's ids win."""
    from workbench.models.t5.hf import hf_config_dict_from_run

    demo = preset("t5-tiny", **{"data.source": "demo"})
    v = check_t5_tokenizer("demo-t5")
    out = hf_config_dict_from_run(demo, "t5")
    assert (out["pad_token_id"], out["eos_token_id"], out["decoder_start_token_id"]) == (v.pad, v.eos, v.pad) == (1, 0, 1)
    synthetic = hf_config_dict_from_run(preset("t5-tiny", **{"data.source": "synthetic"}), "t5")
    assert (synthetic["pad_token_id"], synthetic["eos_token_id"], synthetic["decoder_start_token_id"]) == (0, 1, 0)
    imported = hf_config_dict_from_run(demo, "t5", {"pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0})
    assert (imported["pad_token_id"], imported["eos_token_id"]) == (0, 1)
