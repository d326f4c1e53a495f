"""Data safety under faults, with real torchrun ranks in CPU mode:

- a rank SIGKILLed in the middle of ``save_checkpoint`` (its shards written, the save not finished):
  the previous checkpoint stays loadable, ``latest`` never names the partial one, a resume continues
  from the last good one;
- a full disk during a save (the rank's file size capped with ``RLIMIT_FSIZE``, so writes fail with
  EFBIG): a clear error event, the run ends ``failed``, the last good checkpoint intact;
- one writer per checkpoint folder without a launch (bare torchrun, as a SLURM script runs it): the job's global
  rank 0 claims its ``checkpoint.save_dir``; while it lives another backend naming that folder exits 2 before any
  step, naming the owner (so does a launch of it); the claim a killed rank 0 left is taken over with a note by the
  resume, which gives the folder back when it finishes.

The fault is injected through ``WORKBENCH_FAULT`` (``workbench/checkpoint/dist.py:_fault_point``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from workbench.checkpoint import TRACKER_FILE, find_checkpoint, verify_checkpoint
from workbench.run.reader import read_events
from workbench.run.writer import OWNER_FILE, RANK0

from tests.support import RANK_ENV, ROOT, checkpointing_run_config, torchrun_args

ENV = RANK_ENV


_cfg = checkpointing_run_config


def _cmd(cfg, run_dir: Path) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    return [sys.executable, *torchrun_args("2"),
            "-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]


def _by(events, kind, rank=None):
    return [e for e in events if e["event"] == kind and (rank is None or e["rank"] == rank)]


def _assert_last_good_is_iteration_2(ckpts: Path):
    assert (ckpts / TRACKER_FILE).read_text().strip() == "2"
    assert not (ckpts / "iter_0000004").exists()
    found = find_checkpoint(ckpts)
    assert found.name == "iter_0000002"
    verify_checkpoint(found)  # every file's size and SHA-256 as recorded at save


def _resume_from(ckpts: Path, run_dir: Path, save_into: Path | None = None) -> str:
    over = {"checkpoint.load_dir": str(ckpts), "checkpoint.save_interval": 0}
    if save_into is not None:
        over["checkpoint.save_dir"] = str(save_into)
    proc = subprocess.run(_cmd(_cfg(**over), run_dir), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ev = read_events(run_dir)
    assert [e["iteration"] for e in _by(ev, "step", 0)] == [3, 4, 5, 6]
    assert _by(ev, "run_end", 0)[0]["status"] == "finished"
    return proc.stdout


def _a_second_run_is_refused(ckpts: Path, owner_dir: Path, claim: dict, tmp_path: Path, capfd, monkeypatch) -> None:
    """While the job that owns ``ckpts`` lives: another backend naming that save_dir (its rank 0, in this process) exits
    2 before any step, and so does a launch of it (``--dry-run``), both naming the owner and the fix."""
    from workbench.rank.train import main as backend_main
    from workbench.cli import main as cli_main

    second = tmp_path / "second"
    second.mkdir()
    _cfg(**{"checkpoint.save_dir": str(ckpts), "train.seed": 99}).save(second / "config.json")
    monkeypatch.setenv("RANK", "0")
    capfd.readouterr()
    try:
        assert backend_main(["--config", str(second / "config.json"), "--run-dir", str(second)]) == 2
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # what the backend's main registers for its stacks
    err = capfd.readouterr().err
    owner = f"{ckpts} is the checkpoint folder of run {owner_dir} (host {claim['host']}, pid {claim['pid']}"
    assert owner in err and f"its rank 0 (pid {claim['pid']}) is running" in err, err
    assert "give this run its own checkpoint.save_dir" in err and "Traceback" not in err, err
    assert sorted(p.name for p in second.iterdir()) == ["config.json"]  # no event, no step, no checkpoint
    assert cli_main(["launch", str(second / "config.json"), "--dry-run"]) == 2
    assert owner in capfd.readouterr().err


def test_rank_killed_mid_save_leaves_the_last_checkpoint_and_resume_works(tmp_path, capfd, monkeypatch):
    run_dir = tmp_path / "killed"
    ckpts = run_dir / "checkpoints"
    env = {**ENV, "WORKBENCH_FAULT": "saved:4:1:sleep=300"}  # rank 1 wrote its shards of iteration 4, then stalls
    proc = subprocess.Popen(_cmd(_cfg(**{"checkpoint.save_dir": str(ckpts)}), run_dir), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    found = threading.Event()
    pid: list[int] = []

    def reader():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"fault injection: rank 1 \(pid (\d+)\) sleep", line)
            if m and not pid:
                pid.append(int(m.group(1)))
                found.set()

    threading.Thread(target=reader, daemon=True).start()
    try:
        assert found.wait(240), "".join(lines[-60:])
        assert any(p.name.startswith("iter_0000004.tmp") for p in ckpts.iterdir())  # the save is under way
        claim = json.loads((ckpts / OWNER_FILE).read_text())  # the bare job's global rank 0 claimed its save_dir
        assert claim["run_dir"] == str(run_dir) and claim["by"] == RANK0 and claim["pid"] != pid[0], claim
        _a_second_run_is_refused(ckpts, run_dir, claim, tmp_path, capfd, monkeypatch)
        os.kill(pid[0], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_last_good_is_iteration_2(ckpts)
    partial = [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert partial  # what the killed save left
    # what a SIGKILLed rank 0 leaves (one that fails on its own gives the folder back)
    (ckpts / OWNER_FILE).write_text(json.dumps(claim))
    # resuming into the same root: the next save tidies the killed one's leftovers and says so
    out = _resume_from(ckpts, tmp_path / "resumed", save_into=ckpts)
    assert f"removed {partial[0]}" in out
    assert f"took over checkpoint folder {ckpts} from run {run_dir} (its rank 0, pid {claim['pid']}, is gone)" in out, out
    assert not (ckpts / OWNER_FILE).exists()  # given back at the resume's clean exit
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000002", "iter_0000006"]
    assert find_checkpoint(ckpts).name == "iter_0000006"


def test_full_disk_during_save_is_an_error_event_and_a_failed_run(tmp_path):
    run_dir = tmp_path / "full"
    env = {**ENV, "WORKBENCH_FAULT": "save:4:0:fsize=65536"}  # rank 0 (it writes the replicated shards) cannot write more than 64 KiB per file
    proc = subprocess.run(_cmd(_cfg(), run_dir), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    ev = read_events(run_dir)
    errors = _by(ev, "error", 0)
    assert errors, proc.stdout[-2000:] + proc.stderr[-4000:]
    msg = errors[0]["message"]
    assert "iteration 4 failed on rank 0" in msg and "file size limit 65536 bytes" in msg and "MiB free on" in msg, msg
    assert "free disk space" in msg and "the last complete checkpoint (iteration 2) is intact" in msg
    assert _by(ev, "run_end", 0)[0]["status"] == "failed"
    assert max(e["iteration"] for e in _by(ev, "checkpoint", 0)) == 2
    _assert_last_good_is_iteration_2(run_dir / "checkpoints")
    _resume_from(run_dir / "checkpoints", tmp_path / "resumed")
