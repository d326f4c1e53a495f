"""A node's ``exit_status.json``: how its job ended and which rank caused a failure.

The **root cause** of a failed job, in this order:

1. a rank that *died*: killed by a signal (``SIGKILL`` of the OOM killer, ``SIGSEGV``, ...) or
   exited with a non-zero code without an ``error`` event of its own, as torchrun's failure report
   says (``logs/launcher.log``), among the failures torchrun observed first (a rank that the
   teardown signalled later, or that exited on the stop signal, is a consequence);
2. else the first rank that raised an error of its own (an ``error`` event whose message is not
   just that a peer went away: gloo's "connection reset by peer" on the survivors is a symptom,
   :func:`lost_peer`);
3. else the first rank that raised at all, else the rank torchrun reports as its root cause.

A rank that died by a signal is recorded with ``failed_exitcode`` (negative), ``failed_signal``
(``"SIGKILL"``) and ``failed_message`` (torchrun's "Signal 9 (SIGKILL) received by PID ...").

Stdlib only.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from workbench.run import nodes
from workbench.run.files import read_json, write_json_atomic
from workbench.run.reader import RunReader

__all__ = ["STATUSES", "lost_peer", "torchrun_failures", "root_cause", "write_exit_status"]

STATUSES = ("starting", "running", "finished", "failed", "stopped")
#: signals a job's own teardown or stop sends its ranks (torchrun, the supervisor, Run.stop, SLURM)
_TEARDOWN_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
#: exit codes of a rank that left on such a signal (the backend's stop: 128 + the signal)
_TEARDOWN_CODES = {128 + int(s) for s in _TEARDOWN_SIGNALS}

# what a collective or store says when the process on the other end went away (gloo, NCCL, c10d)
_PEER_LOST = re.compile("|".join([
    r"connection closed by peer", r"connection reset by peer", r"broken pipe", r"connection refused",
    r"timed out waiting", r"timeout waiting", r"operation timed out", r"remote process exited",
    r"network error", r"communicator was aborted", r"ncclremoteerror", r"failed to recv", r"socket timeout",
    r"remote worker crash",
]), re.IGNORECASE)
_PEER_LOST_TYPES = ("DistNetworkError", "DistStoreError")


def lost_peer(message: str | None, exception: str | None = None) -> bool:
    """True when an error only reports that another process of the job vanished or stalled
    (a symptom on the surviving ranks), not a failure of its own."""
    if exception and exception.rsplit(".", 1)[-1] in _PEER_LOST_TYPES:
        return True
    return bool(message and _PEER_LOST.search(message))


_BLOCK = re.compile(r"^\[\d+\]:\s*$", re.M)
_FIELD = re.compile(r"^\s*(time|rank|exitcode|traceback)\s*:\s*(.*?)\s*$", re.M)


def _block(text: str) -> dict:
    fields: dict[str, str] = {}
    for m in _FIELD.finditer(text):
        fields.setdefault(m.group(1), m.group(2))
    out: dict = {}
    for key in ("rank", "exitcode"):
        m = re.match(r"-?\d+", fields.get(key, ""))
        if m:
            out[key] = int(m.group(0))
    if "rank" not in out:
        return {}
    out["time"] = fields.get("time", "")
    msg = fields.get("traceback", "")
    if msg and not msg.startswith("To enable traceback"):
        out["message"] = msg
    code = out.get("exitcode")
    if isinstance(code, int) and code < 0:
        try:
            out["signal"] = signal.Signals(-code).name
        except ValueError:
            out["signal"] = f"signal {-code}"
    return out


def torchrun_failures(text: str) -> tuple[dict, list[dict]]:
    """torchrun's failure report in ``text`` (its last one): (the root cause, every failure, root first).

    Each failure is ``{rank (global), exitcode, time, message?, signal?}``; ({}, []) when there is none."""
    i = text.rfind("Root Cause (first observed failure)")
    if i < 0:
        return {}, []
    j = text.rfind("Failures:", 0, i)
    end = text.find("=" * 20, i)
    root_text = text[i:end if end > 0 else len(text)]
    starts = [m.start() for m in _BLOCK.finditer(root_text)]
    root = _block(root_text[starts[0]:]) if starts else {}
    others: list[dict] = []
    if j >= 0:
        part = text[j:i]
        starts = [m.start() for m in _BLOCK.finditer(part)] + [len(part)]
        others = [b for b in (_block(part[a:b]) for a, b in zip(starts, starts[1:])) if b]
    failures = ([root] if root else []) + [b for b in others if b.get("rank") != root.get("rank")]
    return root, failures


def _died(f: dict, raised: set) -> bool:
    """A failure that is a death of its own: a signal the teardown does not send, or an exit code
    without an error event (and not the code of a rank leaving on the stop signal)."""
    code = f.get("exitcode")
    if not isinstance(code, int) or code == 0:
        return False
    if code < 0:
        return -code not in {int(s) for s in _TEARDOWN_SIGNALS}
    return f["rank"] not in raised and code not in _TEARDOWN_CODES


def root_cause(errors: list, failures: list[dict], root: dict) -> tuple[int | None, dict]:
    """(the failed rank, torchrun's failure record of it or {}) by the rule of the module docstring.

    ``errors``: the ``error`` events of the ranks in question; ``failures`` / ``root``: from
    :func:`torchrun_failures`."""
    raised = {e.rank for e in errors}
    first_time = min((f["time"] for f in failures if f.get("time")), default=None)
    died = [f for f in failures if _died(f, raised) and (first_time is None or not f.get("time") or f["time"] == first_time)]
    if died:
        return died[0]["rank"], died[0]
    own = [e for e in errors if not lost_peer(e.get("message"), e.get("exception") or e.get("type"))]
    chosen = min(own or errors, key=lambda e: e.get("time") or 0, default=None)
    rank = chosen.rank if chosen is not None else root.get("rank")
    return rank, next((f for f in failures if f.get("rank") == rank), {})


def write_exit_status(run_dir: str | Path, returncode: int | None, *, reason: str | None = None,
                      status: str | None = None, started: float | None = None,
                      reader: RunReader | None = None, node_rank: int = 0, peer: dict | None = None,
                      failed_rank: int | None = None, extra: dict | None = None) -> dict:
    """Write ``exit_status.json`` (node ``node_rank``'s: :mod:`workbench.run.nodes`): status, return code,
    failed rank (:func:`root_cause` over this node's ranks; ``failed_rank`` given: that one).

    ``peer``: the other node whose failure, stop or loss ended this node's job (``reason`` says which).
    ``extra``: more fields to record (e.g. the supervisor's verdict on a stalled rank).
    """
    run_dir = Path(run_dir)
    ndir = nodes.node_dir(run_dir, node_rank)
    reader = reader if reader is not None else RunReader(run_dir)
    meta = read_json(ndir / nodes.LAUNCH_FILE) or {}
    nnodes, nproc = int(meta.get("nnodes") or 1), int(meta.get("nproc_per_node") or 0)
    mine = set(nodes.node_ranks(node_rank, nproc)) if nnodes > 1 and nproc else None
    errors = reader.records("error")
    own_errors = [e for e in errors if mine is None or e.rank in mine]
    ends = reader.records("run_end")
    own_ends = [e for e in ends if mine is None or e.rank in mine]
    if status is None:
        if reason in ("stopped", "kernel-exited", "peer-stopped"):
            status = "stopped"
        elif reason in ("peer-failed", "peer-lost"):
            status = "failed"
        elif returncode == 0:
            status = "stopped" if any(e.get("status") == "stopped" for e in ends) else "finished"
        elif (mine is not None and not own_errors and own_ends
              and {e.rank for e in own_ends} >= mine and all(e.get("status") == "stopped" for e in own_ends)):
            status = "stopped"  # another node was stopped and every rank here agreed to stop with it (exit code 143)
        else:
            status = "failed"
    cause: dict = {}
    if failed_rank is None and status == "failed":
        try:
            root, failures = torchrun_failures((ndir / "logs" / "launcher.log").read_text(errors="replace")[-40000:])
        except OSError:
            root, failures = {}, []
        failed_rank, cause = root_cause(own_errors, failures, root)
    if failed_rank is None and own_errors:
        failed_rank = own_errors[0].get("rank")
    if failed_rank is None and errors:
        failed_rank = errors[0].get("rank")
    data = {
        "status": status,
        "returncode": returncode,
        "reason": reason or status,
        "failed_rank": failed_rank,
        "started": started,
        "ended": time.time(),
        "seconds": (time.time() - started) if started else None,
    }
    if cause:
        data["failed_exitcode"] = cause.get("exitcode")
        if cause.get("signal"):
            data["failed_signal"] = cause["signal"]
        if cause.get("message"):
            data["failed_message"] = cause["message"]
        elif cause.get("signal"):
            data["failed_message"] = f"killed by {cause['signal']}"
    if nnodes > 1:
        data.update(node=node_rank, nnodes=nnodes, host=meta.get("host"), ranks=sorted(mine) if mine else None)
    if peer:
        data["peer"] = peer
    data.update(extra or {})
    ndir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(ndir / nodes.EXIT_STATUS_FILE, data)
    return data
