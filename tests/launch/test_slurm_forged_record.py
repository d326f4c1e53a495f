"""A run directory's ``slurm.json`` is a file anyone who can write the directory can forge: ``Run.stop()`` and the
run's status never ``scancel`` / trust a job it names unless the id is a SLURM job id and SLURM itself says the job's
batch script is this run directory's ``slurm.sbatch``.

SLURM's commands are the boundary: fake ``squeue`` / ``scancel`` executables on ``PATH`` answer from a queue file
(job id, state, batch script path, as ``squeue -o %T`` / ``-o %o`` print them) and log every call.  The real
cluster's version of the same (a real job of another script is left running): ``tests/slurm/test_slurm.py``.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from workbench.config import preset
from workbench.launch import Run
from workbench.launch.slurm import JOB_FILE, JobRecordError, job_record

FAKE = f"""#!{sys.executable}
import json, os, sys
root = os.environ["FAKE_SLURM"]
queue_file = os.path.join(root, "queue.json")
queue = json.load(open(queue_file))
tool, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.path.join(root, "calls.log"), "a") as log:
    log.write(json.dumps([tool, *args]) + "\\n")
if tool == "scancel":
    job = args[0]
    if job not in queue:
        sys.stderr.write("scancel: error: Invalid job id specified\\n")
        sys.exit(1)
    del queue[job]
    json.dump(queue, open(queue_file, "w"))
    sys.exit(0)
job, fmt = args[args.index("-j") + 1], args[args.index("-o") + 1]
if job not in queue:
    sys.stderr.write("slurm_load_jobs error: Invalid job id specified\\n")
    sys.exit(1)
state, script = queue[job]
print({{"%T": state, "%o": script}}[fmt])
"""


@pytest.fixture()
def fake_slurm(tmp_path, monkeypatch):
    """(queue dict to fill, a function returning the calls made); squeue and scancel on PATH."""
    root = tmp_path / "fake-slurm"
    (root / "bin").mkdir(parents=True)
    for tool in ("squeue", "scancel"):
        exe = root / "bin" / tool
        exe.write_text(FAKE)
        exe.chmod(0o755)
    (root / "queue.json").write_text("{}")
    monkeypatch.setenv("FAKE_SLURM", str(root))
    monkeypatch.setenv("PATH", f"{root / 'bin'}:{__import__('os').environ['PATH']}")

    def set_queue(jobs: dict) -> None:
        (root / "queue.json").write_text(json.dumps(jobs))

    def calls() -> list[list[str]]:
        log = root / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def queue() -> dict:
        return json.loads((root / "queue.json").read_text())

    return set_queue, calls, queue


def _run_dir(tmp_path, job_id, name="run"):
    run_dir = tmp_path / name
    (run_dir / "events").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    preset("tiny").save(run_dir / "config.json")
    (run_dir / "slurm.sbatch").write_text("#!/bin/bash\n")
    (run_dir / JOB_FILE).write_text(json.dumps({"job_id": job_id, "script": str(run_dir / "slurm.sbatch"),
                                                "submitted": time.time(), "host": "h"}))
    return run_dir


@pytest.mark.parametrize("job_id", ["--user=root", "-1", "1 2", "12\n", "", "12;34", "\u0661\u0662", "7_", "_7", 12.5, True,
                                    ["12"], None, {"id": 12}])
def test_a_forged_job_id_is_refused_naming_the_file(tmp_path, fake_slurm, capsys, job_id):
    set_queue, calls, queue = fake_slurm
    set_queue({"12": ["RUNNING", "/elsewhere/job.sh"], "1": ["RUNNING", "/elsewhere/a.sh"]})
    run_dir = _run_dir(tmp_path, job_id)
    with pytest.raises(JobRecordError) as e:
        job_record(run_dir)
    assert str(run_dir / JOB_FILE) in str(e.value) and "->" in str(e.value)
    run = Run.attach(run_dir)
    assert not run.is_alive()
    run.stop(grace=0.1)
    assert calls() == []  # neither squeue nor scancel was asked about anything this file says
    assert set(queue()) == {"12", "1"}
    err = capsys.readouterr().err
    assert str(run_dir / JOB_FILE) in err and "not a SLURM job id" in err
    assert any(str(run_dir / JOB_FILE) in why for why in run.refusals)
    assert run.exit_status is None  # nothing was stopped, nothing is recorded as stopped


def test_a_real_job_of_another_script_is_neither_cancelled_nor_followed(tmp_path, fake_slurm, capsys):
    set_queue, calls, queue = fake_slurm
    run_dir = _run_dir(tmp_path, "4242")
    other = tmp_path / "other-run" / "slurm.sbatch"  # another run's job (or anyone's): its own batch script
    set_queue({"4242": ["RUNNING", str(other)]})
    run = Run.attach(run_dir)
    assert not run.is_alive()  # the job in the queue is not this run's
    run.stop(grace=0.1)
    assert ["scancel", "4242"] not in calls() and "4242" in queue()
    assert ["squeue", "-h", "-j", "4242", "-o", "%o"] in calls()
    err = capsys.readouterr().err
    assert "4242" in err and str(other) in err and str(run_dir / "slurm.sbatch") in err and "not cancelled" in err
    assert run.exit_status is None


def test_the_run_s_own_job_is_cancelled(tmp_path, fake_slurm):
    """The control: slurm.json of a run submitted by ``workbench launch --slurm`` (the job's script is this run
    directory's ``slurm.sbatch``, as SLURM records it: absolute) gets its job cancelled and the run ``stopped``."""
    set_queue, calls, queue = fake_slurm
    run_dir = _run_dir(tmp_path, "77")
    set_queue({"77": ["RUNNING", str(run_dir / "slurm.sbatch")], "78": ["RUNNING", "/elsewhere/job.sh"]})
    run = Run.attach(run_dir)
    assert run.is_alive() and run.status == "starting"
    assert run.stop(grace=0.1) == "stopped"
    assert ["scancel", "77"] in calls() and set(queue()) == {"78"}
    assert run.exit_status["status"] == "stopped" and not run.refusals


def test_an_array_task_id_is_accepted(tmp_path, fake_slurm):
    set_queue, calls, queue = fake_slurm
    run_dir = _run_dir(tmp_path, "77_3")
    set_queue({"77_3": ["PENDING", str(run_dir / "slurm.sbatch")]})
    assert job_record(run_dir)["job_id"] == "77_3"
    assert Run.attach(run_dir).stop(grace=0.1) == "stopped"
    assert ["scancel", "77_3"] in calls()


def test_a_link_at_the_run_s_batch_script_cannot_adopt_another_job(tmp_path, fake_slurm, capsys):
    """``slurm.sbatch`` replaced by a link to another job's script (by anyone who can write the run directory) does
    not make that job this run's: it is neither followed nor cancelled."""
    set_queue, calls, queue = fake_slurm
    run_dir = _run_dir(tmp_path, "4243")
    victim = tmp_path / "victim" / "job.sh"
    victim.parent.mkdir()
    victim.write_text("#!/bin/bash\n")
    (run_dir / "slurm.sbatch").unlink()
    (run_dir / "slurm.sbatch").symlink_to(victim)
    set_queue({"4243": ["RUNNING", str(victim)]})
    run = Run.attach(run_dir)
    assert not run.is_alive()
    run.stop(grace=0.1)
    assert ["scancel", "4243"] not in calls() and "4243" in queue()
    assert "not cancelled" in capsys.readouterr().err
