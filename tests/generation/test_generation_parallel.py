"""Generation from a real checkpoint through the real entry point, at TP=2 and PP=2 (gloo, CPU).

A random GPT-2 with a small trained tokenizer is converted by ``workbench convert``'s API into
a workbench checkpoint, then generated from by ``python -m workbench.rank.inference``
started by torchrun (2 processes) -- the product path -- and compared with the same model
generating in this process at TP=1: seeded sampling must give the same tokens at TP=2, and
beam search the same beams across two pipeline stages.  Bad input must be refused before
any process starts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import VOCAB, hf_gpt2, init_single_process, teardown_single_process
from workbench.config import ConfigError, GenerationConfig

PROMPTS = [[11, 12, 13, 14, 15, 16], [900, 3], [250, 251, 252, 253]]
TEXTS = ["the cat sat on the mat", "a dog"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(checkpoint root, in-process engine at TP=1 loaded from it, tokenizer).

    Product path end to end: an HF GPT-2 directory (random weights + a small trained
    tokenizer) -> ``workbench.conversion.hf_to_megatron`` -> workbench checkpoint."""
    root = tmp_path_factory.mktemp("gen-ckpt")
    from workbench.conversion import hf_to_megatron
    from workbench.data.tokenizer import train_tokenizer

    corpus = ["the cat sat on the mat", "a dog ran in the park", "the quick brown fox jumps over the lazy dog"] * 20
    hf_dir = root / "hf"
    hf_gpt2(seed=1).save_pretrained(hf_dir)
    tok = train_tokenizer(corpus, vocab_size=400, out_dir=hf_dir)
    assert tok.vocab_size <= VOCAB
    res = hf_to_megatron(hf_dir, root / "ckpt", dtype="fp32", device="cpu", make_vocab_size_divisible_by=128, progress=False)
    from workbench.rank.inference import _checkpoint_config, load_engine

    cfg = _checkpoint_config(res.output)
    was = init_single_process(cfg.replace(**{"model.attention_backend": "sdpa", "parallel.nproc_per_node": 1}))
    engine = load_engine(res.output, device="cpu")
    assert engine.eos_id == tok.eod and engine.tokenizer is not None
    yield res.output, engine, tok
    teardown_single_process(was)


def test_seeded_sampling_same_tokens_at_tp1_and_tp2(ckpt, tmp_path):
    from workbench.generation import compare

    root, engine, _ = ckpt
    gen = GenerationConfig(max_new_tokens=12, top_k=40, temperature=1.3, seed=2024, return_log_probs=True)
    other_seed = GenerationConfig(max_new_tokens=12, top_k=40, temperature=1.3, seed=2025)
    here = engine.generate(PROMPTS, gen)
    runs = compare(root, None, {"first": gen, "again": gen, "other": other_seed}, prompt_ids=PROMPTS, tp=2, pp=1,
                   device="cpu", work_dir=tmp_path, timeout=300)
    tp2 = runs["first"]
    assert [r.token_ids for r in tp2] == [o.token_ids for o in here]
    assert [r.token_ids for r in runs["again"]] == [o.token_ids for o in here]  # same seed, second run
    assert [r.token_ids for r in runs["other"]] != [o.token_ids for o in here]
    for r, o in zip(tp2, here):
        assert r.log_probs == pytest.approx(o.log_probs, abs=1e-4)
    request = json.loads((tmp_path / "request.json").read_text())
    assert request["prompt_ids"] == PROMPTS and request["runs"]["first"]["seed"] == 2024


def test_beam_search_across_two_pipeline_stages(ckpt, tmp_path):
    from workbench.generation import generate

    root, engine, _ = ckpt
    gen = GenerationConfig(max_new_tokens=8, num_beams=3, length_penalty=0.7)
    here = engine.generate(PROMPTS, gen)
    pp2 = generate(root, prompt_ids=PROMPTS, gen=gen, tp=1, pp=2, device="cpu", work_dir=tmp_path, timeout=300)
    assert [r.token_ids for r in pp2] == [o.token_ids for o in here]
    assert [r.score for r in pp2] == pytest.approx([o.score for o in here], abs=1e-4)


