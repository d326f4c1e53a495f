"""A SentencePiece ``.model`` as a tokenizer (T5's format): trained here, offline, on the embedded corpus.

The workbench reads it through transformers' T5 conversion; the token ids must be SentencePiece's
own, the 100 sentinels must be there for span corruption, and a bad file is refused naming it.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest

from workbench.config import preset
from workbench.data.errors import DataError
from workbench.data.tokenizer import load_tokenizer

spm = pytest.importorskip("sentencepiece")


def _lines(n: int) -> list[str]:
    from workbench.data.demo import DEMO_CORPUS

    out = []
    with gzip.open(DEMO_CORPUS, "rt") as f:
        for line in f:
            if line.strip():
                out.append(line.strip())
            if len(out) >= n:
                break
    return out


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines(3000)), model_writer=buf, vocab_size=500, model_type="unigram",
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    path = tmp_path_factory.mktemp("spm") / "kjv-500.model"
    path.write_bytes(buf.getvalue())
    return path


def test_ids_are_sentencepieces_own_and_the_sentinels_follow(spm_model):
    tok = load_tokenizer(spm_model)
    proc = spm.SentencePieceProcessor(model_file=str(spm_model))
    lines = _lines(400)[100:]
    assert [tok.encode(t) for t in lines] == [proc.encode(t) for t in lines]
    assert tok.decode(tok.encode(lines[0])) == proc.decode(proc.encode(lines[0]))
    assert tok.vocab_size == 500 + 100
    # T5's convention: <extra_id_0> is the last id, </s> ends documents, <pad> pads
    assert [tok.token_to_id(f"<extra_id_{i}>") for i in (0, 99)] == [599, 500]
    assert (tok.eod, tok.pad) == (proc.piece_to_id("</s>"), proc.piece_to_id("<pad>"))


def test_t5_data_checks_accept_it_and_a_directory_with_spiece_model_too(spm_model, tmp_path):
    from workbench.families.t5.spans import check_t5_tokenizer

    cfg = preset("t5-tiny", **{"model.vocab_size": 600, "data.tokenizer": str(spm_model)})
    vocab = check_t5_tokenizer(cfg.data.tokenizer, cfg)
    assert len(vocab.sentinels) == 100 and vocab.eos == 1 and vocab.pad == 0
    (tmp_path / "spiece.model").write_bytes(spm_model.read_bytes())  # a saved HF T5 slow tokenizer, minus its config
    assert load_tokenizer(tmp_path).encode("And God said") == load_tokenizer(spm_model).encode("And God said")


def test_preprocess_writes_the_corpus_with_it(spm_model, tmp_path):
    from workbench.data.preprocess import preprocess

    lines = _lines(300)
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(lines) + "\n")
    summary = preprocess([src], tmp_path / "out", tokenizer=str(spm_model), workers=2, progress=False)
    tok = load_tokenizer(spm_model)
    assert summary.documents == len(lines)
    assert summary.tokens == sum(len(tok.encode(t)) + 1 for t in lines)  # + </s> per document
    assert summary.max_token_id < 500  # text never produces a sentinel


def test_a_file_that_is_not_a_sentencepiece_model_is_refused_naming_it(tmp_path):
    bad = tmp_path / "broken.model"
    bad.write_bytes(b"\x00not a protobuf" * 10)
    with pytest.raises(DataError) as e:
        load_tokenizer(bad)
    assert str(bad) in str(e.value) and "SentencePiece" in str(e.value)
