"""Generation engine vs HF transformers on the same random GPT-2 (CPU, one process).

The mcore model is the workbench's own (``build_model``: its layer spec, SDPA core
attention) with the HF weights mapped by ``workbench.conversion``; HF ``generate`` is the oracle for greedy,
beam search (scores included) and log-probs.  EOS ids are picked from the model's own
greedy output so the stop paths are really exercised.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import (
    POSITIONS,
    VOCAB,
    gpt2_run_config,
    hf_gpt2,
    converted_state,
    init_single_process,
    load_into,
    teardown_single_process,
    workbench_gpt,
)
from workbench.config import ConfigError, GenerationConfig

PROMPTS = [[5, 17, 300, 42, 9], [7, 8], [100, 200, 300, 400, 500, 600, 700, 800], [33]]


@pytest.fixture(scope="module")
def setup():
    hf = hf_gpt2(seed=0)
    cfg = gpt2_run_config(hf)
    was = init_single_process(cfg)
    model = workbench_gpt(cfg)
    load_into(model, converted_state(hf, cfg))
    from workbench.backend.decoding import InferenceEngine

    engine = InferenceEngine(model, vocab_size=VOCAB, max_positions=POSITIONS, eos_id=None, pad_id=0)
    yield engine, hf, model
    teardown_single_process(was)


def _hf_batch(prompts):
    from workbench.backend.decoding import left_pad

    ids, valid = left_pad(prompts, 0)
    return ids, valid.long()


def _cut(seq: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in seq:
        return seq[: seq.index(eos) + 1]
    return seq


def _hf_greedy(hf, prompts, n, eos=None, **kw):
    ids, mask = _hf_batch(prompts)
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                      eos_token_id=eos, **kw)
    return out, ids.shape[1]


def test_greedy_matches_hf_generate_batched_different_lengths(setup):
    engine, hf, _ = setup
    outs = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=20, greedy=True), stop_ids=[])
    hout, width = _hf_greedy(hf, PROMPTS, 20)
    for i, o in enumerate(outs):
        assert o.token_ids == hout[i, width:].tolist(), f"prompt {i}"
        assert o.finish_reason == "length" and o.prompt_ids == PROMPTS[i]
    # and one prompt alone gives the same continuation as inside the padded batch
    alone = engine.generate([PROMPTS[1]], GenerationConfig(max_new_tokens=20, greedy=True), stop_ids=[])
    assert alone[0].token_ids == outs[1].token_ids


def test_greedy_stops_at_eos_like_hf(setup):
    engine, hf, _ = setup
    free = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=12, greedy=True), stop_ids=[])
    eos = free[0].token_ids[3]  # a token the model really emits mid-sequence
    outs = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=12, greedy=True), stop_ids=[eos])
    hout, width = _hf_greedy(hf, PROMPTS, 12, eos=eos)
    stopped = 0
    for i, o in enumerate(outs):
        assert o.token_ids == _cut(hout[i, width:].tolist(), eos)
        if eos in o.token_ids:
            stopped += 1
            assert o.finish_reason == "stop" and o.token_ids[-1] == eos
    assert stopped >= 1
    # stop_token in the config acts like EOS
    via_cfg = engine.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=12, greedy=True, stop_token=eos))
    assert via_cfg[0].token_ids == outs[0].token_ids and via_cfg[0].finish_reason == "stop"


@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
def test_beam_search_matches_hf_beam_search(setup, length_penalty):
    engine, hf, _ = setup
    greedy = engine.generate(PROMPTS, GenerationConfig(max_new_tokens=10, greedy=True), stop_ids=[])
    eos = greedy[1].token_ids[1]
    gen = GenerationConfig(max_new_tokens=10, num_beams=4, length_penalty=length_penalty)
    outs = engine.generate(PROMPTS, gen, stop_ids=[eos])
    ids, mask = _hf_batch(PROMPTS)
    hout = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_beams=4,
                       length_penalty=length_penalty, pad_token_id=0, eos_token_id=eos, output_scores=True,
                       return_dict_in_generate=True)
    width = ids.shape[1]
    for i, o in enumerate(outs):
        assert o.token_ids == _cut(hout.sequences[i, width:].tolist(), eos), f"prompt {i}"
        assert o.score == pytest.approx(hout.sequences_scores[i].item(), abs=1e-4)
    if length_penalty < 1.0:  # short hypotheses win: the EOS path of the beam bookkeeping is exercised
        assert any(o.finish_reason == "stop" for o in outs)


def test_log_probs_match_hf_scores(setup):
    engine, hf, _ = setup
    outs = engine.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=6, greedy=True, return_log_probs=True), stop_ids=[])
    hout, width = _hf_greedy(hf, PROMPTS[:2], 6, output_logits=True, return_dict_in_generate=True)
    for i, o in enumerate(outs):
        want = [torch.log_softmax(step[i].float(), -1)[tok].item() for step, tok in zip(hout.logits, o.token_ids)]
        assert o.log_probs == pytest.approx(want, abs=1e-4)
        assert all(lp <= 0 for lp in o.log_probs)


def test_seeded_sampling_is_reproducible_and_seed_dependent(setup):
    engine, _, _ = setup
    gen = GenerationConfig(max_new_tokens=16, top_k=50, temperature=1.5, seed=7)
    a = [o.token_ids for o in engine.generate(PROMPTS, gen, stop_ids=[])]
    b = [o.token_ids for o in engine.generate(PROMPTS, gen, stop_ids=[])]
    c = [o.token_ids for o in engine.generate(PROMPTS, GenerationConfig(max_new_tokens=16, top_k=50, temperature=1.5, seed=8), stop_ids=[])]
    assert a == b
    assert a != c


def _next_token_logits(hf, prefix: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prefix])).logits[0, -1]


def test_top_k_samples_only_among_the_k_best(setup):
    engine, hf, _ = setup
    out = engine.generate([PROMPTS[0]], GenerationConfig(max_new_tokens=8, top_k=3, temperature=2.0, seed=3), stop_ids=[])[0]
    prefix = list(PROMPTS[0])
    picked_non_argmax = False
    for tok in out.token_ids:
        top = torch.topk(_next_token_logits(hf, prefix), 3).indices.tolist()
        assert tok in top
        picked_non_argmax |= tok != top[0]
        prefix.append(tok)
    assert picked_non_argmax  # temperature 2 over 3 candidates: sampling, not argmax


def test_top_p_decays_to_its_bound(setup):
    """top_p 0.99 decays by 0.01 per token to the bound 0.001 (the uniform probability over the
    1000-token vocabulary): from the third token on only the argmax survives the nucleus, so
    the tail equals greedy given the same prefix, while the first token is really sampled."""
    engine, hf, _ = setup
    gen = GenerationConfig(max_new_tokens=8, top_p=0.99, top_p_decay=0.01, top_p_bound=0.001, seed=11)
    out = engine.generate([PROMPTS[2]], gen, stop_ids=[])[0]
    prefix = list(PROMPTS[2])
    for t, tok in enumerate(out.token_ids):
        argmax = int(torch.argmax(_next_token_logits(hf, prefix)))
        if t == 0:
            assert tok != argmax  # seed 11 samples away from the mode at top_p 0.99
        if t >= 2:
            assert tok == argmax
        prefix.append(tok)


def test_top_p_filter_keeps_smallest_nucleus():
    from workbench.backend.decoding import filter_top_p

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(filter_top_p(probs.log(), 0.7))[0].tolist()
    assert kept == [True, True, False, False]
    kept = torch.isfinite(filter_top_p(probs.log(), 0.1))[0].tolist()
    assert kept == [True, False, False, False]


def test_prefill_logits_match_the_models_own_forward(setup):
    """The engine's cached attention gives the same next-token logits as GPTModel.forward (SDPA module)."""
    engine, _, model = setup
    from workbench.backend.decoding import KVCache

    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        ref = model(prompt, torch.arange(prompt.shape[1])[None], None)[0, -1, :VOCAB]
    r = engine.runner
    n = prompt.shape[1]
    cache = KVCache(len(r.layers), 1, r.groups, n + 1, r.head_dim, r.dtype, r.device)
    cache.valid[:, :n] = True
    causal = torch.ones(n, n + 1, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        got = r.forward(prompt, None, torch.arange(n)[None], cache, torch.arange(n), causal & cache.valid[:, None, None])
    torch.testing.assert_close(got[0], ref.float(), atol=1e-4, rtol=1e-4)


def test_engine_rejects_bad_input(setup):
    engine, _, _ = setup
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[1, 2], []], GenerationConfig(max_new_tokens=2, greedy=True))
    with pytest.raises(ValueError, match="positions"):
        engine.generate([[1] * (POSITIONS - 2)], GenerationConfig(max_new_tokens=5, greedy=True))
    with pytest.raises(ConfigError, match="temperature"):
        engine.generate([[1, 2]], GenerationConfig(temperature=0.0))
    with pytest.raises(ConfigError, match="num_beams"):
        engine.generate([[1, 2]], GenerationConfig(num_beams=3, top_p=0.9))
