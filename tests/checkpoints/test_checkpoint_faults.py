"""Data safety under faults, with real torchrun ranks in CPU mode:

- a rank SIGKILLed in the middle of ``save_checkpoint`` (its shards written, the save not finished):
  the previous checkpoint stays loadable, ``latest`` never names the partial one, a resume continues
  from the last good one;
- a full disk during a save (the rank's file size capped with ``RLIMIT_FSIZE``, so writes fail with
  EFBIG): a clear error event, the run ends ``failed``, the last good checkpoint intact.

The fault is injected through ``WORKBENCH_FAULT`` (``workbench/backend/checkpointing.py:_fault_point``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from workbench.config import preset
from workbench.run.checkpoint import TRACKER_FILE, find_checkpoint
from workbench.run.integrity import verify_checkpoint
from workbench.run.reader import read_events

from tests.support import torchrun_args, free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _cfg(**over):
    base = {"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6, "train.global_batch_size": 4,
            "train.eval_interval": 0, "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 2,
            "parallel.nproc_per_node": 2}
    base.update(over)
    return preset("tiny", **base)


def _cmd(cfg, run_dir: Path) -> list[str]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    return [sys.executable, *torchrun_args("2"),
            "-m", "workbench.backend", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]


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


def test_rank_killed_mid_save_leaves_the_last_checkpoint_and_resume_works(tmp_path):
    run_dir = tmp_path / "killed"
    env = {**ENV, "WORKBENCH_FAULT": "saved:4:1:sleep=300"}  # rank 1 wrote its shards of iteration 4, then stalls
    proc = subprocess.Popen(_cmd(_cfg(), run_dir), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
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
        ckpts = run_dir / "checkpoints"
        assert any(p.name.startswith("iter_0000004.tmp") for p in ckpts.iterdir())  # the save is under way
        os.kill(pid[0], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_last_good_is_iteration_2(ckpts)
    partial = [p.name for p in ckpts.iterdir() if ".tmp-" in p.name]
    assert partial  # what the killed save left
    # resuming into the same root: the next save tidies the killed one's leftovers and says so
    out = _resume_from(ckpts, tmp_path / "resumed", save_into=ckpts)
    assert f"removed {partial[0]}" in out
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
