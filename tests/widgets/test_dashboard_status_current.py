"""The dashboard's status line and progress show the events read after the (slow) redraw,
not those read before it: a fast run used to be ~30 iterations further than the status line said."""

from __future__ import annotations

from workbench.config import preset
from workbench.run.events import EventWriter
from workbench.launch import Run


def test_status_line_is_current_after_a_redraw(tmp_path):
    from workbench.widgets.dashboard import Dashboard

    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": 1, "train.train_iters": 100})
    cfg.save(tmp_path / "config.json")
    writer = EventWriter(tmp_path, 0)
    writer.emit("run_start", config=cfg.to_dict(), world_size=1, kernel_path={})
    state = {"it": 0}

    def train(n):  # the run's rank writing step events
        for _ in range(n):
            state["it"] += 1
            writer.emit("step", iteration=state["it"], loss=5.0, step_time=0.05, tokens_per_s=1000.0)

    train(10)

    class Live(Dashboard):
        def _schedule_png(self):  # part of every redraw: the run trains 30 more steps meanwhile
            train(30)
            return super()._schedule_png()

    dash = Live(Run.attach(tmp_path), autostart=False)
    assert state["it"] == 40
    assert "iteration 40/100" in dash.status.value and dash.progress.value == 40
    dash.update()
    assert state["it"] == 70 and "iteration 70/100" in dash.status.value and dash.progress.value == 70
    writer.close()
