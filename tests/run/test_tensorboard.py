"""TensorBoard event files from a run's events (``workbench/run/tensorboard.py``): the tags a step and an eval record
become, an export after the fact read back with TensorBoard's own reader, and ``workbench runs export-tensorboard``.
A real run's live log (``train.tensorboard``) is checked against its step events in ``tests/rank/test_rank_train.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.event_runs import T0, write_run
from workbench.cli import main
from workbench.run.events import Eval, Step
from workbench.run.tensorboard import ExportError, export, logged_records, scalars

GIB = 1 << 30


def _points(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(s.step, s.value, s.wall_time) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_records_fields_become_stable_readable_tags():
    step = Step(iteration=3, loss=2.5, lr=1e-3, grad_norm=0.5, skipped=False, step_time=0.25, tokens_per_s=4096.0,
                tflops_per_gpu=300.0, mfu=0.4, mem_allocated=2 * GIB, mem_reserved=3 * GIB, mem_peak=GIB,
                consumed_samples=24, extra={"sop loss": 0.7, "accuracy": 0.5})
    assert dict(scalars(step)) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "perf/step_time_s": 0.25, "perf/tokens_per_s": 4096.0,
        "perf/tflops_per_gpu": 300.0, "perf/mfu_percent": 40.0, "memory/allocated_gib": 2.0, "memory/reserved_gib": 3.0,
        "memory/peak_gib": 1.0, "train/sop_loss": 0.7, "train/accuracy": 0.5}
    assert dict(scalars(Eval(iteration=3, loss=2.0, ppl=7.389, extra={"mlm accuracy": 0.25}))) == {
        "eval/loss": 2.0, "eval/ppl": 7.389, "eval/mlm_accuracy": 0.25}
    # a field left empty (CPU mode: MFU, memory) writes nothing
    assert dict(scalars(Step(iteration=1, loss=None, lr=1e-3, mfu=None))) == {"train/lr": 1e-3}


def _two_rank_run(run_dir):
    """A PP=2-like run: rank 1 holds the loss, rank 0 writes the same steps without it."""
    steps = [{"iteration": i, "time": T0 + i, "rank": r, "lr": 1e-3 * i, "step_time": 0.5 + r,
              **({"loss": 8.0 / i, "accuracy": 0.1 * i} if r == 1 else {})} for i in (1, 2, 3, 4) for r in (0, 1)]
    evals = [{"iteration": 2, "time": T0 + 2.5, "rank": 1, "loss": 3.0, "ppl": 20.0855}]
    return write_run(run_dir, steps, evals, ranks=(0, 1))


def test_export_writes_the_logging_ranks_records_as_tensorboard_reads_them(tmp_path):
    run = _two_rank_run(tmp_path / "run")
    assert {r.rank for r in logged_records(run)} == {1}
    out = export(run)
    assert out == run / "tensorboard"
    pts = _points(out)
    assert pts["train/loss"] == [(i, pytest.approx(8.0 / i, rel=1e-7), T0 + i) for i in (1, 2, 3, 4)]
    assert pts["perf/step_time_s"] == [(i, 1.5, T0 + i) for i in (1, 2, 3, 4)]  # rank 1's, not rank 0's
    assert [p[0] for p in pts["train/accuracy"]] == [1, 2, 3, 4] and pts["eval/loss"] == [(2, 3.0, T0 + 2.5)]
    with pytest.raises(ExportError, match="already holds TensorBoard event files"):
        export(run)
    assert _points(export(run, replace=True)) == pts  # written again from the events, not appended
    with pytest.raises(ExportError, match="no step records"):
        export(tmp_path / "not-a-run")


def test_runs_export_tensorboard_command(tmp_path, capsys):
    run = _two_rank_run(tmp_path / "runs" / "a")
    assert main(["runs", "export-tensorboard", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run / 'tensorboard'}" in out and f"tensorboard --logdir {run.parent}" in out
    assert main(["runs", "export-tensorboard", str(run)]) == 1  # there already: refused, the fix named
    assert "--replace" in capsys.readouterr().err
    assert main(["runs", "export-tensorboard", str(run), "--replace", "--logdir", str(tmp_path / "tb")]) == 0
    assert _points(tmp_path / "tb") == _points(run / "tensorboard")
    assert main(["runs", "export-tensorboard", str(run), str(run), "--logdir", str(tmp_path / "tb")]) == 2


def test_an_export_does_not_import_torch(tmp_path):
    run = _two_rank_run(tmp_path / "run")
    code = (f"import sys; from workbench.run.tensorboard import export; export({str(run)!r}); "
            "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_export_of_a_resumed_run_keeps_the_newest_record_of_each_step(tmp_path):
    """A run killed after step 4 and resumed from its step-2 checkpoint into the same directory wrote steps 3 and 4
    twice: the export holds each step once, the resumed attempt's (as the live log's purge step leaves it)."""
    first = [{"iteration": i, "time": T0 + i, "loss": 8.0 / i} for i in (1, 2, 3, 4)]
    again = [{"iteration": i, "time": T0 + 100 + i, "loss": 1.0 / i} for i in (3, 4, 5)]
    run = write_run(tmp_path / "resumed", first + again)
    pts = _points(export(run))
    assert [s for s, _, _ in pts["train/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v, _ in pts["train/loss"]] == pytest.approx([8.0, 4.0, 1 / 3, 0.25, 0.2], rel=1e-7)
