"""One writer per checkpoint folder, the contract's side (``workbench/run/writer.py``, torch-free): the claim code the
launch and the backend's global rank 0 share, on real files, with a real process as the owner.

- a launch's claim is its own rank 0's (the same run directory): kept, never given back by the rank; a rank other
  than global rank 0 claims nothing;
- a claim a bare backend's rank 0 made (``torchrun ... -m workbench.rank``: no launch) refuses a second run
  (launch or rank) while that process lives, naming the run, host and pid and the fix; once it is gone (or its pid
  is a later process's) the claim is taken over with a note; a claim made on another host counts as live;
- a ``save_dir`` the run cannot write its claim into is a ``ConfigError`` on that field (exit 2), not an OSError.

The backend's own use of it (a real torchrun job, its refusal before any step, the note, the release on a clean
exit): ``tests/checkpoints/test_checkpoint_faults.py``; the launch's (real supervisors): ``tests/launch/test_checkpoint_writer.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.support import ROOT
from workbench.config import ConfigError, preset
from workbench.run import writer


def _cfg(save_dir):
    return preset("tiny").replace(**{"checkpoint.save_dir": str(save_dir), "parallel.nproc_per_node": 1})


def _claim(save_dir):
    return json.loads((save_dir / writer.OWNER_FILE).read_text())


def test_a_launch_s_claim_is_its_rank_0_s_own_and_other_ranks_claim_nothing(tmp_path):
    save_dir, run_a = tmp_path / "ckpts", tmp_path / "run-a"
    cfg = _cfg(save_dir)
    assert writer.claim(cfg, run_a) == []  # the launch, before any process starts
    launched = _claim(save_dir)
    assert launched["by"] == writer.LAUNCH and launched["run_dir"] == str(run_a) and launched["pid"] == os.getpid()

    assert writer.rank_claim(cfg, run_a, rank=0) == []  # its rank 0: the same run directory, its own claim
    assert _claim(save_dir) == launched
    writer.release(cfg, run_a, pid=os.getpid() + 1)  # a rank 0 gives back only the claim it made itself
    assert _claim(save_dir) == launched

    assert writer.rank_claim(cfg, tmp_path / "run-b", rank=1) == []  # only global rank 0 claims (any node)
    with pytest.raises(ConfigError) as e:  # another run's rank 0, while the launch is under way
        writer.rank_claim(cfg, tmp_path / "run-b", rank=0)
    assert f"checkpoint folder of run {run_a}" in str(e.value) and f"being launched by pid {os.getpid()}" in str(e.value)
    writer.release(cfg, run_a)  # the supervisor, at the end of the run
    assert not (save_dir / writer.OWNER_FILE).exists()


def test_a_bare_rank_0_s_claim_refuses_while_it_lives_and_is_taken_over_once_it_is_gone(tmp_path):
    save_dir, run_a, run_b = tmp_path / "ckpts", tmp_path / "run-a", tmp_path / "run-b"
    cfg = _cfg(save_dir)
    cfg.save(tmp_path / "cfg.json")
    owner = subprocess.Popen(  # a rank 0 of another job (no launch): it claims, then trains
        [sys.executable, "-c", "import sys, time\nfrom workbench.config import load_config\nfrom workbench.run import writer\n"
         "writer.rank_claim(load_config(sys.argv[1]), sys.argv[2], rank=0)\nprint('claimed', flush=True)\ntime.sleep(300)",
         str(tmp_path / "cfg.json"), str(run_a)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "claimed"
        assert _claim(save_dir)["by"] == writer.RANK0 and _claim(save_dir)["pid"] == owner.pid
        for attempt in (lambda: writer.rank_claim(cfg, run_b, rank=0), lambda: writer.claim(cfg, run_b)):
            with pytest.raises(ConfigError) as e:
                attempt()
            msg = str(e.value)
            assert f"checkpoint.save_dir: {save_dir} is the checkpoint folder of run {run_a}" in msg, msg
            assert f"pid {owner.pid}" in msg and f"its rank 0 (pid {owner.pid}) is running" in msg, msg
            assert "give this run its own checkpoint.save_dir" in msg and str(save_dir / writer.OWNER_FILE) in msg, msg
        problem = writer.owner_problem(cfg, run_b)  # the launch's pre-check (--dry-run) says the same
        assert problem is not None and f"its rank 0 (pid {owner.pid}) is running" in problem.rule
        with pytest.raises(ConfigError) as e:  # a second bare job given the same run directory: refused too
            writer.rank_claim(cfg, run_a, rank=0)
        assert f"its rank 0 (pid {owner.pid}) is running" in str(e.value)
        assert _claim(save_dir)["run_dir"] == str(run_a) and _claim(save_dir)["pid"] == owner.pid
    finally:
        owner.send_signal(signal.SIGKILL)  # nothing gives the folder back
        owner.wait()
    assert writer.owner_problem(cfg, run_b) is None
    notes = writer.rank_claim(cfg, run_b, rank=0)
    assert notes == [f"took over checkpoint folder {save_dir} from run {run_a} (its rank 0, pid {owner.pid}, is gone)"]
    assert _claim(save_dir)["run_dir"] == str(run_b) and _claim(save_dir)["pid"] == os.getpid()
    writer.release(cfg, run_b, pid=os.getpid())  # rank 0's clean exit
    assert not (save_dir / writer.OWNER_FILE).exists()


def test_a_reused_pid_and_another_host_are_judged_right(tmp_path):
    save_dir = tmp_path / "ckpts"
    save_dir.mkdir()
    cfg = _cfg(save_dir)
    mine = {"run_dir": str(tmp_path / "old"), "host": writer.host_name(), "pid": os.getpid(), "claimed": 0.0,
            "by": writer.RANK0, "create_time": writer.process_started(os.getpid()) - 50.0}  # the pid, given anew
    (save_dir / writer.OWNER_FILE).write_text(json.dumps(mine))
    assert writer.owner_problem(cfg, tmp_path / "new") is None
    (save_dir / writer.OWNER_FILE).write_text(json.dumps({**mine, "host": "node-elsewhere"}))
    problem = writer.owner_problem(cfg, tmp_path / "new")  # another machine's processes cannot be seen from here
    assert problem is not None and "runs on host node-elsewhere" in problem.rule
    assert f"remove {save_dir / writer.OWNER_FILE}" in problem.fix


def test_a_folder_the_run_cannot_write_is_a_config_error_not_a_traceback(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(ConfigError) as e:
        writer.rank_claim(_cfg(tmp_path / "a-file"), tmp_path / "run", rank=0)
    assert f"checkpoint.save_dir: {tmp_path / 'a-file'}: the run cannot write its claim" in str(e.value), str(e.value)
    assert "a folder this run can write" in str(e.value)
