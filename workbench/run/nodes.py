"""The nodes of a multi-node run: one shared run directory, one set of launch files per node.

A run over several nodes (``parallel.nnodes > 1``, one ``workbench launch --node-rank K`` per
node) lives in ONE run directory on a filesystem that every node mounts (NFS, Lustre: what
megatron-core's dataset cache and ``dist_checkpointing`` assume anyway):

- shared by the nodes: ``config.json`` (the same config on every node), ``events/rank-<r>.jsonl``
  (``r`` is the global rank, ``node_rank * nproc_per_node + local_rank``: torchrun's static
  rendezvous), ``data_cache/`` and ``checkpoints/``;
- one set per node (:func:`node_dir`): node 0's are the run directory's own files, exactly as
  for a one-node run (``launch.json``, ``exit_status.json``, ``command.sh``, ``logs/launcher.log``,
  ``logs/torchrun/``); node ``k > 0`` has the same files under ``nodes/node-<k>/``.  Each node's
  supervisor also rewrites ``heartbeat.json`` in its node directory about once a second.

Every supervisor watches the other nodes through these files (:class:`PeerWatch`): a node whose
exit status says failed or stopped, or whose heartbeat stopped changing (a node that froze or
dropped off the network, which gloo would wait on for its whole timeout), stops this node's job
too.  The notebook side (``Run``) reads every node's files to follow and report the whole job.
:func:`lost_peer` tells an error that only says "another process went away" (a collective whose
peer died) from the failure that caused it.

Stdlib only, like the rest of :mod:`workbench.run`.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from workbench.run.files import read_json, write_json_atomic

__all__ = ["NODES_DIR", "HEARTBEAT_FILE", "LAUNCH_FILE", "EXIT_STATUS_FILE", "DEFAULT_NODE_TIMEOUT", "node_dir", "node_ranks", "node_of_rank",
           "host_name", "write_heartbeat", "read_heartbeat", "HeartbeatClock", "PeerWatch", "lost_peer"]

NODES_DIR = "nodes"
HEARTBEAT_FILE = "heartbeat.json"
LAUNCH_FILE = "launch.json"
EXIT_STATUS_FILE = "exit_status.json"
#: seconds without a changed heartbeat after which another node counts as lost
DEFAULT_NODE_TIMEOUT = 60.0
#: the environment variable that names this machine in the node files (default: the host name)
HOST_ENV = "WORKBENCH_NODE_HOST"


def node_dir(run_dir: str | Path, node_rank: int) -> Path:
    """Where node ``node_rank`` keeps its launch files: the run directory for node 0, else ``nodes/node-<k>``."""
    run_dir = Path(run_dir)
    return run_dir if int(node_rank) == 0 else run_dir / NODES_DIR / f"node-{int(node_rank)}"


def node_ranks(node_rank: int, nproc_per_node: int) -> list[int]:
    """The global ranks of a node (static rendezvous: ``node_rank * nproc_per_node + local_rank``)."""
    return list(range(int(node_rank) * int(nproc_per_node), (int(node_rank) + 1) * int(nproc_per_node)))


def node_of_rank(rank: int, nproc_per_node: int) -> int:
    return int(rank) // max(int(nproc_per_node), 1)


def host_name() -> str:
    """This machine's name as the node files record it."""
    return os.environ.get(HOST_ENV) or os.uname().nodename


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

