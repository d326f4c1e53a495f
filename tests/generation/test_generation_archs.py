"""The engine's KV cache against the model's own full forward, for the architectures HF GPT-2
does not cover: RoPE + grouped-query attention + SwiGLU + RMSNorm (Llama-like) and ALiBi.

Teacher forcing: greedy tokens generated with the cache (batched, left-padded) must be the
argmax of ``GPTModel.forward`` (the workbench SDPA attention module, no cache) run on each
prompt alone plus the tokens generated so far, and the cached log-probs must equal the
full forward's.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import init_single_process, teardown_single_process, workbench_gpt
from workbench.config import GenerationConfig, preset

PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 9], [100, 101, 102, 103]]
VOCAB = 500


def _cfg(kind: str):
    over = {"model.num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.vocab_size": VOCAB,
            "model.max_position_embeddings": 64, "model.seq_length": 32, "model.make_vocab_size_divisible_by": 64,
            "model.init_method_std": 0.2, "model.attention_backend": "sdpa", "parallel.device": "cpu",
            "train.precision": "fp32", "train.compile_kernels": False, "train.micro_batch_size": 1,
            "train.global_batch_size": 1, "data.source": "synthetic"}
    if kind == "llama":
        over.update({"model.num_query_groups": 2, "model.ffn_hidden_size": 128})
        return preset("llama-small", **over)
    over.update({"model.position_embedding": "alibi"})
    return preset("tiny", **over)


@pytest.fixture(scope="module")
def parallel():
    was = init_single_process(_cfg("llama"))
    yield
    teardown_single_process(was)


@pytest.mark.parametrize("kind", ["llama", "alibi"])
def test_cached_greedy_equals_full_forward_argmax(parallel, kind):
    from workbench.backend.decoding import InferenceEngine

    torch.manual_seed(0)
    cfg = _cfg(kind)
    model = workbench_gpt(cfg)
    engine = InferenceEngine(model, vocab_size=VOCAB, max_positions=64, pad_id=0)
    outs = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=8, greedy=True, return_log_probs=True), stop_ids=[])
    for prompt, out in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(seq, torch.arange(seq.shape[1])[None], None)[0, :, :VOCAB].float()
        n = len(prompt)
        steps = logits[n - 1: n - 1 + len(out.token_ids)]
        assert out.token_ids == steps.argmax(-1).tolist()
        want = torch.log_softmax(steps, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert out.log_probs == pytest.approx(want.tolist(), abs=1e-4)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # not a degenerate model


def test_beam_search_reorders_the_cache_consistently(parallel):
    """Every returned beam's reported log-probs equal a fresh full forward over that beam."""
    from workbench.backend.decoding import InferenceEngine

    torch.manual_seed(1)
    model = workbench_gpt(_cfg("llama"))
    engine = InferenceEngine(model, vocab_size=VOCAB, max_positions=64, pad_id=0)
    outs = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=6, num_beams=3, return_log_probs=True), stop_ids=[])
    for prompt, out in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(seq, torch.arange(seq.shape[1])[None], None)[0, :, :VOCAB].float()
        n = len(prompt)
        lp = torch.log_softmax(logits[n - 1: n - 1 + len(out.token_ids)], -1)
        want = lp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert out.log_probs == pytest.approx(want.tolist(), abs=1e-4)
        assert out.score == pytest.approx(sum(out.log_probs) / len(out.token_ids), abs=1e-4)  # length_penalty 1
