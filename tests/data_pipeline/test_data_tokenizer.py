"""Tokenizers: the shipped demo BPE, local training, HF export, and refusing what cannot load offline."""

from __future__ import annotations

import json
import pickle
import random

import pytest

from workbench.cli import main as cli_main
from workbench.config import preset
from workbench.data.errors import DataError
from workbench.data.tokenizer import load_tokenizer, train_tokenizer

SAMPLES = [
    "In the beginning God created the heaven and the earth.",
    "Unicode survives a byte-level BPE: naïve café, Ωμέγα, 日本語, emoji 🚀 and tabs\tand\nnewlines.",
    "   leading spaces and trailing ones   ",
    "an <|endoftext|> inside the text round-trips too",
]


def _corpus(n_docs: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog river mountain light dark sea land tree".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "." for _ in range(n_docs)]


def test_demo_tokenizer_specials_and_fit_with_presets():
    tok = load_tokenizer("demo")
    assert tok.name == "demo"
    assert tok.token_to_id("<|endoftext|>") == tok.eod
    assert tok.token_to_id("<pad>") == tok.pad
    assert tok.pad != tok.eod  # megatron-core masks pad ids: they must not collide with EOD
    for name in ("tiny", "demo-small"):  # the presets that train on the demo corpus must fit its ids
        assert tok.vocab_size <= preset(name).model.vocab_size
    ids = tok.encode("And God said, Let there be light")
    assert all(0 <= i < tok.vocab_size for i in ids)
    # a BPE trained on the corpus compresses its own text well below one token per character
    assert len(ids) < len("And God said, Let there be light") / 2.5


@pytest.mark.parametrize("text", SAMPLES)
def test_demo_round_trip_is_lossless(text):
    tok = load_tokenizer("demo")
    assert tok.decode(tok.encode(text)) == text


def test_train_save_and_reload_through_transformers(tmp_path):
    from transformers import AutoTokenizer

    docs = _corpus()
    tok = train_tokenizer(iter(docs), vocab_size=320, out_dir=tmp_path / "tok")
    assert 258 < tok.vocab_size <= 320
    assert tok.decode(tok.encode(SAMPLES[1])) == SAMPLES[1]
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    again = load_tokenizer(tmp_path / "tok")
    again_file = load_tokenizer(tmp_path / "tok" / "tokenizer.json")
    for text in docs[:20] + SAMPLES[:2]:
        ids = tok.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ids
        assert again.encode(text) == ids == again_file.encode(text)
    assert hf.eos_token_id == tok.eod == again.eod
    assert hf.pad_token_id == tok.pad


def test_demo_tokenizer_exports_for_hf(tmp_path):
    from transformers import AutoTokenizer

    tok = load_tokenizer("demo")
    tok.save(tmp_path / "export")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    text = SAMPLES[0]
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text


def test_tokenizer_pickles_for_worker_processes():
    tok = load_tokenizer("demo")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(SAMPLES[1]) == tok.encode(SAMPLES[1])
    assert (clone.eod, clone.pad, clone.vocab_size) == (tok.eod, tok.pad, tok.vocab_size)
    assert json.dumps(clone.unique_identifiers) == json.dumps(tok.unique_identifiers)


def test_unique_identifiers_change_with_the_vocabulary(tmp_path):
    a = train_tokenizer(iter(_corpus(seed=1)), vocab_size=300)
    b = train_tokenizer(iter(_corpus(seed=2) + ["zebra xylophone quartz"] * 50), vocab_size=300)
    assert a.unique_identifiers["sha"] != b.unique_identifiers["sha"]


@pytest.mark.parametrize("spec, needle", [
    ("gpt2", "nothing is downloaded"),
    ("/no/such/tokenizer_dir", "does not exist"),
    ("", "no tokenizer"),
])
def test_unloadable_specs_are_refused_clearly(spec, needle):
    with pytest.raises(DataError) as e:
        load_tokenizer(spec)
    assert needle in str(e.value)


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text("{not json")
    with pytest.raises(DataError) as e:
        load_tokenizer(f)
    assert str(f) in str(e.value)


def test_tokenizer_without_eod_raises_only_when_eod_is_needed(tmp_path):
    tok = train_tokenizer(iter(_corpus()), vocab_size=300, special_tokens=())
    assert not tok.has_eod
    assert tok.decode(tok.encode("the fox")) == "the fox"
    with pytest.raises(DataError, match="end-of-document"):
        tok.eod


def test_cli_tokenizer_train_and_info(tmp_path, capsys):
    src = tmp_path / "corpus.txt"
    src.write_text("\n\n".join(_corpus()), encoding="utf-8")
    rc = cli_main(["tokenizer", "train", "--input", str(src), "--vocab-size", "300", "--out", str(tmp_path / "tok")])
    assert rc == 0
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert load_tokenizer(tmp_path / "tok").vocab_size <= 300
    rc = cli_main(["tokenizer", "info", str(tmp_path / "tok"), "the quick fox"])
    out = capsys.readouterr().out
    assert rc == 0 and '"vocab_size"' in out
    assert cli_main(["tokenizer", "train", "--input", str(tmp_path / "missing.txt"), "--vocab-size", "300", "--out", str(tmp_path / "x")]) == 2
    assert cli_main(["tokenizer", "train", "--input", str(src), "--vocab-size", "10", "--out", str(tmp_path / "x")]) == 2


def test_gpt2_style_directory_loads_through_transformers(tmp_path):
    """A directory with vocab.json + merges.txt (no tokenizer.json), as GPT-2 checkpoints ship."""
    demo = load_tokenizer("demo")
    demo.backend.model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    assert not (tmp_path / "tokenizer.json").exists()
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.eod) == (demo.vocab_size, demo.eod)
    for text in SAMPLES[:2]:
        assert tok.encode(text) == demo.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_directory_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("not a tokenizer")
    with pytest.raises(DataError, match="no tokenizer could be loaded") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_data_modules_import_light():
    """Notebook-side rule: importing workbench.data*, the datasets of a run config and the data CLI pulls in neither
    torch, megatron-core nor tokenizers."""
    import subprocess
    import sys

    code = ("import sys, workbench.data, workbench.datasets, workbench.data_cli, workbench.data.preprocess, "
            "workbench.data.inspect, workbench.data.demo, workbench.data.indexed, workbench.data.tokenizer\n"
            "heavy = [m for m in ('torch', 'megatron', 'tokenizers', 'transformers', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert callable(workbench.data_cli.add_cli) and callable(workbench.datasets.build_datasets)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_wordpiece_export_carries_berts_roles_for_fill_mask(tmp_path):
    from transformers import AutoTokenizer

    tok = load_tokenizer("demo-wordpiece")
    tok.save(tmp_path / "export")
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "export"))
    assert (hf.mask_token, hf.cls_token, hf.sep_token, hf.pad_token, hf.unk_token) == ("[MASK]", "[CLS]", "[SEP]", "[PAD]", "[UNK]")
    assert hf.mask_token_id == tok.token_to_id("[MASK]") and len(hf) == tok.vocab_size
    assert hf("and god said", add_special_tokens=False)["input_ids"] == tok.encode("and god said")


def test_fill_mask_result_quotes_its_candidates():
    from workbench.models.bert.fill_mask import FillMaskResult

    r = FillMaskResult("the [MASK] and the [MASK].", [[("heaven", 0.5), (",", 0.2)], [("earth", 0.4)]])
    assert r.filled == "the heaven and the earth."
    assert str(r) == "the heaven and the earth.    ['heaven' 0.50, ',' 0.20 | 'earth' 0.40]"
