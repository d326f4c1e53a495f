"""The nodes of a running multi-node job: heartbeats, and each supervisor's watch over the other nodes.

Each node's supervisor rewrites ``heartbeat.json`` in its node directory (:mod:`workbench.run.nodes`:
where each node keeps its files) about once a second (:func:`start_heartbeat`), and watches the
other nodes through their files (:class:`PeerWatch`): a node whose exit status says failed or
stopped, or whose heartbeat stopped changing (a node that froze or dropped off the network, which
gloo would wait on for its whole timeout), stops this node's job too.  The notebook side
(:class:`workbench.launch.handle.Run`) reads the same heartbeats (:class:`HeartbeatClock`) to
follow and report the whole job.  Stdlib only.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from workbench.run.files import read_json, write_json_atomic
from workbench.run.nodes import EXIT_STATUS_FILE, HEARTBEAT_FILE, host_name, node_dir

__all__ = ["DEFAULT_NODE_TIMEOUT", "write_heartbeat", "read_heartbeat", "start_heartbeat",
           "HeartbeatClock", "PeerWatch"]

#: seconds without a changed heartbeat after which another node counts as lost
DEFAULT_NODE_TIMEOUT = 60.0


def write_heartbeat(directory: str | Path, node_rank: int, seq: int) -> None:
    """Replace ``<directory>/heartbeat.json``: this node's supervisor is alive (``seq`` grows each beat)."""
    write_json_atomic(Path(directory) / HEARTBEAT_FILE,
                      {"node": int(node_rank), "seq": int(seq), "time": time.time(), "host": host_name(), "pid": os.getpid()},
                      indent=None, fsync=False)


def read_heartbeat(directory: str | Path) -> dict | None:
    return read_json(Path(directory) / HEARTBEAT_FILE)


class HeartbeatClock:
    """How long each node's heartbeat has gone unchanged.

    ``trust_clock=False`` (the supervisors): the age is measured on this machine's clock from the
    moment a heartbeat's content was last seen to change, so clocks that disagree between hosts
    never make a healthy node look lost; a node's first heartbeat counts as fresh.
    ``trust_clock=True`` (a notebook that just attached): a first sighting is dated by the
    writer's own timestamp, so a long-dead node shows as lost at once.
    """

    def __init__(self, *, trust_clock: bool = False):
        self.trust_clock = trust_clock
        self._seen: dict[int, tuple[tuple, float]] = {}

    def age(self, node: int, beat: dict | None, now: float | None = None) -> float | None:
        """Seconds since ``beat`` (``read_heartbeat``) last changed; None when the node never wrote one."""
        if not beat:
            return None
        now = time.time() if now is None else now
        key = (beat.get("seq"), beat.get("time"), beat.get("pid"))
        last = self._seen.get(node)
        if last is None or last[0] != key:
            since = now
            if last is None and self.trust_clock and isinstance(beat.get("time"), (int, float)):
                since = min(now, float(beat["time"]))
            self._seen[node] = (key, since)
            return now - since
        return now - last[1]


def start_heartbeat(directory: Path, node_rank: int, done: threading.Event, every: float = 1.0) -> threading.Thread:
    """A thread that rewrites this node's ``heartbeat.json`` every ``every`` seconds until ``done``."""
    def beat() -> None:
        seq = 0
        while True:
            seq += 1
            try:
                write_heartbeat(directory, node_rank, seq)
            except OSError:
                pass  # a full or flaky shared filesystem: the next beat tries again
            if done.wait(every):
                return

    t = threading.Thread(target=beat, name="heartbeat", daemon=True)
    t.start()
    return t


class PeerWatch:
    """A supervisor's watch over the other nodes of its run (see the module docstring).

    :meth:`check` returns ``(reason, peer)`` once this node's job should stop because of
    another node, else None: ``peer-failed`` / ``peer-stopped`` when a node's exit status said so
    ``grace`` seconds ago and this node still runs (torch usually tears the job down first),
    ``peer-lost`` when a node's heartbeat has not changed for ``timeout`` seconds and it wrote no
    exit status.  A node that has not started yet is not judged: the rendezvous waits for it.
    """

    def __init__(self, run_dir: str | Path, node_rank: int, nnodes: int, *, timeout: float = DEFAULT_NODE_TIMEOUT,
                 grace: float = 10.0):
        self.run_dir = Path(run_dir)
        self.others = [k for k in range(int(nnodes)) if k != int(node_rank)]
        self.timeout = float(timeout)
        self.grace = float(grace)
        self.clock = HeartbeatClock(trust_clock=False)
        self._ended_seen: dict[int, float] = {}

    def check(self, now: float | None = None) -> tuple[str, dict] | None:
        now = time.time() if now is None else now
        for k in self.others:
            d = node_dir(self.run_dir, k)
            ex = read_json(d / EXIT_STATUS_FILE)
            beat = read_heartbeat(d)
            if ex:
                status = ex.get("status")
                if status in ("failed", "stopped"):
                    first = self._ended_seen.setdefault(k, now)
                    if now - first >= self.grace:
                        why = f"node {k} {status}" + (f" (rank {ex['failed_rank']})" if ex.get("failed_rank") is not None else "")
                        return ("peer-failed" if status == "failed" else "peer-stopped",
                                {"node": k, "status": status, "failed_rank": ex.get("failed_rank"), "why": why,
                                 "host": (beat or {}).get("host")})
                continue  # finished: its heartbeat stops, as it should
            age = self.clock.age(k, beat, now)
            if age is not None and age > self.timeout:
                host = (beat or {}).get("host")
                return ("peer-lost", {"node": k, "status": "lost", "host": host,
                                      "why": f"node {k}" + (f" ({host})" if host else "") +
                                             f" sent no heartbeat for {age:.0f} s (its supervisor froze, died or lost the network)"})
        return None
