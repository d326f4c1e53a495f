"""``workbench launch`` says on stderr what it waits for before the first step (start-up takes seconds on CPU,
minutes for a large model): the ranks starting, then the first step once they have; stdout keeps only what scripts
parse (the run directory, one line per step's loss, ``run finished: DIR``)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from workbench import cli
from workbench.config import preset


class FakeRun:
    """A run that starts for two polls, runs a poll without a step, then steps twice and finishes."""

    def __init__(self, run_dir: Path):
        self.config = preset("tiny", **{"parallel.nproc_per_node": 2})
        self.run_dir = run_dir
        self.nnodes = 1
        self.failure = None
        self.polls = 0

    @property
    def status(self) -> str:
        self.polls += 1
        return "starting" if self.polls <= 2 else "running" if self.polls <= 4 else "finished"

    @property
    def train_loss(self):
        rows = [] if self.polls <= 3 else [{"iteration": 1, "loss": 8.5}, {"iteration": 2, "loss": 8.25}]
        return pd.DataFrame(rows, columns=["iteration", "loss"])

    def is_alive(self) -> bool:
        return self.polls <= 4

    def wait(self, timeout=None) -> str:
        return "finished"


def test_waiting_is_said_on_stderr_in_order_before_the_first_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli.time, "sleep", lambda s: None)
    rc = cli._follow_cli(FakeRun(tmp_path))
    out = capsys.readouterr()
    assert rc == 0
    said = [line for line in out.err.splitlines() if line.startswith("launch: ")]
    assert len(said) == 2, out.err
    assert "waiting for 2 rank(s) to start" in said[0] and "building the model" in said[0], said
    assert "ranks started; waiting for the first step" in said[1], said
    # stdout: exactly what it printed before (parsed by scripts and tests)
    assert out.out.splitlines() == ["iteration 1: loss 8.5000", "iteration 2: loss 8.2500", f"run finished: {tmp_path}"]
