"""Runs submitted to SLURM: the job record, what ``squeue`` says about the job, ``scancel``.

``workbench launch --slurm`` writes ``<run_dir>/slurm.sbatch``
(:meth:`workbench.launch.LaunchPlan.slurm_script`: one ``srun`` task per node, each a torchrun
with the c10d rendezvous on the first node) and submits it with :func:`submit`, which records the
job in ``<run_dir>/slurm.json`` (job id, script, when and from which host).  With that record,
:class:`workbench.run_handle.Run` follows the job like any run: it is alive while ``squeue`` lists
it (pending, running, completing), and ``Run.stop()`` ends it with ``scancel``.  There is no
workbench supervisor under SLURM: the batch script records ``exit_status.json`` itself
(finished / failed from its ranks' exit, ``stopped`` when SLURM signalled the job: ``scancel``,
the time limit, a preemption).

A script submitted by hand (``sbatch <run_dir>/slurm.sbatch``) has no record: its run is followed
from its events and exit status alone.  Stdlib only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from workbench.run.files import read_json, write_json_atomic

__all__ = ["JOB_FILE", "submit", "job_record", "job_state", "cancel"]

#: the job record beside the batch script
JOB_FILE = "slurm.json"


def submit(run_dir: str | Path, script: str | Path, *, sbatch: str | None = None) -> str:
    """``sbatch`` the script and record the job in ``<run_dir>/slurm.json``; returns the job id.

    Raises :class:`RuntimeError` with sbatch's own message when it refuses the job (or is missing).
    """
    exe = sbatch or shutil.which("sbatch")
    if not exe:
        raise RuntimeError(f"sbatch not found on this machine; submit with: sbatch {script}")
    try:
        r = subprocess.run([exe, "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"sbatch {script} did not run: {e}") from e
    out = r.stdout.strip()
    if r.returncode != 0 or not out:
        raise RuntimeError(f"sbatch {script} failed (exit code {r.returncode}): {(r.stderr or r.stdout).strip()}")
    job_id = out.splitlines()[-1].split(";")[0].strip()  # "<id>" or "<id>;<cluster>"
    write_json_atomic(Path(run_dir) / JOB_FILE, {"job_id": job_id, "script": str(script), "submitted": time.time(),
                                                 "host": os.uname().nodename})
    return job_id


def job_record(run_dir: str | Path) -> dict | None:
    """``<run_dir>/slurm.json`` of a run submitted with :func:`submit`, else None."""
    rec = read_json(Path(run_dir) / JOB_FILE)
    return rec if isinstance(rec, dict) and rec.get("job_id") else None


def job_state(job_id: str | int, *, squeue: str | None = None) -> str | None:
    """The job's state as ``squeue`` shows it (PENDING, RUNNING, COMPLETING, ...); ``""`` once it has
    left the queue; None when this machine cannot tell (no squeue, no controller answering)."""
    exe = squeue or shutil.which("squeue")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:  # a job purged from the controller's memory is an "invalid job id"
        return "" if "Invalid job id" in r.stderr else None
    words = r.stdout.split()
    return words[0] if words else ""


def cancel(job_id: str | int, *, scancel: str | None = None) -> None:
    """``scancel <job>``: SLURM sends SIGTERM to every process of the job, SIGKILL after its KillWait.

    Raises :class:`RuntimeError` when scancel is missing or refuses (a job that already ended is fine).
    """
    exe = scancel or shutil.which("scancel")
    if not exe:
        raise RuntimeError(f"scancel not found on this machine: stop SLURM job {job_id} where SLURM's commands are")
    r = subprocess.run([exe, str(job_id)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "already completing or completed" not in r.stderr and "Invalid job id" not in r.stderr:
        raise RuntimeError(f"scancel {job_id} failed (exit code {r.returncode}): {r.stderr.strip()}")
