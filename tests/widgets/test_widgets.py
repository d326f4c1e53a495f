"""Config form, dashboard, watch() and training plots, instantiated headless and driven programmatically."""

from __future__ import annotations

import dataclasses
import time
import typing
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

import pytest

from workbench.launch import Run
from workbench.config import PRESETS, ConfigError, RunConfig, load_config, preset
from workbench.run.events import EventWriter
from workbench.plots.training import frames_from_run, training_figure
from workbench.widgets.config_form import ConfigForm
from workbench.widgets.dashboard import Dashboard, RunFailed, watch

from tests.support import RANK_SCRIPT, run_processes, wait_until

PNG = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- config form


def test_form_is_generated_from_the_dataclasses():
    form = ConfigForm()
    hints = get_type_hints(RunConfig)
    expected = {"name"}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            name = f"{prefix}.{f.name}"
            tp = get_type_hints(cls)[f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a nested section (model.moe): its fields
                walk(tp, name)
                continue
            expected.add(name)
            if get_origin(tp) is Literal:  # choices come from the Literal, nothing hand-written
                assert tuple(form.fields[name].options) == get_args(tp)

    for section in ("model", "parallel", "train", "data", "checkpoint"):
        walk(hints[section], section)
    assert set(form.fields) == expected


@pytest.mark.parametrize("name", list(PRESETS))
def test_form_round_trips_every_preset(name):
    cfg = preset(name)
    form = ConfigForm(cfg)
    assert form.config.to_dict() == cfg.to_dict()


def test_changing_a_field_revalidates_next_to_it_and_replans():
    form = ConfigForm(preset("tiny"))
    assert form.problems == [] and not form.launch_button.disabled
    plan_before = form.plan_text
    form.set("parallel.tensor_parallel", 3)  # 4 heads are not divisible by 3
    assert any(p.field == "parallel.tensor_parallel" for p in form.problems)
    assert "not divisible by tensor_parallel 3" in form.messages["parallel.tensor_parallel"].value
    assert form.messages["model.num_layers"].value == ""
    assert form.launch_button.disabled
    assert "problem" in form.summary.value
    form.set("parallel.tensor_parallel", 1)
    assert form.problems == [] and form.messages["parallel.tensor_parallel"].value == ""
    form.set("model.num_layers", 8)
    assert form.config.model.num_layers == 8
    try:
        from workbench import planner
    except ImportError:
        assert "not available" in form.plan_text
    else:  # the readout is the planner's prediction for the *current* form values
        assert form.plan_text != plan_before
        assert form.plan_text == planner.format_plan(planner.predict(form.config))
    assert form.preset.value == "(custom)"


def test_type_errors_and_optional_fields():
    form = ConfigForm(preset("tiny"))
    form.fields["model.kv_channels"].value = "abc"
    assert [p.field for p in form.problems] == ["model.kv_channels"]
    assert "integer" in form.messages["model.kv_channels"].value
    form.fields["model.kv_channels"].value = ""
    assert form.problems == [] and form.config.model.kv_channels is None
    form.fields["data.source"].value = "indexed"
    assert any(p.field == "data.datasets" for p in form.problems)
    form.fields["data.datasets"].value = "/data/a_text_document 0.7\n/data/b_text_document 0.3"
    assert form.problems == []
    assert [(d.prefix, d.weight) for d in form.config.data.datasets] == [("/data/a_text_document", 0.7), ("/data/b_text_document", 0.3)]
    form.set("train.hook_kwargs", {"alpha": 0.5})
    assert form.config.train.hook_kwargs == {"alpha": 0.5}
    form.fields["train.hook_kwargs"].value = "{alpha: 1"
    assert [p.field for p in form.problems] == ["train.hook_kwargs"]


def test_preset_dropdown_and_export(tmp_path):
    form = ConfigForm(preset("tiny"))
    form.preset.value = "llama-small"
    assert form.config.to_dict() == preset("llama-small").to_dict()
    assert form.fields["model.normalization"].value == "rmsnorm"
    form.set("train.train_iters", 770)
    for suffix in ("json", "yaml"):
        path = form.export(tmp_path / f"cfg.{suffix}")
        assert load_config(path).to_dict() == form.config.to_dict()
    assert load_config(tmp_path / "cfg.yaml").train.train_iters == 770
    form.set("model.num_attention_heads", 5)
    with pytest.raises(ConfigError):
        form.export(tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_launch_button_starts_the_run(tmp_path):
    script = tmp_path / "fake_rank.py"
    script.write_text(RANK_SCRIPT)
    launched = []
    form = ConfigForm(preset("tiny").replace(**{"train.train_iters": 3}), on_launch=launched.append, show_dashboard=False,
                      launch_kwargs={"entry": [str(script)], "env": {"FAKE_MODE": "ok"}, "run_root": tmp_path / "runs"})
    form.launch_button.click()
    assert launched and launched[0] is form.run
    assert form.run.wait(timeout=40) == "finished"
    assert load_config(form.run.run_dir / "config.json").to_dict() == form.config.to_dict()
    assert form.run.train_loss["iteration"].tolist() == [1, 2, 3]


# --------------------------------------------------------------------------- dashboard / plots


def _synthetic_run(run_dir: Path, iters: int = 5, fail_rank: int | None = None, world: int = 2,
                   kernel_path: dict | None = None) -> Path:
    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": world, "train.train_iters": iters})
    cfg.save(run_dir / "config.json")
    for r in range(world):
        with EventWriter(run_dir, r) as w:
            w.emit("run_start", config=cfg.to_dict(), world_size=world, kernel_path=kernel_path or {})
            for it in range(1, iters + 1):
                w.emit("step", iteration=it, loss=(10.0 - it) if r == world - 1 else None, lr=1e-4 * it, grad_norm=2.0 / it,
                       step_time=0.5, tokens_per_s=1000.0 + it, mfu=0.3, mem_allocated=(r + 1) * 2**30,
                       mem_reserved=(r + 2) * 2**30, mem_peak=(r + 1.5) * 2**30)
            w.emit("eval", iteration=iters, loss=4.5, ppl=90.0)
            if fail_rank == r:
                w.emit("error", message="CUDA out of memory", exception="OutOfMemoryError", traceback="Traceback (most recent call last):\n  boom\nOutOfMemoryError: CUDA out of memory")
                w.emit("run_end", status="failed", iteration=iters, seconds=3.0)
            else:
                w.emit("run_end", status="finished", iteration=iters, seconds=3.0)
    return run_dir


def test_dashboard_renders_a_finished_run(tmp_path):
    run = Run.attach(_synthetic_run(tmp_path / "r"))
    dash = Dashboard(run, autostart=False, predicted_memory={0: 1.0 * 2**30, 1: 2.0 * 2**30})
    assert dash._thread is None  # nothing to follow
    assert "finished" in dash.status.value and "iteration 5/5" in dash.status.value
    assert dash.progress.value == 5 and dash.progress.max == 5 and dash.progress.bar_style == "success"
    assert bytes(dash.figure.value).startswith(PNG)
    assert dash.failure.layout.display == "none"
    assert dash.stop_button.disabled


def test_dashboard_shows_the_failing_rank(tmp_path):
    run = Run.attach(_synthetic_run(tmp_path / "r", fail_rank=1))
    dash = Dashboard(run, autostart=False)
    assert run.status == "failed"
    assert "rank 1 failed" in dash.failure.value and "OutOfMemoryError" in dash.failure.value
    assert dash.failure.layout.display != "none"


def test_training_figure_draws_the_frames(tmp_path):
    run = Run.attach(_synthetic_run(tmp_path / "r", iters=6))
    fig = training_figure(frames_from_run(run), predicted_memory={0: 2**30, 1: 2**30})
    ax_loss, ax_tput, ax_mem, ax_grad = fig.axes[:4]
    train = ax_loss.get_lines()[0]
    assert list(train.get_xdata()) == [1, 2, 3, 4, 5, 6] and list(train.get_ydata()) == [9, 8, 7, 6, 5, 4]
    assert list(ax_loss.get_lines()[1].get_ydata()) == [4.5]  # eval
    heights = sorted(round(p.get_height(), 3) for p in ax_mem.patches)
    assert heights == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0]  # allocated 1,2 / reserved 2,3 / planner 1,1 (GiB)
    assert list(ax_tput.get_lines()[0].get_ydata()) == [1001.0 + i for i in range(6)]
    assert [t.get_text() for t in ax_mem.get_legend().get_texts()] == ["allocated", "reserved", "planner"]
    # a run that replays CUDA graphs says that "allocated" leaves out the graph pool
    graphs = Run.attach(_synthetic_run(tmp_path / "g", kernel_path={"fast_cuda_graphs": "compiled layers' forward+backward replayed"}))
    legend = training_figure(frames_from_run(graphs)).axes[2].get_legend().get_texts()
    assert "CUDA-graph pool" in legend[0].get_text()
    off = Run.attach(_synthetic_run(tmp_path / "o", kernel_path={"fast_cuda_graphs_off": "pipeline parallel"}))
    assert not frames_from_run(off).cuda_graphs
    # an empty run still draws (placeholders), so a dashboard can open before the first step
    empty = tmp_path / "empty"
    preset("tiny").save(empty / "config.json")
    assert training_figure(frames_from_run(Run.attach(empty))).axes


def test_dashboard_follows_live_run_and_stop_button(tmp_path):
    script = tmp_path / "fake_rank.py"
    script.write_text(RANK_SCRIPT)
    run = Run.launch(preset("tiny").replace(**{"train.train_iters": 1000}),
                     run_root=tmp_path / "runs", entry=[str(script)], env={"FAKE_MODE": "slow"})
    dash = Dashboard(run, interval=0.2)
    try:
        wait_until(lambda: dash.progress.value >= 2, 40, "the dashboard to show progress")
        assert "running" in dash.status.value and bytes(dash.figure.value).startswith(PNG)
        assert dash._thread.is_alive()
        dash.stop_button.click()
        assert run.status == "stopped"
        wait_until(lambda: not dash._thread.is_alive(), 10, "the polling thread to end with the run")
        assert "stopped" in dash.status.value
        assert run_processes(run.run_dir) == []
    finally:
        run.stop(grace=2)
        dash.close()


def test_watch_headless_prints_progress_and_static_plots(tmp_path, capsys):
    run = Run.attach(_synthetic_run(tmp_path / "r"))
    assert watch(run, live=False, interval=0.05) == "finished"
    out = capsys.readouterr().out
    assert "run finished" in out
    # outside a notebook kernel (a script): the figures are saved and their paths said, never an object's repr
    assert "<IPython" not in out, out
    shown = [Path(line.split("figure: ", 1)[1]) for line in out.splitlines() if line.startswith("figure: ")]
    assert shown == [run.run_dir / "figures" / "training.png"], out
    assert shown[0].read_bytes().startswith(b"\x89PNG")


def test_watch_in_a_kernel_displays_the_figures_and_saves_nothing(tmp_path, capsys, monkeypatch):
    import IPython.display

    from workbench.widgets import dashboard

    shown = []
    monkeypatch.setattr(dashboard, "_in_kernel", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    run = Run.attach(_synthetic_run(tmp_path / "r"))
    assert watch(run, live=False, interval=0.05) == "finished"
    out = capsys.readouterr().out
    assert [type(x).__name__ for x in shown] == ["Image"] and shown[0].data.startswith(b"\x89PNG"), shown
    assert "figure: " not in out and not (run.run_dir / "figures").exists()


def test_watch_raises_one_line_for_a_failed_run(tmp_path, capsys):
    """A run that did not finish: watch shows its figures and failure, then raises (one line in a notebook)."""
    run = Run.attach(_synthetic_run(tmp_path / "r", fail_rank=1))
    with pytest.raises(RunFailed) as info:
        watch(run, live=False, interval=0.05)
    out = capsys.readouterr().out
    assert "run failed" in out and "rank 1 failed" in out and "figure: " in out  # failure and figures first
    assert out.index("rank 1 failed") < out.index("figure: ") and "<IPython" not in out
    lines = info.value._render_traceback_()
    # one message, no traceback: its lines wrap between words only (a notebook's error output breaks them anywhere)
    assert len(lines) == 1 and "Traceback" not in lines[0] and lines[0].split() == str(info.value).split(), lines
    assert "failed at iteration" in lines[0] and "rank 1: " in lines[0], lines
    assert info.value.status == "failed" and info.value.run is run
    assert watch(run, live=False, interval=0.05, show=False, check=False) == "failed"


def test_live_watch_leaves_a_static_summary_and_figures(tmp_path):
    """Live, the dashboard is displayed with a display id; when the run ends that output becomes HTML
    (no widget a saved notebook could not show) and the figures follow as PNG images."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    published = []
    shell.display_pub.publish = lambda data, metadata=None, *a, **k: published.append((data, k))
    try:
        run = Run.attach(_synthetic_run(tmp_path / "r"))
        assert watch(run, live=True, interval=0.05) == "finished"
    finally:
        InteractiveShell.clear_instance()
    widget, *rest = published
    assert "application/vnd.jupyter.widget-view+json" in widget[0]
    display_id = widget[1]["transient"]["display_id"]
    update = next(p for p in rest if p[1].get("update"))
    assert update[1]["transient"]["display_id"] == display_id
    assert "finished" in update[0]["text/html"] and "iteration 5/5" in update[0]["text/html"]
    assert "application/vnd.jupyter.widget-view+json" not in update[0]
    pngs = [d for d, _k in rest if "image/png" in d]
    assert pngs, [list(d) for d, _k in rest]


def test_interrupting_watch_stops_the_run(tmp_path):
    """Kernel interrupt (SIGINT -> KeyboardInterrupt) while watch() blocks: the run is stopped, and watch says so
    by raising RunStopped (one line), so the cells after it do not run."""
    import signal
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "fake_rank.py"
    script.write_text(RANK_SCRIPT)
    kernel = textwrap.dedent(
        f'''
        import signal
        # a kernel turns SIGINT into KeyboardInterrupt even when its parent ran with SIGINT
        # ignored (a background job of a non-interactive shell, e.g. `nohup bash .ci/run &`)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from workbench.launch import Run
        from workbench.config import preset
        from workbench.widgets.dashboard import RunStopped, watch
        run = Run.launch(preset("tiny"), run_root={str(tmp_path / "runs")!r}, entry=[{str(script)!r}], env={{"FAKE_MODE": "slow"}})
        print(run.run_dir, flush=True)
        try:
            print("watch returned", watch(run, live=False, interval=0.1, show=False), flush=True)
        except RunStopped as e:  # a run that did not finish ends the cell (and Run All) in one line
            print("watch raised", type(e).__name__, e.status, "|", e._render_traceback_(), flush=True)
        '''
    )
    k = subprocess.Popen([sys.executable, "-c", kernel], stdout=subprocess.PIPE, text=True)
    try:
        run = Run.attach(Path(k.stdout.readline().strip()))
        wait_until(lambda: run.events("step"), 60, "a step")
        k.send_signal(signal.SIGINT)
        out, _ = k.communicate(timeout=60)
        assert "watch raised RunStopped stopped" in out and "(kernel interrupt)" in out, out
        assert run_processes(run.run_dir) == []
        assert run.status == "stopped"
    finally:
        if k.poll() is None:
            k.kill()
            k.wait()
