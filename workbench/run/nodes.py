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
  supervisor also rewrites ``heartbeat.json`` in its node directory about once a second
  (:mod:`workbench.launch.nodes`: the heartbeats and the supervisors' watch over the other nodes).

Stdlib only, like the rest of :mod:`workbench.run`.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["NODES_DIR", "HEARTBEAT_FILE", "LAUNCH_FILE", "EXIT_STATUS_FILE", "HOST_ENV", "node_dir", "node_ranks",
           "node_of_rank", "host_name"]

NODES_DIR = "nodes"
HEARTBEAT_FILE = "heartbeat.json"
LAUNCH_FILE = "launch.json"
EXIT_STATUS_FILE = "exit_status.json"
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