def test_cli_generates_text_with_the_checkpoint_tokenizer(ckpt, tmp_path):
    root, engine, tok = ckpt
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "generate", "--ckpt", str(root), "--prompt", TEXTS[0],
                           "--prompt", TEXTS[1], "--greedy", "--max-new-tokens", "6", "--device", "cpu", "--json",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    here = engine.generate([tok.encode(t) for t in TEXTS], GenerationConfig(max_new_tokens=6, greedy=True))
    assert [r["token_ids"] for r in results] == [o.token_ids for o in here]
    assert [r["prompt_ids"] for r in results] == [tok.encode(t) for t in TEXTS]
    # the random 1,000-token model generates ids past this 400-token tokenizer: shown as <id:N>, never as nothing
    from workbench.data.tokenizer import decode_visible

    assert results[0]["text"] == decode_visible(tok, results[0]["token_ids"])
    assert all(f"<id:{t}>" in results[0]["text"] for t in results[0]["token_ids"] if t >= tok.vocab_size)
    assert f"{tok.vocab_size} tokens but the model 1000" in proc.stderr  # and said before generating
    assert results[0]["prompt"] == TEXTS[0]


@pytest.mark.parametrize("argv, needle", [
    (["--prompt", ""], "empty prompt"),
    (["--prompt", "the cat " * 200], "longer than the model's"),
    (["--prompt", "a dog", "--top-k", "5", "--top-p", "0.9"], None),  # argparse: mutually exclusive
    (["--prompt", "a dog", "--temperature", "0"], "temperature"),
    (["--prompt", "a dog", "--num-beams", "4", "--top-k", "5"], "num_beams"),
    (["--prompt", "a dog", "--max-new-tokens", "95"], "max_new_tokens"),
    (["--prompt", "a dog", "--stop-token", "5000"], "stop_token"),
    (["--prompt", "a dog", "--top-p", "0.9", "--top-p-decay", "1.5"], "top_p_decay"),
])
def test_cli_bad_input_exits_2_before_any_process_starts(ckpt, monkeypatch, capsys, argv, needle):
    from workbench import cli, generation

    root, _, _ = ckpt
    started = []
    monkeypatch.setattr(generation, "run_supervised", lambda *a, **k: started.append(a) or pytest.fail("a process was started"))
    try:
        code = cli.main(["generate", "--ckpt", str(root), "--device", "cpu", *argv])
    except SystemExit as e:  # argparse usage errors
        code = e.code
    assert code == 2 and not started
    if needle:
        assert needle in capsys.readouterr().err


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    from workbench import cli

    assert cli.main(["generate", "--ckpt", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    with pytest.raises(ConfigError, match="does not exist"):
        from workbench.generation import generate

        generate(tmp_path / "nope", ["hi"])


def test_cli_prompts_file_is_read_and_checked_before_launch(ckpt, tmp_path, monkeypatch, capsys):
    from workbench import cli, generation

    root, _, _ = ckpt
    monkeypatch.setattr(generation, "run_supervised", lambda *a, **k: pytest.fail("a process was started"))
    txt = tmp_path / "prompts.txt"
    txt.write_text("a dog\n\n" + "the cat " * 200 + "\n")
    assert cli.main(["generate", "--ckpt", str(root), "--prompts-file", str(txt), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "prompts[1]" in err and "prompts[0]" not in err  # blank line skipped, the long prompt is the second
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a dog"}\nnot json\n')
    assert cli.main(["generate", "--ckpt", str(root), "--prompts-file", str(jsonl)]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err
    assert cli.main(["generate", "--ckpt", str(root), "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "file not found" in capsys.readouterr().err
