"""A run's lifecycle: checks, the launch plan, the supervisor, the nodes, stopping, exit status, the ``Run`` handle.

    caller --Popen(start_new_session)--> supervisor (``python -m workbench.launch supervise``)
                                            +--> torchrun --> rank processes (own sessions)

| module | holds |
| --- | --- |
| :mod:`~workbench.launch.plan` | :class:`LaunchPlan` (the torchrun command of one node), run directories, the launch's overrides |
| :mod:`~workbench.launch.checks` | every check made before anything starts (:func:`launch_checks`) |
| :mod:`~workbench.launch.start` | :func:`start_run` (training) and :func:`run_supervised` (generation's, conversion's ranks) |
| :mod:`~workbench.launch.supervisor` | the supervisor process and the ``python -m workbench.launch`` entry points |
| :mod:`~workbench.launch.processes` | psutil helpers and :func:`~workbench.launch.processes.stop`, the one SIGTERM-wait-SIGKILL |
| :mod:`~workbench.launch.ownership` | which recorded processes are the run's; the job dies with its supervisor |
| :mod:`~workbench.launch.stall` | a rank without progress past the run's own rhythm is stalled |
| :mod:`~workbench.launch.nodes` | a multi-node run's heartbeats and each supervisor's watch over the other nodes |
| :mod:`~workbench.launch.exit_status` | ``exit_status.json``: how the job ended, which rank caused a failure |
| :mod:`~workbench.launch.slurm` | the SLURM batch script, ``sbatch``, ``squeue``, ``scancel`` |
| :mod:`~workbench.launch.stores` | torchrun with its stores bound where named (entry: ``python -m workbench.launch.torchrun``) |
| :mod:`~workbench.launch.handle` | :class:`Run`, the notebook-side handle of one run |
| :mod:`~workbench.launch.node_processes` | one node's processes of a run on this machine: found (verified) and stopped |
| :mod:`~workbench.launch.failure` | :class:`Failure`: which rank made a run fail, and why |
| :mod:`~workbench.launch.frames` | a run's events as pandas DataFrames |

What a run directory holds (events, ``launch.json``, checkpoint metadata) and the claim a run holds on its
``checkpoint.save_dir`` (:mod:`workbench.run.writer`: one writer per checkpoint folder) are the run contract,
:mod:`workbench.run`.  No megatron-core or torch here; psutil and pandas are imported lazily.
"""

from workbench.launch.checks import detect_gpus, launch_checks, launch_problems
from workbench.launch.exit_status import STATUSES, write_exit_status
from workbench.launch.failure import Failure
from workbench.launch.handle import Run
from workbench.launch.plan import BACKEND_ENTRY, LaunchPlan, apply_overrides, local_torchrun, new_run_dir
from workbench.launch.start import SupervisedResult, run_supervised, start_run

__all__ = [
    "BACKEND_ENTRY", "STATUSES", "Failure", "LaunchPlan", "Run", "SupervisedResult", "apply_overrides", "detect_gpus",
    "launch_checks", "launch_problems", "local_torchrun", "new_run_dir", "run_supervised", "start_run", "write_exit_status",
]
