"""A resume under dropout repeats the straight run: training checkpoints carry every rank's random states
(megatron's ``rng_state``: Python, NumPy, torch CPU / CUDA and the model-parallel tracker, one object per
(PP, TP) rank; data-parallel replicas read DP rank 0's).  A resume at another TP / PP layout cannot use
them and says so (the run's own seeding)."""

from __future__ import annotations

from workbench.config import preset
from workbench.run.reader import read_events

from tests.support.trainer_runs import run_trainers

DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}


def _losses(run_dir, kind="step"):
    return {e["iteration"]: e["loss"] for e in read_events(run_dir) if e["event"] == kind and e.get("loss") is not None}


def test_resume_under_dropout_repeats_the_straight_run(tmp_path):
    straight = preset("tiny", **{"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6,
                                 "train.global_batch_size": 8, "train.eval_interval": 3, "train.eval_iters": 1,
                                 "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0,
                                 "checkpoint.save_on_exit": False, "parallel.tensor_parallel": 2, **DROPOUT})
    ckpts = str(tmp_path / "first" / "checkpoints")
    dp2 = straight.replace(**{"parallel.tensor_parallel": 1})  # two data-parallel replicas
    runs = {
        tmp_path / "straight": straight,
        tmp_path / "first": straight.replace(**{"train.train_iters": 3, "checkpoint.save_on_exit": True}),
        tmp_path / "resumed": straight.replace(**{"checkpoint.load_dir": ckpts}),
        tmp_path / "relayout": straight.replace(**{"checkpoint.load_dir": ckpts, "parallel.tensor_parallel": 1}),
        tmp_path / "dp_straight": dp2,
        tmp_path / "dp_first": dp2.replace(**{"train.train_iters": 3, "checkpoint.save_on_exit": True}),
        tmp_path / "dp_resumed": dp2.replace(**{"checkpoint.load_dir": str(tmp_path / "dp_first" / "checkpoints")}),
    }
    out = run_trainers(runs, nproc=2, timeout=600)
    ref, got = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(got) == [4, 5, 6]
    assert {i: got[i] for i in got} == {i: ref[i] for i in got}  # the same dropout masks, bit for bit
    assert _losses(tmp_path / "resumed", "eval")[6] == _losses(tmp_path / "straight", "eval")[6]
    assert "random states: restored" in out
    # the states are per (PP, TP) rank: at TP=1 they do not fit, the run goes on with its own seeding and says so
    assert "layout changed (tensor_parallel 2 -> 1): this run's own seeding" in out
    assert sorted(_losses(tmp_path / "relayout")) == [4, 5, 6]
    # DP=2: DP rank 0 wrote the states, both replicas read them (rank 1 from another replica's object)
    ref, got = _losses(tmp_path / "dp_straight"), _losses(tmp_path / "dp_resumed")
    assert sorted(got) == [4, 5, 6] and {i: got[i] for i in got} == {i: ref[i] for i in got}
