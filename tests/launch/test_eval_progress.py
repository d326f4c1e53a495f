"""A long evaluation is progress: while it runs every rank writes ``eval_progress`` events (at most every
``EVAL_PROGRESS_SECONDS``), so the supervisor's stall watch does not take a slow first evaluation for a hung rank."""

from __future__ import annotations

from workbench.config import preset
from workbench.run.reader import read_events

from tests.support.trainer_runs import run_trainers

EVERY_BATCH = "import workbench.backend.train as _train\n_train.EVAL_PROGRESS_SECONDS = 0.0\n"


def test_every_rank_reports_progress_through_an_evaluation(tmp_path):
    cfg = preset("tiny", **{"data.source": "synthetic", "train.train_iters": 2, "train.lr_decay_iters": 2, "train.lr_warmup_iters": 0,
                            "train.global_batch_size": 4, "train.eval_interval": 2, "train.eval_iters": 3,
                            "train.microbatch_timing_interval": 0, "checkpoint.save_on_exit": False})
    run_trainers({tmp_path / "run": cfg}, nproc=2, prelude=EVERY_BATCH)
    events = read_events(tmp_path / "run")
    for rank in (0, 1):
        mine = [e for e in events if e.get("rank") == rank]
        kinds = [e["event"] for e in mine]
        progress = [e for e in mine if e["event"] == "eval_progress"]
        assert [(p["iteration"], p["done"], p["total"]) for p in progress] == [(2, 0, 3), (2, 1, 3), (2, 2, 3)], kinds
        last_step = max(i for i, k in enumerate(kinds) if k == "step")
        first_progress = kinds.index("eval_progress")
        assert last_step < first_progress  # written during the evaluation that follows step 2
        if "eval" in kinds:  # the rank that holds the loss writes the evaluation's result after its progress
            assert kinds.index("eval") > max(i for i, k in enumerate(kinds) if k == "eval_progress")

