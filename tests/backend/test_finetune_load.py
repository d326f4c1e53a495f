"""A fine-tuning load (``checkpoint.finetune``: the weights, a fresh optimizer) trains on from the loaded weights under
mixed precision too.  megatron's bf16 optimizer keeps fp32 main copies of the weights, taken when it is built; the
Trainer builds it before the load, so unless the copies are refreshed (``reload_model_params``, as megatron's own
loader does) the first step writes the fresh initialisation back over the loaded weights: every bf16 fine-tune trained
on from a random init (issue #51: MoE EP=2 vs EP=1 then started from different expert inits).

One launch: ``init`` trains the tiny GPT well below a fresh model's loss and saves; ``ft`` loads it with ``lr`` ~ 0
(a step changes nothing but what the optimizer writes back) and trains three steps: each step's loss stays at the
trained model's, far from a fresh model's ~ln(vocab)."""

from __future__ import annotations

import math

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import RunReader

pytestmark = pytest.mark.slow


def test_a_bf16_finetune_trains_on_from_the_loaded_weights(tmp_path):
    base = {"train.precision": "bf16", "train.eval_interval": 0, "train.microbatch_timing_interval": 0, "train.lr_warmup_iters": 0,
            "data.source": "demo"}
    init, ft = tmp_path / "init", tmp_path / "ft"
    plan = {
        init: preset("tiny", **base, **{"train.train_iters": 16, "train.lr_decay_iters": 16, "train.lr": 4e-3, "train.min_lr": 1e-3}),
        ft: preset("tiny", **base, **{"train.train_iters": 3, "train.lr_decay_iters": 3, "train.lr": 1e-12, "train.min_lr": 0.0,
                                      "checkpoint.load_dir": str(init / "checkpoints"), "checkpoint.finetune": True,
                                      "checkpoint.save_on_exit": False}),
    }
    run_trainers(plan, nproc=1, timeout=600)
    trained, tuned = ([r.loss for r in sorted(RunReader(d).records("step"), key=lambda r: r.iteration) if r.loss is not None]
                      for d in (init, ft))
    fresh = math.log(plan[init].derived().padded_vocab_size)
    assert trained[0] > fresh - 0.5 and trained[-1] < fresh - 1.5, trained  # the init run learned something
    assert len(tuned) == 3
    for loss in tuned:  # every step at a trained model's loss (before the fix: steps 2 and 3 back at ~ln(V))
        assert loss < fresh - 1.0, (tuned, trained, fresh)
