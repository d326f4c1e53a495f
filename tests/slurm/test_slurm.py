"""``workbench launch --slurm`` on a real (single-machine) SLURM cluster: the script it writes is
submitted with sbatch, trains a tiny CPU-mode GPT, is followed by ``Run.attach`` and ends
``stopped`` on ``scancel`` / ``Run.stop()`` with nothing left behind (the cluster: ``conftest.py``).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time

import pytest

from tests.support import ROOT, run_processes, wait_until
from workbench.notebook import quickstart_config
from workbench.launch import Run
from workbench.launch.slurm import JOB_FILE

pytestmark = pytest.mark.slow


def _config(tmp_path, *, steps: int, nnodes: int = 1, save_on_exit: bool = False):
    cfg, _note = quickstart_config("tiny", nproc=2, device="cpu", steps=steps)
    cfg = cfg.replace(**{"parallel.nnodes": nnodes, "train.eval_interval": 0, "checkpoint.save_on_exit": save_on_exit,
                         "train.global_batch_size": 4 * nnodes})
    return cfg.save(tmp_path / f"tiny-{nnodes}n-{steps}.json")


def _submit(cluster, cfg_file, run_dir) -> str:
    """``workbench launch --slurm`` as a person types it; returns the job id it printed."""
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "launch", str(cfg_file), "--slurm", "--run-dir", str(run_dir)],
                       cwd=ROOT, env=cluster.env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"workbench launch --slurm failed:\n{r.stdout}\n{r.stderr}"
    m = re.search(r"^Submitted batch job (\d+)$", r.stdout, re.M)
    assert m, r.stdout
    job = m.group(1)
    assert json.loads((run_dir / JOB_FILE).read_text())["job_id"] == job  # recorded for Run.attach
    script = (run_dir / "slurm.sbatch").read_text()
    assert "srun " in script and "-m workbench.launch.torchrun" in script and '--nnodes "$SLURM_NNODES"' in script
    return job


def _job_log(run_dir) -> str:
    path = run_dir / "logs" / "launcher.log"
    return path.read_text(errors="replace") if path.exists() else "(no logs/launcher.log)"


def _assert_gone(cluster, run, job: str, timeout: float = 60) -> None:
    """The job left the queue, and no process of the run is left on this machine."""
    wait_until(lambda: not any(line.split()[0] == job for line in cluster.queue()), timeout, f"job {job} to leave squeue", poll=0.5)
    wait_until(lambda: not run_processes(run.run_dir), 15, "the run's processes to end", poll=0.5)
    assert not run.is_alive()
    assert cluster.queue() == []


def _assert_trained(run, iterations: int | None = None, ranks=(0, 1)) -> None:
    starts = run.events("run_start")
    assert sorted(e["rank"] for e in starts) == list(ranks) and {e["world_size"] for e in starts} == {len(ranks)}
    loss = run.train_loss
    assert len(loss) >= (iterations or 2)
    if iterations:
        assert loss["iteration"].tolist() == list(range(1, iterations + 1))
    assert all(math.isfinite(x) and 0 < x < 20 for x in loss["loss"])


def test_one_node_two_ranks_trains_and_finishes(slurm_cluster, tmp_path):
    """1 node x 2 ranks, 8 steps: submitted, trained, ``finished`` (recorded by the batch script itself)."""
    run_dir = tmp_path / "short"
    t0 = time.time()
    job = _submit(slurm_cluster, _config(tmp_path, steps=8), run_dir)
    run = Run.attach(run_dir)
    assert run.status in ("starting", "running", "finished")
    st = run.wait(timeout=240)
    assert st == "finished", f"status {st}\n{_job_log(run_dir)[-3000:]}\n{slurm_cluster.logs()}"
    _assert_trained(run, iterations=8)
    losses = run.train_loss["loss"].tolist()
    assert losses[-1] < losses[0]  # it learns
    ends = run.events("run_end")
    assert sorted(e["rank"] for e in ends) == [0, 1] and {e["status"] for e in ends} == {"finished"}
    ex = run.exit_status
    assert ex["status"] == "finished" and ex["returncode"] == 0 and run.failure is None
    log = _job_log(run_dir)
    assert f"[workbench] SLURM job {job}: 1 node(s)" in log  # the job's output is the run's launcher log
    assert run.log_tail(None, 200) and "train" in log
    _assert_gone(slurm_cluster, run, job)
    print(f"\n1 node x 2 ranks, 8 steps through SLURM: {time.time() - t0:.0f} s")


def test_scancel_stops_a_long_run_cleanly(slurm_cluster, tmp_path):
    """A long run, followed by ``Run.attach`` while it trains; ``scancel`` -> ``stopped``: every rank
    stopped at the same step boundary and saved its checkpoint (no rank died mid-collective, nothing
    waited for SLURM's SIGKILL), nothing left."""
    run_dir = tmp_path / "long"
    job = _submit(slurm_cluster, _config(tmp_path, steps=100000, save_on_exit=True), run_dir)
    run = Run.attach(run_dir)
    wait_until(lambda: run.status == "running" and run.train_loss["iteration"].nunique() >= 3, 240,
               "three training steps under SLURM", poll=0.5)
    assert run.is_alive() and any(line.split() == [job, "RUNNING"] for line in slurm_cluster.queue())
    seen = run.train_loss["iteration"].nunique()
    wait_until(lambda: run.train_loss["iteration"].nunique() > seen, 60, "Run.attach to see more steps", poll=0.5)
    _assert_trained(run)
    it, total, _eta = run.progress()
    assert it > 3 and total == 100000
    t0 = time.time()
    slurm_cluster.run("scancel", job)
    wait_until(lambda: run.status == "stopped" and not run.is_alive(), 60, "status 'stopped' after scancel", poll=0.5)
    took = time.time() - t0
    _assert_gone(slurm_cluster, run, job)
    ends = run.events("run_end")
    assert sorted(e["rank"] for e in ends) == [0, 1], _job_log(run_dir)[-3000:]
    assert {e["status"] for e in ends} == {"stopped"} and len({e["iteration"] for e in ends}) == 1
    assert run.events("error") == [] and run.failure is None, _job_log(run_dir)[-3000:]
    saved = run.events("checkpoint")  # checkpoint.save_on_exit: the stop is a clean one
    assert saved and {e["iteration"] for e in saved} == {ends[0]["iteration"]}
    ex = run.exit_status
    assert ex["status"] == "stopped" and ex["reason"] == "slurm-signal"
    print(f"\nscancel -> stopped in {took:.1f} s at iteration {ends[0]['iteration']}")


def test_two_nodes_and_run_stop(slurm_cluster, tmp_path):
    """2 nodes x 2 ranks (two slurmd on this machine), one torchrun per node rendezvousing on the
    first node; ``Run.attach(...).stop()`` cancels the job: ``stopped``, nothing left."""
    if slurm_cluster.two_nodes_reason:
        pytest.skip(f"2 nodes: {slurm_cluster.two_nodes_reason}; the 1-node tests ran")
    run_dir = tmp_path / "two"
    job = _submit(slurm_cluster, _config(tmp_path, steps=100000, nnodes=2), run_dir)
    run = Run.attach(run_dir)
    wait_until(lambda: run.train_loss["iteration"].nunique() >= 3, 300, "three steps on two nodes", poll=0.5)
    assert run.status == "running" and run.is_alive()
    _assert_trained(run, ranks=(0, 1, 2, 3))
    assert f"SLURM job {job}: 2 node(s) (wb[1-2])" in _job_log(run_dir)
    t0 = time.time()
    st = Run.attach(run_dir).stop()
    assert st == "stopped", f"{st}\n{_job_log(run_dir)[-3000:]}"
    _assert_gone(slurm_cluster, run, job)
    ends = run.events("run_end")
    assert sorted(e["rank"] for e in ends) == [0, 1, 2, 3] and {e["status"] for e in ends} == {"stopped"}
    assert run.events("error") == [] and run.failure is None
    assert run.exit_status["status"] == "stopped"
    print(f"\n2 nodes x 2 ranks: Run.stop() -> stopped in {time.time() - t0:.1f} s")


def test_run_stop_cancels_only_a_job_that_runs_this_run_directory_s_script(slurm_cluster, tmp_path, capsys):
    """``slurm.json`` is a file: one that names another job (a real one, running another script) or no job id at all
    gets nothing cancelled; the run's own job (submitted by ``submit``, as ``workbench launch --slurm`` does) is."""
    from workbench.config import preset
    from workbench.launch.slurm import submit

    def sleeper(run_dir):
        (run_dir / "events").mkdir(parents=True)
        (run_dir / "logs").mkdir()
        preset("tiny").save(run_dir / "config.json")
        script = run_dir / "slurm.sbatch"
        script.write_text(f"#!/bin/bash\n#SBATCH --output={run_dir}/logs/launcher.log\nsleep 600\n")
        return script

    other, mine = tmp_path / "other", tmp_path / "mine"
    other_job = slurm_cluster.run("sbatch", "--parsable", str(sleeper(other))).stdout.strip().split(";")[0]
    wait_until(lambda: [other_job, "RUNNING"] in [line.split() for line in slurm_cluster.queue()], 60, "the other job to run")
    my_job = submit(mine, sleeper(mine))
    for forged in (other_job, f"--name={other.name}", f"{other_job} "):
        (mine / JOB_FILE).write_text(json.dumps({"job_id": forged, "script": str(mine / "slurm.sbatch")}))
        run = Run.attach(mine)
        run.stop(grace=1)
        assert [other_job, "RUNNING"] in [line.split() for line in slurm_cluster.queue()], f"{forged!r} cancelled it"
        assert run.refusals and str(mine / JOB_FILE) in run.refusals[0]
    err = capsys.readouterr().err
    assert f"whose batch script is {other / 'slurm.sbatch'}" in err and "not a SLURM job id" in err
    assert run.exit_status is None
    (mine / JOB_FILE).write_text(json.dumps({"job_id": my_job, "script": str(mine / "slurm.sbatch")}))
    run = Run.attach(mine)
    assert run.is_alive()
    assert run.stop(grace=1) == "stopped" and not run.refusals
    wait_until(lambda: not any(line.split()[0] == my_job for line in slurm_cluster.queue()), 60, "the run's job to leave squeue")
    assert [other_job, "RUNNING"] in [line.split() for line in slurm_cluster.queue()]
    slurm_cluster.run("scancel", other_job)
    wait_until(lambda: slurm_cluster.queue() == [], 60, "the queue to empty")
