"""Which rank made a run fail, and why: the :class:`Failure` a notebook shows.

:func:`diagnose` reads what the run left behind, in this order: the rank its exit status names
(:mod:`workbench.launch.exit_status`: a rank that died by a signal or an exit code of its own comes
before the first that raised), with its ``error`` event, else the traceback in its stderr log,
else how it exited; while the job is being torn down, the first rank that raised (an error that
only says a peer went away, :func:`workbench.launch.exit_status.lost_peer`, is passed over for a
rank's own); else torchrun's exit code with the launcher log's tail.  A multi-node run: the
failure that started it, with its node (a rank's death, its own error, or a lost node).
Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from workbench.launch.exit_status import lost_peer
from workbench.run.events import Event

__all__ = ["Failure", "diagnose", "tail", "last_traceback"]


@dataclass
class Failure:
    """Which rank failed and why, for the notebook to show."""

    rank: int | None
    message: str
    traceback: str
    source: str  # "event" (the rank's error event) | "stderr" (tail of its log) | "launcher" | "node" (a node went silent)
    log_path: str | None = None
    node: int | None = None  # multi-node runs: the node of the failing rank (or the node that was lost)

    def __str__(self) -> str:
        if self.rank is not None:
            where = f"rank {self.rank}" + (f" (node {self.node})" if self.node is not None else "")
        else:
            where = f"node {self.node}" if self.node is not None else "unknown rank"
        return f"{where} failed: {self.message}\n{self.traceback}".rstrip()


class _Diagnosis:
    """One diagnosis: the run's logs and how a rank maps to its node."""

    def __init__(self, rank_log: Callable[[int], Path | None], launcher_log: Path, node_of: Callable[[Any], int | None]):
        self.rank_log, self.launcher_log, self.node_of = rank_log, launcher_log, node_of

    def event(self, e: Event) -> Failure:
        log = self.rank_log(e["rank"]) if isinstance(e.get("rank"), int) else None
        etype = e.get("type") or e.get("exception")
        msg = e.get("message") or etype or "error"
        if etype and etype not in msg:
            msg = f"{etype}: {msg}"
        return Failure(e.get("rank"), msg, e.get("traceback") or "", "event", str(log) if log else None, self.node_of(e.get("rank")))

    def log(self, rank: int, ex: dict) -> Failure | None:
        """A rank that failed without an error event: the traceback in its stderr log, else how it exited."""
        log = self.rank_log(rank)
        if log is None:
            return None
        tb = last_traceback(log.read_text(errors="replace"))
        code = ex.get("failed_exitcode")
        if ex.get("stall"):  # the supervisor found it stalled: its verdict, and the stacks it wrote
            msg = ex.get("failed_message") or f"rank {rank} stalled"
            tb = f"every rank's stacks: {ex['stall'].get('stacks')}\n" + tail(Path(ex["stall"].get("stacks") or log), 60)
        elif ex.get("failed_signal"):  # killed: whatever its log last printed is not why
            msg = f"exited with code {code} (killed by {ex['failed_signal']})" + (f": {ex['failed_message']}" if ex.get("failed_message") else "")
            tb = tail(log, 30)
        elif tb:
            last = [ln for ln in tb.strip().splitlines() if ln.strip()]
            msg = last[-1] if last else f"exit code {code}"
        elif code is not None:  # killed (a signal: negative code) or exited without a Python traceback
            msg = f"exited with code {code}" + (f": {ex['failed_message']}" if ex.get("failed_message") else "")
            tb = tail(log, 30)
        else:
            tb = tail(log, 30)
            last = [ln for ln in tb.strip().splitlines() if ln.strip()]
            msg = last[-1] if last else f"exit code {ex.get('returncode')}"
        return Failure(rank, msg, tb, "stderr", str(log), self.node_of(rank))

    def job(self, errors: list[Event], views: list[dict]) -> Failure | None:
        """A multi-node run's first cause; None leaves it to the one-node rules."""
        reported = {e.get("rank") for e in errors}
        for v in views:  # a rank that died (a signal, or without an error event of its own)
            ex = v["exit_status"] or {}
            r = ex.get("failed_rank")
            if (v["status"] == "failed" and not ex.get("peer") and r is not None
                    and (r not in reported or ex.get("failed_signal"))):
                f = self.log(int(r), ex)
                if f is not None:
                    f.node = v["node"]
                    return f
                return Failure(int(r), f"rank {r} failed (torchrun exit code {ex.get('returncode')})", "", "launcher", None, v["node"])
        own = [e for e in errors if not lost_peer(e.get("message"), e.get("exception") or e.get("type"))]
        if own:
            return self.event(min(own, key=lambda r: r.get("time", 0)))
        for v in views:
            if v["status"] == "lost":
                return Failure(None, f"node {v['node']} lost: {v['why']}", "", "node", None, v["node"])
        for v in views:
            peer = (v["exit_status"] or {}).get("peer") or {}
            if peer.get("status") == "lost":
                return Failure(None, peer.get("why") or f"node {peer.get('node')} lost", "", "node", None, peer.get("node"))
        return None


def diagnose(errors: list[Event], exit_status: dict | None, *, rank_log: Callable[[int], Path | None], launcher_log: Path,
             node_of: Callable[[Any], int | None], node_views: Callable[[], list[dict]] | None = None) -> Failure | None:
    """The failure of a run (see the module docstring), or None.

    ``errors``: every rank's ``error`` events; ``exit_status``: this node's ``exit_status.json``;
    ``rank_log(rank)``: a global rank's stderr log; ``launcher_log``: this node's ``logs/launcher.log``;
    ``node_of(rank)``: the node of a rank (None in a one-node run); ``node_views``: a multi-node run's
    nodes (``Run.nodes()``), None for a one-node run."""
    d = _Diagnosis(rank_log, launcher_log, node_of)
    if node_views is not None:
        f = d.job(errors, node_views())
        if f is not None:
            return f
    ex = exit_status
    if ex and ex.get("status") == "failed" and ex.get("failed_rank") is not None:
        rank = int(ex["failed_rank"])
        own = [e for e in errors if e.get("rank") == rank]
        if own and not ex.get("failed_signal"):
            return d.event(min(own, key=lambda r: r.get("time", 0)))
        f = d.log(rank, ex)
        if f is not None:
            return f
        if ex.get("failed_signal") or ex.get("failed_message"):
            return Failure(rank, ex.get("failed_message") or f"killed by {ex['failed_signal']}", "", "launcher",
                           str(launcher_log), node_of(rank))
    if errors:
        own = [e for e in errors if not lost_peer(e.get("message"), e.get("exception") or e.get("type"))]
        return d.event(min(own or errors, key=lambda r: r.get("time", 0)))
    if not ex or ex.get("status") != "failed":
        return None
    return Failure(ex.get("failed_rank"), f"torchrun exited with code {ex.get('returncode')}", tail(launcher_log, 40), "launcher",
                   str(launcher_log))


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a text file (of its last 64 KiB); "" when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(size - 64 * 1024, 0))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def last_traceback(text: str) -> str:
    """The last Python traceback in ``text`` (to its end), "" if there is none."""
    i = text.rfind("Traceback (most recent call last)")
    return text[i:].strip() if i >= 0 else ""
