"""Compatibility re-exports: ``from workbench.bridge import Run, quickstart_config, ...`` keeps working.

What lived here is split by role:

- :mod:`workbench.launch`: launch plans and checks, run directories, the process tree, the supervisor, exit status;
- :mod:`workbench.run_handle`: :class:`Run`, the notebook-side handle of a run;
- :mod:`workbench.notebook`: quickstart / generation / dashboard / papermill / sweep helpers;
- :mod:`workbench.cli`: the ``launch``, ``notebook run`` and ``sweep`` commands.

``python -m workbench.bridge supervise|exit-status`` (the command of older run directories and
SLURM scripts) runs :mod:`workbench.launch`'s entry point.  New code imports from those modules.
"""

from __future__ import annotations

import sys

from workbench.cli import _add_run_cli as add_cli  # noqa: F401
from workbench.launch import (  # noqa: F401
    BACKEND_ENTRY, STATUSES, LaunchPlan, _main, detect_gpus, launch_checks, launch_problems, new_run_dir, write_exit_status,
)
from workbench.notebook import (  # noqa: F401
    NotebookResult, generate_from_run, parse_grid, quickstart_config, record_metrics, run_notebook, sweep,
)
from workbench.run_handle import Failure, Run  # noqa: F401

__all__ = [
    "BACKEND_ENTRY", "STATUSES", "LaunchPlan", "Failure", "Run", "new_run_dir", "detect_gpus", "launch_problems",
    "launch_checks", "write_exit_status", "run_notebook", "NotebookResult", "sweep", "parse_grid", "record_metrics",
    "quickstart_config", "generate_from_run", "add_cli",
]

if __name__ == "__main__":
    sys.exit(_main())
