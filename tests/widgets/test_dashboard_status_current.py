"""The dashboard's status line and progress show the events read after the (slow) redraw,
not those read before it: a fast run used to be ~30 iterations further than the status line said."""

from __future__ import annotations

from workbench.config import preset
from workbench.run.events import EventWriter
from workbench.launch import Run

from tests.support import write_step_events


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


def test_the_final_figures_show_every_step_the_header_counts(tmp_path, monkeypatch):
    """A redraw the dashboard's thread began on older events (45 of 60 steps) and finished late, after watch()'s own
    final update, used to be what the saved notebook kept: the header said 60/60, the curves ended near 45."""
    import threading

    import IPython.display

    from workbench.launch.exit_status import write_exit_status
    from workbench.widgets import dashboard as dashboard_module

    writer = write_step_events(tmp_path, 44)

    real_frames = dashboard_module.frames_from_run
    wrote, main_drew, static_done = threading.Event(), threading.Event(), threading.Event()
    thread_calls = []
    dash_box = {}

    def frames(run):
        got = real_frames(run)
        if threading.current_thread() is threading.main_thread():
            if wrote.is_set():
                main_drew.set()
            elif len(got.train_loss) == 44:  # the first draw: one more step arrives, so the thread redraws
                writer.emit("step", iteration=45, loss=5.0, step_time=0.05, tokens_per_s=1000.0)
            return got
        thread_calls.append(len(got.train_loss))
        if len(thread_calls) == 1:  # the thread's redraw began on 45 steps; the run ends meanwhile
            for it in range(46, 61):
                writer.emit("step", iteration=it, loss=4.0, step_time=0.05, tokens_per_s=1000.0)
            write_exit_status(tmp_path, 0, status="finished")
            wrote.set()
            closed = dash_box["dash"]._closed
            for _ in range(1000):  # until watch() draws the final state or closes the dashboard
                if main_drew.is_set() or closed.is_set():
                    break
                closed.wait(0.01)
            if main_drew.is_set():
                closed.wait(0.3)  # ... and has set its figure: this slow redraw lands after it
        else:
            static_done.wait(10)  # a later redraw of this thread comes too late for the saved outputs
        return got

    monkeypatch.setattr(dashboard_module, "frames_from_run", frames)
    monkeypatch.setattr(dashboard_module, "training_figure", lambda f, *a, **k: int(f.train_loss["iteration"].max()))
    monkeypatch.setattr(dashboard_module, "figure_png", lambda last, dpi=80: f"PNG last={last}".encode())
    real_init = dashboard_module.Dashboard.__init__

    def init(self, *a, **k):
        dash_box["dash"] = self
        real_init(self, *a, **k)

    monkeypatch.setattr(dashboard_module.Dashboard, "__init__", init)
    shown = []

    class Handle:
        def update(self, obj):
            shown.append(obj)

    def display(*objs, display_id=None, **_k):
        shown.extend(objs)
        if any(isinstance(o, IPython.display.Image) for o in objs):
            static_done.set()
        return Handle() if display_id else None

    monkeypatch.setattr(IPython.display, "display", display)
    try:
        assert dashboard_module.watch(Run.attach(tmp_path), live=True, interval=0.05, timeout=60) == "finished"
    finally:
        static_done.set()
        writer.close()
    images = [o.data for o in shown if isinstance(o, IPython.display.Image)]
    summary = [o.data for o in shown if isinstance(o, IPython.display.HTML)][-1]
    assert "iteration 60/60" in summary
    assert images and images[0] == b"PNG last=60", images


def test_the_status_line_names_a_router_collapse(tmp_path):
    """An MoE run whose router has flooded one expert and starved the others for 3 sampled steps: the dashboard's
    status line says which (workbench.plots.router.collapse_flags); a balanced run's says nothing of routers."""
    from workbench.run.events import Router
    from workbench.widgets.dashboard import Dashboard

    for name, row in (("collapsed", [385, 5, 5, 5]), ("balanced", [100, 100, 100, 100])):
        run_dir = tmp_path / name
        cfg = preset("tiny").replace(**{"parallel.nproc_per_node": 1, "train.train_iters": 30})
        run_dir.mkdir()
        cfg.save(run_dir / "config.json")
        with EventWriter(run_dir, 0) as writer:
            writer.emit("run_start", config=cfg.to_dict(), world_size=1, kernel_path={})
            for it in (10, 20, 30):
                writer.emit("step", iteration=it, loss=5.0, step_time=0.05, tokens_per_s=1000.0)
                writer.write(Router(iteration=it, layers=[1], tokens_per_expert=[row], assignments=[sum(row)], dropped=[0]))
        dash = Dashboard(Run.attach(run_dir), autostart=False)
        if name == "collapsed":
            assert "router collapse: layer 1 expert 0 flooded" in dash.status.value and "expert 1 starved" in dash.status.value
        else:
            assert "router collapse" not in dash.status.value
