"""Runs submitted to SLURM: the batch script, the job record, what ``squeue`` says about the job, ``scancel``.

``workbench launch --slurm`` writes ``<run_dir>/slurm.sbatch`` (:func:`batch_script`: one ``srun``
task per node, each a torchrun with the c10d rendezvous on the first node) and submits it with
:func:`submit`, which records the job in ``<run_dir>/slurm.json`` (job id, script, when and from
which host).  With that record, :class:`workbench.launch.handle.Run` follows the job like any run
(:class:`JobWatch`): it is alive while ``squeue`` lists it (pending, running, completing), and
``Run.stop()`` ends it with ``scancel``.  The record is a file anyone who can write the run directory
can forge, so it never gets a job cancelled or followed on its word alone: its job id must be a SLURM
job id (:data:`JOB_ID`: digits, or ``<array job>_<task>``; else :class:`JobRecordError`, naming the
file), and SLURM must say that the job's batch script is this run directory's ``slurm.sbatch``
(``squeue -h -j ID -o %o``: :func:`job_script`).  A job that is not this run's is never cancelled
and counts as this run's job having left the queue; each refusal is said once.  There is no
workbench supervisor under SLURM: the batch script records ``exit_status.json`` itself
(finished / failed from its ranks' exit, ``stopped`` when SLURM signalled the job: ``scancel``,
the time limit, a preemption).

A script submitted by hand (``sbatch <run_dir>/slurm.sbatch``) has no record: its run is followed
from its events and exit status alone.  Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from workbench.launch.ownership import Refusal
from workbench.launch.plan import LaunchPlan
from workbench.launch.stores import MODULE as TORCHRUN_MODULE
from workbench.run.files import read_json, write_json_atomic

__all__ = ["JOB_FILE", "SCRIPT_FILE", "JOB_ID", "JobRecordError", "batch_script", "submit", "job_record", "job_state",
           "job_script", "cancel", "JobWatch"]

#: the job record beside the batch script
JOB_FILE = "slurm.json"
#: the batch script ``workbench launch --slurm`` writes into the run directory and submits
SCRIPT_FILE = "slurm.sbatch"
#: a SLURM job id as sbatch prints it: the job's number, or an array task's ``<array job>_<task>`` (ASCII digits)
JOB_ID = re.compile(r"[0-9]+(_[0-9]+)?")


class JobRecordError(ValueError):
    """A run directory's ``slurm.json`` whose job id is not a SLURM job id (not written by :func:`submit`)."""


