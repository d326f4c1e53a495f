"""Every check made before a run starts: the config, its data and checkpoint, this machine's GPUs,
the rendezvous, the run directory.

``Run.launch``, ``workbench launch`` (and its ``--dry-run``) all call :func:`launch_checks`, so the
same bad input gives the same problems, each with its field and its fix, before any process starts.
Torch-free.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from workbench import kernel_rule
from workbench.config import ConfigError, Problem, RunConfig, load_config
from workbench.datasets import check_data
from workbench.launch import stall
from workbench.launch.nodes import DEFAULT_NODE_TIMEOUT
from workbench.launch.stores import bind_problem
from workbench.launch.preflight import memory_problems, path_problems
from workbench.run import nodes
from workbench.run.writer import owner_problem

__all__ = ["detect_gpus", "launch_problems", "launch_checks"]


def detect_gpus() -> int:
    """Number of visible NVIDIA GPUs, asked of ``nvidia-smi`` so the kernel never initialises CUDA."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    exe = shutil.which("nvidia-smi")
    if not exe:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def launch_problems(cfg: RunConfig, *, local: bool = True) -> list[Problem]:
    """Config problems plus what this machine cannot run (checked before any process starts)."""
    problems = list(cfg.validate())
    if not problems:  # data and checkpoint paths are only worth checking for a well-formed config
        problems += check_data(cfg)
        from workbench.checkpoint import load_problems

        problems += load_problems(cfg)
    if local and cfg.parallel.device == "cuda":
        gpus = detect_gpus()
        if gpus == 0:
            problems.append(Problem("parallel.device", "device is 'cuda' but no NVIDIA GPU is visible on this machine",
                                    "use device: cpu with a tiny model (preset 'tiny'), or run on a GPU machine"))
        elif cfg.parallel.nproc_per_node > gpus:
            problems.append(Problem("parallel.nproc_per_node", f"{cfg.parallel.nproc_per_node} processes per node but only {gpus} GPU(s) visible",
                                    f"use nproc_per_node <= {gpus}"))
        if kernel_rule.choose(cfg).attention == "te" and not kernel_rule.te_available():  # explicit: auto never picks an absent TE
            problems.append(Problem("model.attention_backend", f"Transformer Engine's layer is asked for but TE is not usable "
                                    f"here ({kernel_rule.te_status()[1]})", "install it (bash launch/install_te.sh), or set "
                                    "attention_backend: auto" + (" and te_userbuffers: false" if cfg.parallel.te_userbuffers else "")))
    return problems



