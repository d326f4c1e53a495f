"""A conversion carries the model's tokenizer or says loudly that it has none; a tokenizer
larger than the model's vocabulary is refused; generation never prints an undecodable id as nothing."""

from __future__ import annotations

import pytest

from tests.support import (VOCAB, converted_state, gpt2_run_config, hf_gpt2, init_single_process, load_into,
                           teardown_single_process, workbench_gpt)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    hf_gpt2(seed=1).save_pretrained(d)
    return d


def _small_tokenizer(out_dir, vocab=300):
    from workbench.data.tokenizer import train_tokenizer

    docs = ["the cat sat on the mat and the dog ran far away " * 8, "a quick brown fox jumps over lazy dogs " * 8] * 20
    return train_tokenizer(iter(docs), vocab_size=vocab, out_dir=out_dir)


def test_model_without_tokenizer_records_none_and_warns(hf_dir, tmp_path, capsys):
    from workbench.cli import main
    from workbench.config import ConfigError, GenerationConfig
    from workbench.generation import checkpoint_info, prepare_request

    assert main(["convert", "hf-to-megatron", "--hf", str(hf_dir), "--out", str(tmp_path / "mc"), "--device", "cpu", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: no tokenizer files" in err and f"the model has {VOCAB} tokens" in err
    info = checkpoint_info(tmp_path / "mc")
    assert info.config.data.tokenizer == ""  # not the base config's 4,096-token demo tokenizer
    with pytest.raises(ConfigError, match="records no tokenizer"):
        prepare_request(info, ["hello"], GenerationConfig(max_new_tokens=4))


def test_tokenizer_larger_than_the_model_is_refused(hf_dir, tmp_path):
    import shutil

    from workbench.conversion import hf_to_megatron
    from workbench.models.common.conversion_rules import ConversionError
    from workbench.data.tokenizer import load_tokenizer

    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    load_tokenizer("demo").save(src)  # 4,096 tokens on a 1,000-token model
    with pytest.raises(ConversionError, match=f"4096 tokens but the model's vocabulary is {VOCAB}"):
        hf_to_megatron(src, tmp_path / "out", device="cpu", progress=False)
    assert not (tmp_path / "out").exists()


def test_smaller_tokenizer_warns_and_generation_shows_undecodable_ids(hf_dir, tmp_path):
    import shutil

    from workbench.config import GenerationConfig
    from workbench.conversion import hf_to_megatron
    from workbench.generation import checkpoint_info, prepare_request

    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    tok = _small_tokenizer(src)
    res = hf_to_megatron(src, tmp_path / "out", device="cpu", progress=False)
    assert res.config.data.tokenizer == str(res.output / "tokenizer")
    assert any(n.startswith("WARNING: the tokenizer has 300 tokens, the model 1000") for n in res.notes)
    with pytest.warns(UserWarning, match="300 tokens but the model 1000"):
        prepare_request(checkpoint_info(res.output), ["the cat"], GenerationConfig(max_new_tokens=4))

    # the real engine on the model: ids >= 300 (most of a random 1,000-token model's) are shown, not dropped
    from workbench.backend.decoding import InferenceEngine

    hf = hf_gpt2(seed=1)
    cfg = gpt2_run_config(hf)
    was = init_single_process(cfg)
    try:
        model = workbench_gpt(cfg)
        load_into(model, converted_state(hf, cfg))
        engine = InferenceEngine(model, vocab_size=VOCAB, max_positions=64, tokenizer=tok, eos_id=None, pad_id=0)
        outs = engine.generate([tok.encode("the cat"), [5, 6]], GenerationConfig(max_new_tokens=12, greedy=True))
    finally:
        teardown_single_process(was)
    for o in outs:
        assert o.text, o
        for t in o.token_ids:
            if t >= 300:
                assert f"<id:{t}>" in o.text
    assert any(t >= 300 for o in outs for t in o.token_ids)


def test_decode_visible_keeps_decodable_text_exact():
    from workbench.data.tokenizer import load_tokenizer
    from workbench.data.tokenizer import decode_visible

    tok = load_tokenizer("demo")
    ids = tok.encode("In the beginning God created")
    assert decode_visible(tok, ids) == tok.decode(ids)
    assert decode_visible(tok, [5000, 40000]) == "<id:5000><id:40000>"
    assert decode_visible(tok, ids[:2] + [4096] + ids[2:]) == tok.decode(ids[:2]) + "<id:4096>" + tok.decode(ids[2:])