def batch_script(plan: LaunchPlan, *, partition: str | None = None, account: str | None = None,
                 time_limit: str | None = None, gpus: bool = True, port: int | None = None) -> str:
    """``plan``'s SLURM batch script: one ``srun`` task per node, each running torchrun.

    Uses the c10d rendezvous on the first node of the allocation (PyTorch's recommended
    multi-node recipe), so every node runs the identical command; the endpoint is that node's
    address as SLURM reaches it (``NodeAddr``: its host name unless the cluster sets another)
    and ``port``, or a port derived from the job id (jobs sharing a node do not clash).  The
    script's output is the run's ``logs/launcher.log`` (``Run.log_tail()``).

    Stopping (``scancel``, the time limit, a preemption): SLURM sends SIGTERM to every process
    of the job, SIGKILL after its ``KillWait``.  Each rank gets that SIGTERM once, so the ranks
    stop together at a step boundary (``run_end`` "stopped", the checkpoint on exit).  torchrun
    starts with SIGTERM ignored and left out of its handled signals (``PET_SIGNALS_TO_HANDLE``,
    torch >= 2.8): it would forward a second SIGTERM, on which a rank leaves mid-step and its
    peers fail in their collective.  (The ranks inherit the ignored SIGTERM until the backend
    installs its handler, a few seconds into their start: a stop in that window ends at the
    SIGKILL.)  ``srun`` runs in the background so that the script sees the signal at once: it
    records ``exit_status.json`` as ``stopped`` then (SIGKILL may follow) and again when srun
    returns; otherwise it records the job's own result
    (:func:`workbench.launch.exit_status.write_exit_status`).
    """
    q = shlex.quote
    py, run_dir = q(plan.python), q(str(plan.run_dir))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={plan.run_dir.name}",
        f"#SBATCH --nodes={plan.nnodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",  # the whole node for its one torchrun: every core and all memory to the ranks
        "#SBATCH --mem=0",
        f"#SBATCH --output={plan.run_dir}/logs/launcher.log",
        "#SBATCH --open-mode=append",
    ]
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={plan.nproc_per_node}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if time_limit:
        lines.append(f"#SBATCH --time={time_limit}")
    rdzv_port = str(int(port)) if port else "$((15000 + SLURM_JOB_ID % 10000))"
    status = f"{py} -m workbench.launch exit-status --run-dir {run_dir}"
    lines += [
        "# generated by workbench.launch; submit with: sbatch " + q(str(plan.run_dir / "slurm.sbatch")),
        "# (partition / account / time limit: sbatch's SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT)",
        "set -uo pipefail",
        'started="$(date +%s)"',
        'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "# the rendezvous is on the first node, at its address as SLURM reaches it (NodeAddr: the host name",
        "# unless the cluster sets another), its store listening on that address only; one torchrun per node",
        'head_addr="$(sinfo -h -N -n "$head_node" -o %o 2>/dev/null | head -n 1)"',
        'head_addr="${head_addr:-$head_node}"',
        f'rdzv_port="{rdzv_port}"',
        "export PYTHONUNBUFFERED=1",
        'echo "[workbench] SLURM job $SLURM_JOB_ID: $SLURM_NNODES node(s) ($SLURM_JOB_NODELIST), '
        'rendezvous $head_addr:$rdzv_port"',
        "# Stopping (scancel, the time limit, a preemption): SLURM sends SIGTERM to every process of the job",
        "# and SIGKILL after KillWait.  Each rank gets that SIGTERM once and the ranks stop together at a step",
        "# boundary; torchrun leaves SIGTERM alone (forwarded, it would be a second one: ranks leave mid-step).",
        "# This script notes the signal and records the run as stopped (at once, and again at the end).",
        "export PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT",
        "signals=0",
        "trap 'signals=$((signals + 1))' TERM INT",
        "# srun (>= 22.05) does not inherit the job's CPUs: give the one task per node all of them",
        f"srun --kill-on-bad-exit=1 --cpus-per-task=\"$SLURM_CPUS_ON_NODE\" bash -c 'trap \"\" TERM; exec \"$@\"' torchrun {py} -m {TORCHRUN_MODULE} \\",
        '    --nnodes "$SLURM_NNODES" --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" \\',
        f'    --rdzv-endpoint "$head_addr:$rdzv_port" --nproc-per-node {plan.nproc_per_node} \\',
        f"    --log-dir {q(str(plan.log_dir))} --redirects 3 --tee 3 \\",
        "    " + shlex.join(plan.entry_args()) + " &",
        "srun_pid=$!",
        "while :; do",
        "    seen=$signals",
        '    wait "$srun_pid"; rc=$?',
        '    [ "$signals" -eq "$seen" ] && break  # srun has ended (a trapped signal only interrupts the wait)',
        f'    [ "$seen" -eq 0 ] && {status} --started "$started" --status stopped --reason slurm-signal',
        "done",
        'if [ "$signals" -gt 0 ]; then',
        f'    {status} --returncode "$rc" --started "$started" --status stopped --reason slurm-signal',
        "else",
        f'    {status} --returncode "$rc" --started "$started"',
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


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
    """``<run_dir>/slurm.json`` of a run submitted with :func:`submit` (None: there is none, or it is no JSON object).

    Raises :class:`JobRecordError`, naming the file, when its ``job_id`` is not a SLURM job id (:data:`JOB_ID`),
    so that nothing it says reaches ``squeue`` or ``scancel``."""
    path = Path(run_dir) / JOB_FILE
    rec = read_json(path)
    if rec is None:
        return None
    job = rec.get("job_id")
    if isinstance(job, bool) or not isinstance(job, (str, int)) or not JOB_ID.fullmatch(str(job)):
        raise JobRecordError(f"{path}: job_id {job!r} is not a SLURM job id (digits, or <array job>_<task>), so this file "
                             "was not written by `workbench launch --slurm`; no job it names is followed or cancelled -> "
                             "remove the file, or put back the job id sbatch printed for this run")
    return rec


def _squeue(job_id: str | int, fmt: str, squeue: str | None) -> list[str] | None:
    """``squeue -h -j ID -o FMT``'s non-empty lines; ``[]`` once the job has left the queue (a job purged from the
    controller's memory is an "invalid job id"); None when this machine cannot tell (no squeue, no controller)."""
    exe = squeue or shutil.which("squeue")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, "-h", "-j", str(job_id), "-o", fmt], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return [] if "Invalid job id" in r.stderr else None
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]


def job_state(job_id: str | int, *, squeue: str | None = None) -> str | None:
    """The job's state as ``squeue`` shows it (PENDING, RUNNING, COMPLETING, ...); ``""`` once it has
    left the queue; None when this machine cannot tell (no squeue, no controller answering)."""
    lines = _squeue(job_id, "%T", squeue)
    return None if lines is None else (lines[0].split()[0] if lines else "")