def launch_checks(cfg: RunConfig, *, run_dir: str | Path | None = None, node_rank: int = 0,
                  rdzv_endpoint: str | None = None, local: bool = True, slurm: bool = False,
                  node_timeout: float | None = None, stall_floor: float | None = None,
                  startup_timeout: float | None = None, run_root: str | Path | None = None,
                  ignore_memory_plan: bool = False) -> list[Problem]:
    """Every problem that stops a launch, before any process starts (``Run.launch`` and ``workbench launch``).

    ``local``: check this machine's GPUs too (not for a dry run or a SLURM script).  ``slurm``: the
    SLURM script brings its own rendezvous.  ``run_dir``: must be new or empty; for one node of a
    multi-node run it is the run directory every node shares (:mod:`workbench.run.nodes`), which
    must hold nothing of this node yet and no other config; None: a fresh one under ``run_root``.  A
    ``checkpoint.save_dir`` another live run saves into is refused, naming that run (:mod:`workbench.run.writer`);
    so are a plan over the GPUs' memory (unless ``ignore_memory_plan``) and a directory the run cannot write or has
    no room in (:mod:`workbench.launch.preflight`).
    """
    problems = launch_problems(cfg, local=local)
    multi = cfg.parallel.nnodes > 1 and not slurm
    if cfg.parallel.nnodes > 1 and not rdzv_endpoint and not slurm:
        problems.append(Problem("rdzv_endpoint", f"{cfg.parallel.nnodes} nodes need a rendezvous endpoint",
                                "pass rdzv_endpoint='HOST:PORT' of node 0 (--rdzv-endpoint), or use the SLURM script (--slurm)"))
    if rdzv_endpoint and not slurm:
        host, _, port = str(rdzv_endpoint).rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            problems.append(Problem("rdzv_endpoint", f"{rdzv_endpoint!r} is not HOST:PORT",
                                    "pass node 0's address and a free TCP port, e.g. --rdzv-endpoint 10.0.0.1:29500"))
        elif node_rank == 0 and (why := bind_problem(host.strip("[]"))):  # node 0's store listens on that address only
            problems.append(Problem("rdzv_endpoint", f"node 0 hosts the rendezvous store on {host}, but {why}",
                                    "pass node 0's own address (the one the other nodes reach it at) as --rdzv-endpoint HOST:PORT"))
    if not 0 <= node_rank < max(cfg.parallel.nnodes, 1):
        problems.append(Problem("node_rank", f"node_rank {node_rank} is outside 0..{cfg.parallel.nnodes - 1}",
                                "use 0 on the first node, 1 on the second, ..."))
    if node_timeout is not None and not (isinstance(node_timeout, (int, float)) and node_timeout > 0):
        problems.append(Problem("node_timeout", f"{node_timeout!r} is not a positive number of seconds",
                                f"pass the seconds another node may go without a heartbeat, e.g. --node-timeout {DEFAULT_NODE_TIMEOUT:.0f}"))
    for name, value, default, low in (("stall_floor", stall_floor, stall.DEFAULT_STALL_FLOOR, 0.0),
                                      ("startup_timeout", startup_timeout, None, 1e-9)):
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and value >= low and value < float("inf")):
            default = stall.startup_limit(cfg) if default is None else default
            problems.append(Problem(name, f"{value!r} is not {'a number of seconds >= 0' if low == 0 else 'a positive number of seconds'}",
                                    f"pass seconds, e.g. --{name.replace('_', '-')} {default:.0f} (the default"
                                    + (")" if low == 0 else " here, from the model's size)")
                                    + (" or 0 to turn the stall watch off" if low == 0 else "")))
    if run_dir is not None:
        d = Path(run_dir)
        if multi:
            problems += _shared_run_dir_problems(cfg, d, node_rank)
        elif d.exists() and not d.is_dir():
            problems.append(Problem("run_dir", f"{d.absolute()} exists and is not a directory", "pass a new run_dir (or none for a fresh one)"))
        elif d.exists() and any(d.iterdir()):
            problems.append(Problem("run_dir", f"{d.absolute()} exists and is not empty", "pass a new run_dir (or none for a fresh one)"))
    if not cfg.validate():  # what would certainly fail after the start: memory, directories, another writer
        said = {p.field for p in problems}
        more = memory_problems(cfg, local=local, ignore_memory_plan=ignore_memory_plan)
        more += path_problems(cfg, Path(run_dir) if run_dir is not None else None, Path(run_root) if run_root else None)
        if (taken := owner_problem(cfg, run_dir)) is not None:
            more.append(taken)  # another live run saves into the same folder
        problems += [p for p in more if p.field not in said]
    return problems


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _shared_run_dir_problems(cfg: RunConfig, d: Path, node_rank: int) -> list[Problem]:
    """A multi-node run directory: shared by the nodes, so the other nodes' files may be there already."""
    d = d.absolute()
    if not d.exists():
        return []
    if not d.is_dir():
        return [Problem("run_dir", f"{d} exists and is not a directory", "pass a new run_dir, the same on every node")]
    own = nodes.node_dir(d, node_rank)
    for name in (nodes.LAUNCH_FILE, nodes.EXIT_STATUS_FILE):
        if (own / name).exists():
            return [Problem("run_dir", f"node {node_rank} of a run was already launched in {d} ({own / name} exists)",
                            "pass a new run_dir for a new run, the same one on every node")]
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        # what another node that is starting at this moment may already have made (its config.json, written
        # atomically, then follows): not a sign of an unrelated directory
        starting = {nodes.NODES_DIR, "events", "logs", "data_cache", "checkpoints", "slurm.sbatch"}
        if any(p.name not in starting and not p.name.startswith((".config.json.tmp-", ".slurm.sbatch.tmp-"))
               for p in d.iterdir()):
            return [Problem("run_dir", f"{d} exists, is not empty and holds no run config",
                            "pass a new run_dir (or none for a fresh one), the same on every node")]
        return []
    try:
        theirs = load_config(cfg_file)
    except ConfigError as e:
        return [Problem("run_dir", f"{cfg_file} (written by another node) does not load: {e.problems[0]}",
                        "pass a new run_dir, the same on every node")]
    mine, other = _flat(cfg.to_dict()), _flat(theirs.to_dict())
    diff = sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
    if diff:
        shown = ", ".join(f"{k} ({other.get(k)!r} there, {mine.get(k)!r} here)" for k in diff[:4]) + (" ..." if len(diff) > 4 else "")
        return [Problem("run_dir", f"{cfg_file}, written by another node of this run, differs from this node's config: {shown}",
                        "launch every node with the same config file and the same --nnodes / --nproc-per-node")]
    return []


