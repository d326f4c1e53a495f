"""A corrupt or truncated event line in the middle of a rank file (not only the last line)
never breaks the dashboard, its reader or the run's metrics: bad JSON, JSON of the wrong shape and
records with wrongly typed fields are skipped and counted."""

from __future__ import annotations

from pathlib import Path

from workbench.config import preset
from workbench.run.events import EventWriter, event_file, parse_line
from workbench.launch import Run

BAD_LINES = [
    '{"event": "step", "time": "garbage", "rank": 0, "iteration": "x", "loss": "abc", "step_time": "?"}\n',
    '{"event": "step", "time": 1e400, "rank": 0, "iteration": 2, "mem_allocated": "lots"}\n',
    '{"event": "step", "time": 1.0, "rank": 0, "iteration": 2, "tokens_per_s": [1, 2]}\n',
    '{"event": "run_start", "time": 1.0, "rank": 0, "config": "not a dict"}\n',
    '[1, 2, 3]\n', '{"event": 5}\n', '"just a string"\n', '\x00\x00\xff garbage\n',
]


def _run(run_dir: Path, iters: int = 5, world: int = 2) -> Path:
    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": world, "train.train_iters": iters})
    cfg.save(run_dir / "config.json")
    for r in range(world):
        with EventWriter(run_dir, r) as w:
            w.emit("run_start", config=cfg.to_dict(), world_size=world, kernel_path={})
            for it in range(1, iters + 1):
                w.emit("step", iteration=it, loss=(10.0 - it) if r == world - 1 else None, lr=1e-4, grad_norm=1.0,
                       step_time=0.5, tokens_per_s=1000.0, mfu=0.3, mem_allocated=2**30, mem_reserved=2**31, mem_peak=2**30)
            w.emit("run_end", status="finished", iteration=iters, seconds=3.0)
        path = event_file(run_dir, r)
        lines = path.read_text().splitlines(True)
        torn = lines[3][: len(lines[3]) // 2]  # a rank killed mid-line, the run resumed into the same file
        path.write_text("".join(lines[:3] + BAD_LINES + [torn + lines[3]] + lines[4:]))
    return run_dir


def test_wrongly_typed_records_are_corrupt_lines():
    for line in BAD_LINES:
        assert parse_line(line) is None, line
    assert parse_line('{"event": "step", "time": 1.5, "rank": 0, "iteration": 2, "loss": NaN}').iteration == 2


def test_dashboard_survives_corrupt_lines_in_the_middle(tmp_path):
    from workbench.widgets.dashboard import Dashboard

    run = Run.attach(_run(tmp_path / "r"))
    dash = Dashboard(run, autostart=False)
    assert "finished" in dash.status.value and "iteration 5/5" in dash.status.value
    assert dash.progress.value == 5
    assert bytes(dash.figure.value).startswith(b"\x89PNG")
    assert [int(i) for i in run.train_loss["iteration"]] == [1, 2, 3, 4, 5]
    assert run.reader.bad_lines == 2 * (len(BAD_LINES) + 1)
    m = run.final_metrics()
    assert m["status"] == "finished" and m["tokens_per_s"] > 0