def job_script(job_id: str | int, *, squeue: str | None = None) -> str | None:
    """The job's batch script as SLURM recorded it (``squeue -h -j ID -o %o``: an absolute path, whatever path
    sbatch was given); ``""`` once the job has left the queue; None when this machine cannot tell (also when an
    array job's tasks name different scripts)."""
    lines = _squeue(job_id, "%o", squeue)
    if lines is None or len(set(lines)) > 1:
        return None
    return lines[0] if lines else ""


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


class JobWatch:
    """The SLURM job of one run directory (its ``slurm.json``), as ``Run`` follows and stops it: only a job whose
    batch script SLURM reports as this run directory's ``slurm.sbatch`` (see the module docstring)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._seen: tuple[float, str | None] | None = None  # (when, the job's state as this run's)
        self._owner: dict[str, bool] = {}  # job id -> whether its batch script is this run's (SLURM's word)
        #: why a job that ``slurm.json`` names was not taken as this run's (never cancelled), each said once
        self.refusals: list[Refusal] = []

    def refuse(self, why: str) -> None:
        if why not in self.refusals:
            self.refusals.append(Refusal(why))
            print(f"warning: {why}", file=sys.stderr, flush=True)

    @property
    def job(self) -> str | None:
        """The job id ``slurm.json`` records, once it is a SLURM job id; else None (a record whose id is not: refused)."""
        try:
            rec = job_record(self.run_dir)
        except JobRecordError as e:
            self.refuse(str(e))
            return None
        return str(rec["job_id"]) if rec else None

    @property
    def script(self) -> Path:
        """This run directory's batch script: the one a job of this run runs."""
        return self.run_dir / SCRIPT_FILE

    def _is_this_runs(self, script: str) -> bool:
        """SLURM's script path is this run directory's ``slurm.sbatch``: by name and directory, never through a
        link at ``slurm.sbatch`` (a link there could name another job's script)."""
        if self.script.is_symlink():
            return False
        path = Path(script)
        return path.name == SCRIPT_FILE and os.path.realpath(path.parent) == os.path.realpath(self.run_dir)

    def owned(self, job: str) -> bool | None:
        """Whether SLURM says ``job``'s batch script is this run's (False refuses it, saying why); None: squeue
        cannot tell, or the job has left the queue.  SLURM's answer for a job id is kept."""
        if job in self._owner:
            return self._owner[job]
        script = job_script(job)
        if not script:
            return None
        mine = self._owner[job] = self._is_this_runs(script)
        if not mine:
            self.refuse(f"{self.run_dir / JOB_FILE} names SLURM job {job}, whose batch script is {script}, not "
                        f"{self.script.absolute()}: not this run's job, so it is not cancelled or followed")
        return mine

    def state(self, max_age: float = 2.0) -> str | None:
        """This run's job's state (``""``: it has left the queue, or the job ``slurm.json`` names is not this run's);
        None: not a SLURM run, or squeue cannot tell.  squeue is asked at most every ``max_age`` seconds (the
        dashboard polls the status)."""
        job = self.job
        if job is None:
            return None
        seen = self._seen
        if seen is None or time.time() - seen[0] > max_age:
            st = job_state(job)
            if st:  # in the queue: this run's job only if SLURM says it runs this run's batch script
                owned = self.owned(job)
                st = st if owned else None if owned is None else ""
            seen = self._seen = (time.time(), st)
        return seen[1]

    def cancel(self, grace: float) -> bool:
        """``scancel`` this run's job and wait (``grace`` + 120 s at most) until it has left the queue: SLURM sends
        SIGTERM to every process of the job (the ranks stop at a step boundary, the batch script records
        ``stopped``) and SIGKILL to what is left after its KillWait.  Returns whether it was cancelled: a job that
        SLURM does not report as this run's is refused (said), one that has left the queue needs nothing."""
        job = self.job
        if job is None:
            return False
        self._owner.pop(job, None)  # asked afresh right before cancelling
        script = job_script(job)
        if script is None:
            self.refuse(f"{self.run_dir / JOB_FILE} names SLURM job {job}, and squeue cannot say whose batch script it runs "
                        f"(no squeue here, or the controller does not answer): not cancelled -> check it with "
                        f"squeue -j {job} -o %o where SLURM's commands are, then scancel {job}")
            return False
        if script == "":
            return False  # it has left the queue: nothing to cancel
        if not self.owned(job):
            return False
        cancel(job)
        end = time.time() + grace + 120.0
        while self.state(max_age=0.0) and time.time() < end:
            time.sleep(0.5)
        return True
