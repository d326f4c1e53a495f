"""Several backend runs in one launch: each rank runs the backend's ``Trainer`` once per run directory, in order.

Most of a tiny CPU-mode run's wall time is starting torchrun and importing torch and megatron-core in
every rank (~20 s each on a busy machine, against a few seconds of training), so tests that need
several runs of the same world size start the ranks once.  Each run is the backend's own
``Trainer(cfg, run_dir).run()`` (what ``python -m workbench.rank`` calls), with its own config,
run directory and events; between runs megatron's model-parallel state is torn down and built again
for the next run's layout (the default process group is kept).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from workbench.launch.stores import MODULE as TORCHRUN_MODULE, one_node_args

__all__ = ["run_trainers"]

ROOT = Path(__file__).resolve().parents[2]

DRIVER = r"""
import os, sys
from megatron.core import parallel_state
from workbench.backend import distributed
from workbench.rank.train import Trainer
from workbench.config import load_config
PRELUDE
for run_dir in sys.argv[1:]:
    code = Trainer(load_config(os.path.join(run_dir, "config.json")), run_dir).run()
    assert code == 0, (run_dir, code)
    parallel_state.destroy_model_parallel()
distributed.destroy()
"""


def run_trainers(runs: dict[Path, Any], nproc: int = 1, timeout: int = 300, env: dict | None = None, prelude: str = "") -> str:
    """Run each (run_dir -> RunConfig) in order on ``nproc`` ranks (torchrun when > 1); returns stdout.

    ``prelude``: Python run first in every rank (e.g. writing an initial checkpoint); it may initialise
    torch.distributed (``MASTER_PORT`` is the launch's) and must leave the default group up."""
    for run_dir, cfg in runs.items():
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        cfg.parallel.nproc_per_node = nproc
        cfg.save(Path(run_dir) / "config.json")
    # the launch's one-node torchrun, also for one rank: its rendezvous on a port the OS picks (a port chosen here
    # could be taken before a store binds it, on a busy machine: EADDRINUSE)
    head = [sys.executable, "-m", TORCHRUN_MODULE, *one_node_args(), "--nproc-per-node", str(nproc)]
    env = env or {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    script = Path(runs and next(iter(runs))).parent / "_trainer_runs.py"
    script.write_text(DRIVER.replace("PRELUDE", prelude))
    proc = subprocess.run(head + [str(script), *map(str, runs)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout
