"""What a run is launched with: its run directory, the process counts it runs at, its torchrun command.

- :class:`LaunchPlan`: everything needed to write one node's exact torchrun command (the SLURM batch
  script of the same run: :func:`workbench.launch.slurm.batch_script`).
- :func:`new_run_dir`: a fresh, unique run directory path.
- :func:`apply_overrides`: the config with the launch's process counts written in.
- :func:`local_torchrun`: the head of a one-node torchrun command for generation's and verification's ranks.

Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from workbench.config import RunConfig
from workbench.launch.stores import MODULE as TORCHRUN_MODULE
from workbench.launch.stores import one_node_args
from workbench.run import nodes

__all__ = ["BACKEND_ENTRY", "DEFAULT_RUN_ROOT", "DEFAULT_RDZV_PORT", "LaunchPlan", "new_run_dir", "apply_overrides",
           "local_torchrun"]

#: torchrun's entry for the real backend; tests may launch a script path instead.
BACKEND_ENTRY: tuple[str, ...] = ("-m", "workbench.rank")
DEFAULT_RUN_ROOT = "runs"
DEFAULT_RDZV_PORT = 29500


@dataclass
class LaunchPlan:
    """Everything needed to write the exact torchrun command of one node of a run."""

    run_dir: Path
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    python: str = field(default_factory=lambda: sys.executable)
    entry: tuple[str, ...] = BACKEND_ENTRY

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir).absolute()
        self.entry = tuple(str(e) for e in self.entry)
        if self.rdzv_id is None:
            # must be the same on every node (each node may have its own run directory)
            self.rdzv_id = "workbench"

    @property
    def config_path(self) -> Path:
        return self.run_dir / "config.json"

    @property
    def node_dir(self) -> Path:
        """This node's launch files (the run directory itself on node 0: :mod:`workbench.run.nodes`)."""
        return nodes.node_dir(self.run_dir, self.node_rank)

    @property
    def log_dir(self) -> Path:
        return self.node_dir / "logs" / "torchrun"

    def torchrun_args(self) -> list[str]:
        """Rendezvous + logging options.  One node: a c10d rendezvous on the loopback at a port the OS picks
        (no clashes, nothing listening beyond 127.0.0.1: :mod:`workbench.launch.stores`); several nodes: the
        static rendezvous at ``rdzv_endpoint``, whose store node 0 opens on that address only."""
        if self.nnodes == 1 and not self.rdzv_endpoint:
            args = one_node_args()
        else:
            endpoint = self.rdzv_endpoint or f"localhost:{DEFAULT_RDZV_PORT}"
            # static rendezvous: node ranks are the ones given, so global rank = node_rank*nproc + local_rank
            args = ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--rdzv-endpoint", endpoint, "--rdzv-id", str(self.rdzv_id)]
        return args + ["--nproc-per-node", str(self.nproc_per_node), "--log-dir", str(self.log_dir),
                       "--redirects", "3", "--tee", "3"]

    def entry_args(self) -> list[str]:
        return [*self.entry, "--config", str(self.config_path), "--run-dir", str(self.run_dir)]

    def command(self) -> list[str]:
        """The torchrun command line this node runs (torch's torchrun through :mod:`workbench.launch.stores`)."""
        return [self.python, "-m", TORCHRUN_MODULE, *self.torchrun_args(), *self.entry_args()]

    def shell(self) -> str:
        return shlex.join(self.command())


def local_torchrun(nproc_per_node: int, *, python: str | None = None) -> list[str]:
    """The head of a one-node torchrun command (up to the entry point) whose rendezvous and stores listen
    on the loopback only: generation's and verification's ranks (training's: :class:`LaunchPlan`)."""
    return [python or sys.executable, "-m", TORCHRUN_MODULE, *one_node_args(), "--nproc-per-node", str(int(nproc_per_node))]


def new_run_dir(name: str, run_root: str | Path | None = None) -> Path:
    """A fresh, unique run directory path ``<root>/<name>-<UTC timestamp>-<4 hex>`` (not created)."""
    root = Path(run_root or os.environ.get("WORKBENCH_RUNS", DEFAULT_RUN_ROOT))
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return (root / f"{safe}-{stamp}-{uuid.uuid4().hex[:4]}").absolute()


def apply_overrides(cfg: RunConfig, *, nproc_per_node: int | None = None, nnodes: int | None = None) -> RunConfig:
    """``cfg`` with the launch's process counts written in (so the backend sees the same world size)."""
    overrides: dict[str, int] = {}
    if nproc_per_node is not None:
        overrides["parallel.nproc_per_node"] = int(nproc_per_node)
    if nnodes is not None:
        overrides["parallel.nnodes"] = int(nnodes)
    return cfg.replace(**overrides) if overrides else cfg
