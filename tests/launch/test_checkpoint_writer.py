"""One writer per checkpoint folder, with real torchrun, real supervisors and the launch's fake rank
(``tests.support.RANK_SCRIPT``):

- while a run saves into a ``checkpoint.save_dir``, a second run naming the same folder is refused before it starts
  (``workbench launch --dry-run`` as a real process exits 2; ``Run.launch`` raises ``ConfigError``), naming the
  owner's run directory; once the owner ends, its supervisor gives the folder back and the next run starts;
- the claim of a run whose supervisor was SIGKILLed (nothing gave the folder back) is taken over, with a note.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, run_processes, wait_until
from workbench.config import ConfigError, preset
from workbench.launch import Run

pytestmark = pytest.mark.slow

OWNER_FILE = ".workbench-writer.json"


def _cfg(save_dir: Path, seed: int):
    return preset("tiny").replace(**{"parallel.nproc_per_node": 1, "train.train_iters": 3, "train.lr_warmup_iters": 1,
                                     "checkpoint.save_dir": str(save_dir), "train.seed": seed})


def _launch(rank_script: Path, tmp_path: Path, save_dir: Path, seed: int, mode: str) -> Run:
    return Run.launch(_cfg(save_dir, seed), run_root=tmp_path / "runs", entry=[str(rank_script)], env={"FAKE_MODE": mode},
                      grace=2.0)


def test_a_second_run_on_a_live_runs_checkpoint_folder_is_refused_before_it_starts(rank_script, tmp_path):
    save_dir = tmp_path / "shared-ckpts"
    first = _launch(rank_script, tmp_path, save_dir, 1234, "slow")  # steps until go-finish
    try:
        wait_until(lambda: first.status == "running", 60, "the first run to start")

        cfg_file = tmp_path / "second.json"
        _cfg(save_dir, 99).save(cfg_file)
        p = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", str(cfg_file), "--dry-run"], cwd=ROOT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stdout + p.stderr
        assert "checkpoint.save_dir" in p.stderr and f"checkpoint folder of run {first.run_dir}" in p.stderr, p.stderr
        assert "still writing it" in p.stderr and "its own checkpoint.save_dir" in p.stderr, p.stderr
        assert json.loads((save_dir / OWNER_FILE).read_text())["run_dir"] == str(first.run_dir)

        runs_before = sorted((tmp_path / "runs").iterdir())
        with pytest.raises(ConfigError) as e:
            _launch(rank_script, tmp_path, save_dir, 99, "slow")
        assert f"checkpoint folder of run {first.run_dir}" in str(e.value), str(e.value)
        assert sorted((tmp_path / "runs").iterdir()) == runs_before  # nothing of the second run was made
        assert json.loads((save_dir / OWNER_FILE).read_text())["run_dir"] == str(first.run_dir)
    finally:
        (first.run_dir / "go-finish").touch()
    assert first.wait(timeout=60) == "finished"
    wait_until(lambda: not (save_dir / OWNER_FILE).exists(), 20, "the supervisor to give the folder back")

    second = _launch(rank_script, tmp_path, save_dir, 99, "ok")
    assert second.wait(timeout=60) == "finished"
    assert second.launch_info["notes"] == []
    assert not (save_dir / OWNER_FILE).exists()


def test_the_claim_of_a_killed_run_is_taken_over_with_a_note(rank_script, tmp_path, capfd):
    save_dir = tmp_path / "shared-ckpts"
    first = _launch(rank_script, tmp_path, save_dir, 1234, "slow")
    wait_until(lambda: first.status == "running", 60, "the first run to start")
    os.kill(int(first.launch_info["supervisor_pid"]), signal.SIGKILL)  # nothing gets to give the folder back
    wait_until(lambda: not run_processes(first.run_dir), 30, "the killed run's processes to go")
    assert json.loads((save_dir / OWNER_FILE).read_text())["run_dir"] == str(first.run_dir)
    capfd.readouterr()

    second = _launch(rank_script, tmp_path, save_dir, 99, "ok")
    err = capfd.readouterr().err
    note = f"took over checkpoint folder {save_dir} from run {first.run_dir} (its supervisor is gone)"
    assert note in err, err
    assert second.launch_info["notes"] == [note]
    assert second.wait(timeout=60) == "finished"
