"""Expert parallelism trains the same model as one expert group: EP=2 against EP=1 from one initial checkpoint, in
bf16 (megatron's mixed-precision optimizer, with fp32 main copies of the weights), gradient clipping active, and the
GPU fast paths switched on for CPU (``kernel_rule.allow_fast_paths_on_cpu``: grouped-GEMM experts, the workbench
cross-entropy, the foreach multi-tensor norm / scale with the grad norm kept as a tensor).

Issue #51: on two GPUs EP=2 fell away from one GPU after a few steps (7.4% over 50 steps).  The fine-tuning load
(``checkpoint.finetune``: weights only, fresh optimizer) wrote the checkpoint into the model after the optimizer had
copied the freshly initialised weights into its fp32 main params, so the first step put the fresh initialisation
back: each run trained on from its own random init, and EP=2's experts start from other random values than EP=1's.

One 2-rank launch (``tests/support/trainer_runs.py``): ``init`` (EP=1, one step, saved), then ``ep1`` and ``ep2``
(``parallel.expert_parallel: 2``: the workbench's token dispatch and its all-to-all), each loading ``init``'s weights and training ``STEPS`` steps.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import RunReader

pytestmark = pytest.mark.slow

STEPS = 6
CLIP = 0.1  # well under every step's norm (about 1-3 here): every step is clipped
#: the fast paths on CPU for these ranks, run eagerly (the same maths as compiled; no inductor build on 2 cores)
PRELUDE = ("from workbench import kernel_rule\nfrom workbench.backend import compiled_layer\n"
           "kernel_rule.allow_fast_paths_on_cpu(True)\ncompiled_layer.set_compile(False)\n")


def _cfg(**over):
    base = {"train.train_iters": STEPS, "train.lr_decay_iters": STEPS, "train.eval_interval": 0,
            "train.microbatch_timing_interval": 0, "model.moe.router_stats_interval": 1, "train.precision": "bf16",
            "train.compile_kernels": True, "train.cuda_graphs": False, "train.clip_grad": CLIP}
    return preset("moe-tiny", **{**base, **over})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ep_parity")
    init = root / "init"
    load = {"checkpoint.load_dir": str(init / "checkpoints"), "checkpoint.finetune": True, "checkpoint.save_on_exit": False}
    plan = {
        init: _cfg(**{"train.train_iters": 1, "train.lr_decay_iters": 1, "train.lr_warmup_iters": 0}),
        root / "ep1": _cfg(**load),
        root / "ep2": _cfg(**load, **{"parallel.expert_parallel": 2}),
    }
    run_trainers(plan, nproc=2, timeout=600, prelude=PRELUDE)
    return {p.name: RunReader(p) for p in plan}


def _curves(reader):
    by_it = {}
    for r in sorted(reader.records("step"), key=lambda r: (r.iteration, r.rank)):
        if r.loss is not None:
            by_it.setdefault(r.iteration, r)
    its = sorted(by_it)
    return [by_it[i].loss for i in its], [by_it[i].grad_norm for i in its]


def test_the_fast_paths_ran(runs):
    for name in ("ep1", "ep2"):
        kernels = runs[name].run_start().kernels
        assert kernels["experts"] == "torch_grouped" and kernels["cross_entropy"] == "compiled", (name, kernels)
        assert kernels["moe_dispatch"] == "workbench", (name, kernels)  # gathers; at EP=2 its own all-to-all


def test_ep2_trains_the_same_model_as_ep1(runs):
    ref, ref_gn = _curves(runs["ep1"])
    got, gn = _curves(runs["ep2"])
    assert len(ref) == len(got) == STEPS
    assert min(ref_gn + gn) > 2 * CLIP  # clipping scaled every step's update
    # bf16 weights: EP=2 sums its expert GEMMs in another order, so not bit-equal; a run that drops back to its own
    # random initialisation after the first step is 2e-3 off at step 2 and 1e-2 by step 5
    for i, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= 3e-4 * abs(a), (i + 1, ref, got)
    for i, (a, b) in enumerate(zip(ref_gn, gn)):
        assert abs(a - b) <= 1e-2 * abs(a), (i + 1, ref_gn, gn)


def test_the_routers_load_the_experts_alike(runs):
    r1, r2 = runs["ep1"].router(), runs["ep2"].router()
    assert [r.iteration for r in r1] == [r.iteration for r in r2] == list(range(1, STEPS + 1))
    assert r1[0].tokens_per_expert == r2[0].tokens_per_expert  # the loaded weights route alike
    for a, b in zip(r1, r2):
        for layer, (x, y) in enumerate(zip(a.tokens_per_expert, b.tokens_per_expert)):
            moved = sum(abs(p - q) for p, q in zip(x, y)) / 2  # assignments routed to another expert
            assert moved <= 0.05 * sum(x), (a.iteration, layer, x, y)
        assert b.load_balancing_loss == pytest.approx(a.load_balancing_loss, rel=2e-3), a.iteration
