"""A checkpoint trained by two ranks at TP=2 converts to HF and back, and the HF model computes what it computes.

CPU mode under gloo, tiny models, fp32: GPT and BERT trained 3 steps at TP=2 by the backend's own ``Trainer``
(a training checkpoint written by two ranks: model shards, optimizer state, random states), then the chain of
``tests/support/conversion_chain.py`` -- the one the GPU proof runs on checkpoints trained on two GPUs
(``tests/gpu_proofs/two_gpu_proof.py --phase b``): ``megatron_to_hf``; ``convert verify`` at TP=2 (HF logits
against the trained checkpoint's, max |difference| <= 1e-4); the round trip HF -> workbench at TP=2 -> HF,
bit-identical; GPT: greedy ``workbench generate`` (two ranks) on the round-tripped checkpoint token for
token equal to HF ``generate``; BERT: the masked-token argmax of the verified logits equal to HF's.
"""

from __future__ import annotations

import json

import pytest

from workbench.config import preset

from tests.support.conversion_chain import convert
from tests.support.trainer_runs import run_trainers

TRAIN = {"data.source": "synthetic", "train.train_iters": 3, "train.lr_decay_iters": 3, "train.lr_warmup_iters": 1,
         "train.global_batch_size": 8, "train.eval_interval": 0, "train.microbatch_timing_interval": 0,
         "checkpoint.save_on_exit": True, "checkpoint.save_interval": 0, "parallel.tensor_parallel": 2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-rank")
    runs = {root / "gpt": preset("tiny", **TRAIN), root / "bert": preset("bert-tiny", **TRAIN)}
    run_trainers(runs, nproc=2, timeout=900)
    return root


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_a_tp2_training_checkpoint_exports_verifies_and_round_trips(trained, family, tmp_path):
    ckpt = trained / family / "checkpoints"
    meta = json.loads((ckpt / "iter_0000003" / "workbench.json").read_text())
    assert meta["has_optimizer"] and meta["config"]["parallel"]["tensor_parallel"] == 2 and meta["iteration"] == 3
    rec = convert(ckpt, tmp_path, "cpu", atol=1e-4, new=8)
    assert (rec["tp"], rec["pp"], rec["iteration"]) == (2, 1, 3)
    assert rec["verify_ok"] and rec["verify_max_abs_diff"] <= 1e-4, rec
    assert rec["round_trip_identical"] and rec["round_trip_tensors"] > 10, rec
    if family == "gpt":
        assert rec["generate_equal"], (rec["workbench_tokens"], rec["hf_tokens"])
        assert all(len(t) == 8 for t in rec["hf_tokens"])
        assert any(f == "length" for f in rec["workbench_finish"])  # not every sequence ended at once
    else:
        assert rec["argmax_positions"] > 0 and rec["argmax_equal"] == rec["argmax_positions"], rec
    assert rec["pass"]
