"""The advisor's enumeration: every layout it lists validates, and it misses none the validator accepts."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from workbench.advisor.enumerate import apply_layout, canonical, enumerate_layouts, fp8_recipes, layout_of
from workbench.config import preset, validate


def _small(name: str, **over):
    # tiny shapes, bf16 on CUDA (FP8 recipes become possible where the kernel rule runs them)
    base = {"parallel.device": "cuda", "train.precision": "bf16", "train.compile_kernels": True,
            "train.global_batch_size": 8, "train.micro_batch_size": 1}
    return preset(name, **{**base, **over})


@pytest.mark.parametrize("name", ["tiny", "t5-tiny", "bert-tiny"])
def test_every_enumerated_layout_validates_and_is_what_it_says(name):
    cfg = _small(name)
    found = enumerate_layouts(cfg, 4)
    assert found
    for lay, c in found:
        assert validate(c) == [], lay.label()
        assert layout_of(c) == lay
        assert c.parallel.world_size == 4 and lay.gpus == 4
    if name == "t5-tiny":  # the family's supports: T5 has no pipeline parallelism
        assert {lay.pp for lay, _ in found} == {1}
    else:
        assert {lay.pp for lay, _ in found} >= {1, 2, 4}


@pytest.mark.parametrize("name", ["tiny", "t5-tiny"])
def test_brute_force_finds_no_valid_layout_the_enumeration_misses(name):
    """Every combination of raw values over a wider space than the grid's (sizes that divide nothing, VPP past the
    layers, micro-batches that do not divide the batch): each one the validator accepts is listed (canonically)."""
    cfg = _small(name, **{"model.num_layers": 4})
    listed = {lay for lay, _ in enumerate_layouts(cfg, 4)}
    seen_valid = 0
    for tp, pp, cp, vpp, sp, dopt, rc, mbs, fp8 in itertools.product(
            range(1, 5), range(1, 5), (1, 2, 3, 4), (None, 2, 3, 4), (False, True), (False, True),
            ("none", "selective", "full"), range(1, 9), fp8_recipes()):
        if tp * pp * cp > 4:  # more model-parallel ranks than GPUs: the validator refuses it first
            continue
        p = dataclasses.replace(cfg.parallel, tensor_parallel=tp, pipeline_parallel=pp, context_parallel=cp,
                                virtual_pipeline_parallel=vpp, sequence_parallel=sp, distributed_optimizer=dopt,
                                recompute=rc, nproc_per_node=4, overlap_grad_reduce=False, overlap_param_gather=False)
        c = dataclasses.replace(cfg, parallel=p, train=dataclasses.replace(cfg.train, micro_batch_size=mbs, fp8=fp8))
        if validate(c):
            continue
        seen_valid += 1
        assert canonical(layout_of(c)) in listed, layout_of(c).label()
    assert seen_valid >= len(listed)  # the listing is not larger than what is valid (each listed one is valid above)


def test_layout_overrides_round_trip_through_the_config():
    cfg = _small("tiny")
    for lay, c in enumerate_layouts(cfg, 4)[::37]:
        via_replace = cfg.replace(**lay.overrides(4))
        assert via_replace.to_dict() == c.to_dict()


def test_fixed_choices_overlap_on_where_dp_and_equivalent_distopt_listed_once():
    cfg = _small("tiny")
    found = enumerate_layouts(cfg, 4)
    for lay, c in found:
        grads = lay.dp * lay.cp > 1  # the gradient reduce and the distributed optimizer span DP x CP
        assert c.parallel.overlap_grad_reduce == grads
        assert c.parallel.overlap_param_gather == (grads and lay.distributed_optimizer)
        assert not (not grads and lay.distributed_optimizer)


def test_enumeration_count_at_scale_completes():
    """Llama-3.1-8B, global batch 128, 8 GPUs: a few thousand layouts (the advisor's speed case)."""
    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 128})
    found = enumerate_layouts(cfg, 8)
    assert 3000 < len(found) < 12000  # 10,848 since FP8 runs under CP (the compiled layer serves it)
    assert all(lay.tp <= 8 and lay.gpus == 8 for lay, _ in found)


def test_tensor_parallel_stays_inside_a_node():
    cfg = preset("llama3.1-8b", **{"train.global_batch_size": 64})
    found = enumerate_layouts(cfg, 16, nodes=4)
    assert max(lay.tp for lay, _ in found) == 4
    assert all(c.parallel.nnodes == 4 and c.parallel.nproc_per_node == 4 for _, c in found)
    with pytest.raises(ValueError, match="split evenly"):
        enumerate_layouts(cfg, 10, nodes=4)


def test_apply_layout_keeps_the_model_and_batch():
    cfg = _small("tiny")
    lay, c = enumerate_layouts(cfg, 2)[-1]
    assert c.model == cfg.model and c.train.global_batch_size == cfg.train.global_batch_size
    assert apply_layout(cfg, lay, 2).to_dict() == c.to_dict()


def test_a_context_parallel_base_gets_candidates_with_and_without_cp():
    """A base config at CP=2 gets valid candidates at CP 1, 2 and 4, each the layout its label says (dp counted over
    the world left after TP x CP x PP)."""
    cfg = _small("tiny", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2})
    found = enumerate_layouts(cfg, 4)
    assert {lay.cp for lay, _ in found} == {1, 2, 4}
    for lay, c in found:
        assert c.parallel.context_parallel == lay.cp and validate(c) == [], lay.label()
        assert layout_of(c) == lay and lay.tp * lay.cp * lay.pp * lay.dp == 4
        assert ("cp" in lay.label()) == (lay.cp > 1)
