"""A run of the real backend (``python -m workbench.rank``) in CPU mode: tiny preset, 2 ranks.

The finished-run path (train -> eval -> checkpoint -> generate) is exercised by the quickstart
notebook in ``test_notebooks.py``; here the run is followed live and stopped half-way.  Its
``checkpoint.save_dir`` is claimed by the launch, and the backend's rank 0 takes that claim for its own
(``workbench/run/writer.py``: one writer per checkpoint folder); the supervisor gives it back at the end.
"""

from __future__ import annotations

import json
import math

import pytest

from workbench.notebook import quickstart_config
from workbench.launch import Run

from tests.support import run_processes, wait_until

pytestmark = pytest.mark.slow


def test_real_backend_follow_and_stop(tmp_path):
    cfg, _note = quickstart_config("tiny", nproc=2, device="cpu", steps=100000)
    save_dir = tmp_path / "shared-ckpts"
    cfg = cfg.replace(**{"train.eval_interval": 0, "checkpoint.save_on_exit": False, "checkpoint.save_dir": str(save_dir)})
    run = Run.launch(cfg, run_root=tmp_path)
    try:
        assert run.status in ("starting", "running")
        wait_until(lambda: run.train_loss["iteration"].nunique() >= 3, 150, "three training steps", poll=0.5)
        assert run.status == "running"
        claim = json.loads((save_dir / ".workbench-writer.json").read_text())
        assert claim["run_dir"] == str(run.run_dir) and claim["by"] == "launch", claim  # rank 0 trains under its launch's claim
        starts = run.events("run_start")
        assert sorted(e["rank"] for e in starts) == [0, 1] and starts[0]["world_size"] == 2
        steps = run.steps
        assert set(steps["rank"]) == {0, 1}
        losses = run.train_loss["loss"].tolist()
        assert all(math.isfinite(x) and 0 < x < 20 for x in losses)
        # a fresh model over a 8192-token vocabulary starts near ln(8192)
        assert losses[0] == pytest.approx(math.log(cfg.model.vocab_size), abs=1.5)
        it, total, eta = run.progress()
        assert it >= 3 and total == 100000 and eta is not None and eta > 0
        assert run.rank_log(1, "stderr") is not None
        from workbench.widgets.dashboard import Dashboard

        dash = Dashboard(run, autostart=False)
        stacks = dash.show_stacks()  # a seemingly stuck run: every rank's Python stacks, and it goes on
        assert sorted(stacks) == [0, 1] and "rank 1" in dash.stacks.value and "most recent call first" in dash.stacks.value
        assert all("(most recent call first)" in t and "workbench/rank/train.py" in t for t in stacks.values()), stacks
        n = run.train_loss["iteration"].nunique()
        wait_until(lambda: run.train_loss["iteration"].nunique() > n, 60, "a step after the stack dump", poll=0.5)
        assert run.stop(grace=20) == "stopped"
        assert run_processes(run.run_dir) == []
        wait_until(lambda: not (save_dir / ".workbench-writer.json").exists(), 20, "the supervisor to give the folder back")
        ends = run.events("run_end")  # the backend finished its step and said so before exiting
        assert ends and {e["status"] for e in ends} == {"stopped"}
        assert run.exit_status["status"] == "stopped"
        assert run.failure is None
    finally:
        if run.is_alive():
            run.stop(grace=2)
