"""The generation front end's length checks come from the model family (``Family.generation_rules``)."""

from __future__ import annotations

import dataclasses

import pytest

from workbench.config import ConfigError, GenerationConfig, preset
from workbench.generation import prepare_request
from workbench.checkpoint import CheckpointInfo


def _info(name: str) -> CheckpointInfo:
    return CheckpointInfo(path="ckpt/iter_0000001", config=preset(name), meta={})


def test_decoder_only_prompt_and_new_tokens_share_the_positions():
    info = _info("tiny")
    limit = info.config.model.max_position_embeddings
    with pytest.raises(ConfigError) as e:
        prepare_request(info, None, GenerationConfig(greedy=True, max_new_tokens=4), prompt_ids=[[1] * 3, [2] * (limit + 1)])
    assert [p.field for p in e.value.problems] == ["prompts[1]"] and "longer than the model's" in str(e.value)
    with pytest.raises(ConfigError) as e:
        prepare_request(info, None, GenerationConfig(greedy=True, max_new_tokens=10), prompt_ids=[[1] * (limit - 5)])
    assert [p.field for p in e.value.problems] == ["generation.max_new_tokens"]
    assert "max_new_tokens <= 5" in str(e.value)
    assert prepare_request(info, None, GenerationConfig(greedy=True, max_new_tokens=5), prompt_ids=[[1] * (limit - 5)])


def test_t5_prompt_goes_to_the_encoder_and_is_not_held_to_max_positions():
    info = _info("t5-tiny")
    limit = info.config.model.max_position_embeddings
    req = prepare_request(info, None, GenerationConfig(greedy=True, max_new_tokens=limit), prompt_ids=[[5] * (3 * limit)])
    assert len(req["prompt_ids"][0]) == 3 * limit
    with pytest.raises(ConfigError) as e:  # the other checks still apply
        prepare_request(info, None, GenerationConfig(greedy=True, max_new_tokens=4), prompt_ids=[[10 ** 6]])
    assert "outside the vocabulary" in str(e.value)


def test_a_context_parallel_checkpoint_runs_at_any_layout_without_cp():
    """Generation (and ``convert verify``) load a CP=2 checkpoint without context parallelism, at its own layout and
    at another one: CP is not a property of the weights."""
    from workbench.generation import layout_problems

    cfg = preset("tiny", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "model.seq_length": 64})
    info = CheckpointInfo(path="ckpt/iter_0000001", config=cfg, meta={})
    assert layout_problems(info, 1, 1, "cpu") == []
    assert layout_problems(info, 2, 1, "cpu") == []
    assert [p.field for p in layout_problems(info, 3, 1, "cpu")] != []  # a layout the model cannot take still fails


def test_every_overlap_refused_without_sequence_parallelism_is_one_generation_ignores():
    """kernel_rule.SP_OVERLAP_FIELDS is the list generation ignores: every parallel flag that, on at TP=2 without SP,
    is refused for want of sequence parallelism is in it (a new such field cannot be missed), and each in it is."""
    from workbench.kernel_rule import SP_OVERLAP_FIELDS

    base = preset("tiny", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.device": "cuda"})
    needs_sp = set()
    for f in dataclasses.fields(base.parallel):
        if f.type in (bool, "bool") and getattr(base.parallel, f.name) is False:
            cfg = base.replace(**{f"parallel.{f.name}": True})
            if any("sequence_parallel" in (p.fix or "") for p in cfg.validate()):
                needs_sp.add(f"parallel.{f.name}")
    assert needs_sp == set(SP_OVERLAP_FIELDS), needs_sp


@pytest.mark.parametrize("field", ["parallel.tp_chunked", "parallel.async_tp"])
def test_a_checkpoint_trained_with_a_tp_overlap_runs_at_any_layout(field):
    """Training's TP overlaps need TP and sequence parallelism, which generation runs without: a checkpoint trained
    with one loads at its own TP and at TP=1."""
    from workbench.generation import layout_problems

    cfg = preset("tiny", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True,
                            "parallel.device": "cuda", field: True})
    info = CheckpointInfo(path="ckpt/iter_0000001", config=cfg, meta={})
    assert layout_problems(info, 1, 1, "cpu") == []
    assert layout_problems(info, 2, 1, "cpu") == []
