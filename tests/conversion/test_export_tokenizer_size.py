"""``megatron-to-hf`` checks the tokenizer it ships against the model, as ``hf-to-megatron`` does: one with
more ids than the model's vocabulary (the 4,096-token demo tokenizer on a 1,000-token model) is refused with
exit 2 and the reason, leaving no output; a smaller one is exported with a warning."""

from __future__ import annotations

from tests.support import VOCAB


def test_a_tokenizer_larger_than_the_model_is_refused_on_export(gpt2_checkpoint, tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "hf"
    rc = main(["convert", "megatron-to-hf", "--ckpt", str(gpt2_checkpoint), "--out", str(out), "--tokenizer", "demo", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2, err  # before: exported without a word
    assert f"the tokenizer has 4096 tokens but the model's vocabulary is {VOCAB}" in err, err
    assert f"ids >= {VOCAB} have no embedding" in err and "--tokenizer DIR" in err, err
    assert not out.exists()


def test_the_checkpoint_s_smaller_tokenizer_is_exported_with_a_warning(gpt2_checkpoint, tmp_path, capsys):
    from workbench.cli import main

    out = tmp_path / "hf"
    assert main(["convert", "megatron-to-hf", "--ckpt", str(gpt2_checkpoint), "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: the tokenizer has " in err and f" tokens, the model {VOCAB}: generated ids >= " in err, err
    assert (out / "tokenizer.json").exists()
