"""The tiny MoE trains through megatron-core under gloo: EP=1 and EP=2 (2 ranks) from one initial checkpoint give
the same losses (dropless, no dropout); the loss falls; the router statistics are written and read back.

One 2-rank launch (``tests/support/trainer_runs.py``) runs four trainings in order: ``init`` (EP=1, one step,
saved), then ``ep1``, ``ep2`` (all-to-all dispatcher) and ``ep2-allgather`` each loading ``init``'s weights
(``checkpoint.finetune``: weights only, fresh optimizer) and training 8 steps with a router record every step.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import RunReader

pytestmark = pytest.mark.slow

STEPS = 8


def _cfg(**over):
    base = {"train.train_iters": STEPS, "train.lr_decay_iters": STEPS, "train.eval_interval": 0,
            "train.microbatch_timing_interval": 0, "model.moe.router_stats_interval": 1}
    return preset("moe-tiny", **{**base, **over})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_train")
    init = root / "init"
    load = {"checkpoint.load_dir": str(init / "checkpoints"), "checkpoint.finetune": True}
    plan = {
        init: _cfg(**{"train.train_iters": 1, "train.lr_decay_iters": 1, "train.lr_warmup_iters": 0}),
        root / "ep1": _cfg(**load),
        root / "ep2": _cfg(**load, **{"parallel.expert_parallel": 2}),
        root / "ep2-allgather": _cfg(**load, **{"parallel.expert_parallel": 2, "model.moe.token_dispatcher": "allgather"}),
    }
    run_trainers(plan, nproc=2, timeout=600)
    return {p.name: RunReader(p) for p in plan}


def _losses(reader):
    steps = sorted((r for r in reader.records("step") if r.loss is not None), key=lambda r: (r.iteration, r.rank))
    by_it = {}
    for r in steps:
        by_it.setdefault(r.iteration, r)
    return [by_it[i].loss for i in sorted(by_it)], [by_it[i].grad_norm for i in sorted(by_it)]


def test_ep2_equals_ep1_from_one_checkpoint(runs):
    ref, ref_gn = _losses(runs["ep1"])
    assert len(ref) == STEPS
    for name in ("ep2", "ep2-allgather"):
        got, gn = _losses(runs[name])
        assert len(got) == STEPS, name
        for i, (a, b) in enumerate(zip(ref, got)):
            assert abs(a - b) <= 1e-5 * abs(a), (name, i, a, b)
        for a, b in zip(ref_gn, gn):
            assert abs(a - b) <= 1e-4 * abs(a), (name, ref_gn, gn)


def test_the_moe_loss_falls(runs):
    losses, _ = _losses(runs["ep1"])
    assert losses[-1] < losses[0] - 0.1, losses


def test_router_records_count_every_routed_token_on_every_layout(runs):
    cfg = _cfg()
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    first = {}
    for name in ("ep1", "ep2", "ep2-allgather"):
        recs = runs[name].router()
        assert [r.iteration for r in recs] == list(range(1, STEPS + 1)), name
        assert len({r.rank for r in recs}) == 1  # one rank writes them
        for r in recs:
            assert r.layers == [0, 1]
            assert all(len(row) == cfg.model.moe.num_experts for row in r.tokens_per_expert)
            # dropless: every token's top_k assignments reached an expert, across both ranks and both micro-batches
            assert r.assignments == [tokens * cfg.model.moe.top_k] * 2 and r.dropped == [0, 0]
            assert [sum(row) for row in r.tokens_per_expert] == r.assignments
            assert all(x > 0.5 for x in r.load_balancing_loss) and all(z > 0 for z in r.z_loss)
        first[name] = recs[0]
    # the same weights and batch route the same tokens to the same experts, wherever the experts live
    assert first["ep1"].tokens_per_expert == first["ep2"].tokens_per_expert == first["ep2-allgather"].tokens_per_expert
    assert first["ep1"].load_balancing_loss == pytest.approx(first["ep2"].load_balancing_loss, rel=1e-5)
    assert first["ep1"].z_loss == pytest.approx(first["ep2"].z_loss, rel=1e-5)


def test_run_start_names_the_experts_kernel(runs):
    kernels = runs["ep2"].run_start().kernels
    assert kernels["experts"] == "sequential" and kernels["layer"] == "stock"
