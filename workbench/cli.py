"""The ``workbench`` command line.

Concern modules contribute their sub-commands through an ``add_cli(subparsers)`` function;
the commands that drive other layers live here: ``schedule`` (simulation, text and Gantt
charts), ``launch`` (through :mod:`workbench.launch`, the one launch path, and
:class:`workbench.launch.Run`), ``notebook run`` and ``sweep`` (:mod:`workbench.notebook`).
Every handler returns an exit code; bad input exits 2 with the problems listed, never with a
stack trace.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from workbench import advisor, conversion, data_cli, generation, planner
from workbench.accelerate_import import from_accelerate
from workbench.config import ConfigError, PRESETS, Problem, load_config, preset
from workbench.datasets import check_data
from workbench.notebook import notebook_parameters, parse_value, notebook_problem, parse_grid, run_notebook, sweep
from workbench.launch import LaunchPlan, Run, apply_overrides, launch_checks, new_run_dir
from workbench.schedules import SCHEDULES, ScheduleError, measured_durations, simulate, text_chart
from workbench.launch.slurm import batch_script
from workbench.launch.slurm import submit as slurm_submit
from workbench.plots.schedule import gantt
from workbench.run.tensorboard import ExportError, export

# Modules that register sub-commands (in help order); "schedule" and "run" are this module's.


def _config_validate(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    problems = cfg.validate()
    if problems:
        print(str(ConfigError(problems, args.file)), file=sys.stderr)
        print("data not checked: fix the config first", file=sys.stderr)
        return 2
    if args.no_data:
        data_note = "data not checked (--no-data)"
    else:  # dataset files (missing, corrupt, another vocabulary) and the tokenizer, as a launch checks them
        problems = check_data(cfg)
        if problems:
            print(str(ConfigError(problems, f"{args.file} (its data)")), file=sys.stderr)
            return 2
        data_note = "data: synthetic, nothing to read" if cfg.data.source == "synthetic" else f"data checked ({cfg.data.source}, tokenizer {cfg.data.tokenizer})"
    d = cfg.derived()
    print(f"{args.file}: valid  (world {d.world_size} = tp {cfg.parallel.tensor_parallel} x pp {cfg.parallel.pipeline_parallel} x dp {d.data_parallel}; "
          f"{d.params.total / 1e6:.1f}M params; {d.num_microbatches} micro-batches/step; {data_note})")
    return 0


def _config_from_accelerate(args: argparse.Namespace) -> int:
    try:
        cfg = from_accelerate(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(args.output)
    cfg.save(out)
    problems = cfg.validate()
    print(f"wrote {out}")
    if problems:
        print("note: the imported config does not validate yet (model fields come from the workbench defaults):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    return 0


def _size(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def preset_line(name: str) -> str:
    """One line about a preset: its family and its size (parameters, layers x hidden, experts)."""
    cfg = preset(name)
    m = cfg.model
    moe = getattr(m, "moe", None)
    experts = f", MoE {moe.num_experts} experts top-{moe.top_k}" if moe is not None and moe.num_experts else ""
    return (f"{PRESETS[name].name}, {_size(cfg.derived().params.total)} params "
            f"({m.num_layers} layers x hidden {m.hidden_size}, seq {m.seq_length}{experts})")


def _config_show(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, PRESETS))
        for name in PRESETS:
            print(f"{name:<{width}}  {preset_line(name)}")
        return 0
    if args.preset is None:
        print("workbench config preset: name a preset (e.g. workbench config preset tiny) or pass --list to see them all",
              file=sys.stderr)
        return 2
    try:
        cfg = preset(args.preset)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(cfg.to_yaml() if args.yaml else cfg.to_json())
    return 0


def _add_config_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate, show and import run configs")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    v = csub.add_parser("validate", help="exit 0 when valid, 2 with every problem listed")
    v.add_argument("file")
    v.add_argument("--no-data", action="store_true", help="check the config only, not its dataset files and tokenizer")
    v.set_defaults(func=_config_validate)
    a = csub.add_parser("from-accelerate", help="convert an Accelerate config with a megatron_lm_config section")
    a.add_argument("file")
    a.add_argument("-o", "--output", required=True)
    a.set_defaults(func=_config_from_accelerate)
    s = csub.add_parser("preset", help="print a preset as JSON (or YAML); --list: every preset, one line each")
    s.add_argument("preset", nargs="?", help="preset name (see --list)")
    s.add_argument("--yaml", action="store_true")
    s.add_argument("--list", action="store_true", help="every preset's name with its family and size")
    s.set_defaults(func=_config_show)


# --------------------------------------------------------------------------- schedule


def _floats(text: str) -> float | list[float]:
    parts = [x for x in text.split(",") if x.strip()]
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or comma-separated numbers, got {text!r}")
    return vals[0] if len(vals) == 1 else vals


def _schedule_arg_problems(args: argparse.Namespace) -> list[str]:
    """``workbench schedule``'s flags that cannot describe a pipeline, each with the flag and the fix."""
    out = []
    for flag, value, fix in (("--pp", args.pp, "e.g. --pp 4 (1: no pipelining)"),
                             ("--microbatches", args.microbatches, f"e.g. --microbatches {4 * max(args.pp, 1)} (at least --pp)"),
                             ("--vpp", args.vpp, "e.g. --vpp 2 for interleaved 1F1B, or leave it out (1 chunk per rank)"),
                             ("--group-size", args.group_size, "leave it out (default: --pp) or give at least --pp")):
        if value is not None and value < 1:
            out.append(f"{flag} {value}: must be a positive integer -> {fix}")
    for flag, value in (("--forward", args.forward), ("--backward", args.backward)):
        values = value if isinstance(value, list) else [value]
        if not all(math.isfinite(x) and x > 0 for x in values):
            out.append(f"{flag} {','.join(f'{x:g}' for x in values)}: durations must be finite numbers > 0 -> "
                       f"e.g. {flag} {'1.0' if flag == '--forward' else '2.0'} (or one per stage, comma-separated)")
    if not (math.isfinite(args.latency) and args.latency >= 0):
        out.append(f"--latency {args.latency:g}: must be a finite number >= 0 -> e.g. --latency 0.1 (default 0)")
    return out


def _cmd_schedule(args: argparse.Namespace) -> int:
    problems = _schedule_arg_problems(args)
    if problems:
        for problem in problems:
            print(f"workbench schedule: {problem}", file=sys.stderr)
        return 2
    try:
        v = args.vpp or 1
        times: dict[str, Any] = {"forward": args.forward, "backward": args.backward}
        if args.from_run:
            times = measured_durations(args.from_run)
            if len(times["forward"]) != args.pp * v:
                raise ScheduleError(f"--from-run {args.from_run}: its timings cover {len(times['forward'])} virtual "
                                    f"stages but --pp {args.pp} x --vpp {v} = {args.pp * v}: use the run's p and v")
        tl = simulate(args.schedule, args.pp, args.microbatches, v, latency=args.latency,
                      microbatch_group_size=args.group_size, **times)
    except ScheduleError as e:
        print(f"workbench schedule: {e}", file=sys.stderr)
        return 2
    if args.chart:
        path = Path(args.chart)
        if path.suffix.lower() not in (".png", ".svg", ".pdf"):
            print(f"workbench schedule: --chart {path}: use a .png, .svg or .pdf file name", file=sys.stderr)
            return 2
        if not path.absolute().parent.is_dir():  # a typo in the path is not a reason to create directories
            print(f"workbench schedule: --chart {path}: directory {path.absolute().parent} does not exist -> "
                  f"create it first (mkdir -p) or fix the path", file=sys.stderr)
            return 2
        fig = gantt(tl)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    notes = []
    if args.microbatches < args.pp:
        notes.append(f"m={args.microbatches} < p={args.pp}: the pipeline never fills, so every rank idles more than "
                     f"it works (bubble = idle/busy > 1) -> use at least m={args.pp} micro-batches (m >= 4p keeps the bubble small)")
    for note in notes:
        print(f"workbench schedule: warning: {note}", file=sys.stderr)
    if args.json:
        d = tl.to_dict()
        d["warnings"] = notes
        if args.chart:
            d["chart"] = str(args.chart)
        print(json.dumps(d, indent=2))
        return 0
    met = tl.metrics()
    print(f"{tl.schedule}: p={tl.p} m={tl.m} v={tl.v}  step {met['step_time']:.4g} ms  "
          f"bubble {met['bubble_fraction']:.4f} (closed form {met['closed_form_bubble_fraction']:.4f})")
    for x in met["per_rank"]:
        print(f"  rank {x['rank']}: warm-up {x['warmup']:>3}  busy {x['busy']:.4g} ms  idle {x['bubble']:.4g} ms  "
              f"bubble {x['bubble_fraction']:.4f}  peak in flight {x['peak_inflight_microbatches']:.3g} micro-batches")
    print(text_chart(tl))
    if args.chart:
        print(f"wrote {args.chart}")
    return 0


def _add_schedule_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("schedule", help="simulate a pipeline schedule (GPipe, 1F1B, interleaved 1F1B)",
                              description="Per-rank operation order and timing of megatron-core's pipeline schedules, "
                                          "with bubble and in-flight metrics.")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size p")
    p.add_argument("--microbatches", "-m", type=int, required=True, help="micro-batches per step m")
    p.add_argument("--vpp", type=int, default=None, help="model chunks per rank v (interleaved)")
    p.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="default: interleaved when --vpp > 1, else 1f1b")
    p.add_argument("--forward", type=_floats, default=1.0,
                   help="forward time per stage in ms (one number or p comma-separated; default 1.0)")
    p.add_argument("--backward", type=_floats, default=2.0, help="backward time per stage in ms (default 2.0)")
    p.add_argument("--latency", type=float, default=0.0, help="send/recv latency between ranks in ms (default 0)")
    p.add_argument("--from-run", default=None, metavar="RUN_DIR",
                   help="take per-stage F/B times (ms) from a run's micro-batch events instead of --forward/--backward")
    p.add_argument("--group-size", type=int, default=None,
                   help="interleaved: microbatch_group_size_per_vp_stage (default p)")
    p.add_argument("--json", action="store_true", help="print per-rank ops and metrics as JSON")
    p.add_argument("--chart", default=None, help="write a Gantt chart (.png/.svg/.pdf)")
    p.set_defaults(func=_cmd_schedule)


# --------------------------------------------------------------------------- launch, notebook run, sweep


def _cmd_launch(args: argparse.Namespace) -> int:
    try:
        cfg = apply_overrides(load_config(args.file), nproc_per_node=args.nproc_per_node, nnodes=args.nnodes)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).absolute() if args.run_dir else None
    # a dry run makes the launch's own checks (run directory included), all but this machine's GPUs
    problems = launch_checks(cfg, run_dir=run_dir, node_rank=args.node_rank,
                             rdzv_endpoint=args.rdzv_endpoint, local=not (args.dry_run or args.slurm), slurm=args.slurm,
                             node_timeout=args.node_timeout, stall_floor=args.stall_floor, startup_timeout=args.startup_timeout,
                             run_root=args.run_root, ignore_memory_plan=args.ignore_memory_plan)
    if cfg.parallel.nnodes > 1 and not (run_dir or args.slurm):
        problems.append(Problem("--run-dir", f"{cfg.parallel.nnodes} nodes write into one run directory: none was given "
                                "(a fresh name on each node would split the run)",
                                "pass the same --run-dir on every node, on a filesystem they all share"))
    if problems:
        print(ConfigError(problems, args.file), file=sys.stderr)
        return 2
    run_dir = run_dir or new_run_dir(cfg.name, args.run_root)
    plan = LaunchPlan(run_dir, cfg.parallel.nproc_per_node, cfg.parallel.nnodes, args.node_rank, args.rdzv_endpoint,
                      args.rdzv_id or f"workbench-{cfg.name}")
    if args.dry_run:
        print(f"# run directory: {run_dir}")
        print(f"# config (written to {plan.config_path} at launch): {args.file}")
        if args.slurm:
            print(f"# SLURM batch script ({run_dir / 'slurm.sbatch'}):")
            print(batch_script(plan, gpus=cfg.parallel.device == "cuda"), end="")
        else:
            print(plan.shell())
        return 0
    if args.slurm:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cfg.save(plan.config_path)
        script = run_dir / "slurm.sbatch"
        script.write_text(batch_script(plan, gpus=cfg.parallel.device == "cuda"))
        print(f"wrote {script}")
        if not shutil.which("sbatch"):
            print(f"sbatch not found on this machine; submit with: sbatch {script}")
            return 0
        try:  # the job is recorded in <run_dir>/slurm.json: Run.attach follows it (squeue) and stops it (scancel)
            job = slurm_submit(run_dir, script)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"Submitted batch job {job}")
        print(f"follow it in a notebook with: workbench.notebook.dashboard(Run.attach({str(run_dir)!r}))")
        print(f"stop it with: scancel {job}  (or Run.attach({str(run_dir)!r}).stop())")
        return 0
    try:  # the checks above run again inside (the run directory may have appeared meanwhile)
        run = Run.launch(cfg, run_dir, node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                         rdzv_id=args.rdzv_id, watch_parent=not args.detach, node_timeout=args.node_timeout,
                         stall_floor=args.stall_floor, startup_timeout=args.startup_timeout,
                         ignore_memory_plan=args.ignore_memory_plan)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"run directory: {run.run_dir}")
    print(f"command: {run.plan.shell()}")
    if cfg.parallel.nnodes > 1:
        print(f"node {args.node_rank} of {cfg.parallel.nnodes}: this node's files in {run.plan.node_dir}; "
              "every node must share the run directory (the same --run-dir on a shared filesystem)")
    if args.detach:
        print(f"detached; follow it in a notebook with: workbench.notebook.dashboard(Run.attach({str(run.run_dir)!r}))")
        print(f"stop it with: Run.attach({str(run.run_dir)!r}).stop()")
        return 0
    return _follow_cli(run)


def _say(line: str) -> None:
    """A progress line on stderr (stdout keeps what scripts parse: the run directory, losses, the end)."""
    print(f"launch: {line}", file=sys.stderr, flush=True)


def _follow_cli(run: Run) -> int:
    seen = 0
    cfg = run.config
    ranks = cfg.parallel.nproc_per_node * cfg.parallel.nnodes if cfg is not None else None
    _say(f"waiting for {ranks or 'the'} rank(s) to start: torchrun, importing torch and megatron-core, "
         "model parallel, building the model")
    started = False
    try:
        while True:
            st = run.status
            if not started and st == "running" and not seen:
                started = True
                _say("ranks started; waiting for the first step: data, the first forward and backward")
            df = run.train_loss
            if len(df) > seen:
                for _, row in df.iloc[seen:].iterrows():
                    print(f"iteration {int(row['iteration'])}: loss {row['loss']:.4f}", flush=True)
                seen = len(df)
            if st in ("finished", "failed", "stopped") and not run.is_alive():
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("interrupted: stopping the run", file=sys.stderr)
        run.stop()
    st = run.wait(timeout=30)
    f = run.failure
    if f is not None:
        print(str(f), file=sys.stderr)
    if run.nnodes > 1:
        for n in run.nodes():
            print(f"node {n['node']} ({n['host'] or 'host unknown'}, ranks {n['ranks']}): {n['status']}"
                  + (f" - {n['why']}" if n.get("why") else ""))
    print(f"run {st}: {run.run_dir}")
    return 0 if st == "finished" else 1


def _cmd_notebook_run(args: argparse.Namespace) -> int:
    params = {name: parse_value(value) for name, value in (args.parameters or [])}
    nb = Path(args.notebook)
    if (problem := notebook_problem(nb)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    declared = notebook_parameters(nb)
    unknown = [p for p in params if declared and p not in declared]
    if unknown:
        print(f"error: {nb} has no parameter(s) {', '.join(unknown)} -> known: {', '.join(sorted(declared))}", file=sys.stderr)
        return 2
    res = run_notebook(nb, params, args.out, runs_root=args.run_root, progress=not args.quiet, timeout=args.timeout)
    print(f"executed notebook: {res.notebook}")
    if res.html:
        print(f"HTML export:       {res.html}")
    print(f"output directory:  {res.out_dir}  ({res.seconds:.0f}s)")
    try:  # what the notebook changed about its parameters (e.g. a preset replaced on CPU) belongs in the output too
        note = json.loads((Path(res.out_dir) / "metrics.json").read_text()).get("config_note")
    except (OSError, ValueError, AttributeError):
        note = None
    if note:
        print(f"config:            {note}")
    if res.error:
        print(f"error: the notebook failed at {res.error}; see the executed notebook above", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    try:
        grid = parse_grid(args.grid)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    nb = Path(args.notebook)
    if (problem := notebook_problem(nb)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    declared = notebook_parameters(nb)
    params = {name: parse_value(value) for name, value in (args.parameters or [])}
    unknown = [p for p in list(grid) + list(params) if declared and p not in declared]
    if unknown:
        print(f"error: {nb} has no parameter(s) {', '.join(unknown)} -> known: {', '.join(sorted(declared))}", file=sys.stderr)
        return 2
    df = sweep(nb, grid, args.out, parameters=params, html=args.html)
    print(df.drop(columns=["notebook"], errors="ignore").to_string(index=False))
    print(f"wrote {Path(args.out).absolute() / 'sweep.csv'}")
    return 0 if bool(df["ok"].all()) else 1


def _add_run_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``launch``, ``sweep`` and ``notebook run``."""
    p = sub.add_parser("launch", help="launch a training run (torchrun) from a config file")
    p.add_argument("file", help="run config (JSON or YAML)")
    p.add_argument("--nproc-per-node", type=int, help="processes per node (default: the config's parallel.nproc_per_node)")
    p.add_argument("--nnodes", type=int, help="number of nodes (default: the config's parallel.nnodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (multi-node, static rendezvous)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of node 0 (multi-node): node 0's rendezvous store listens on HOST's "
                                           "address only (one node: everything on 127.0.0.1); the collectives' interfaces: "
                                           "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME")
    p.add_argument("--rdzv-id", help="rendezvous id, identical on every node (default: workbench-<config name>)")
    p.add_argument("--node-timeout", type=float, default=None, metavar="SECONDS",
                   help="multi-node: stop this node's job when another node's heartbeat stops for this long (default 60)")
    p.add_argument("--stall-floor", type=float, default=None, metavar="SECONDS",
                   help="a rank without progress (no event, no checkpoint file written) for max(this, 20 x the median time "
                        "between its step events, 2 x its longest pause seen) fails the run as stalled, naming the rank, its "
                        "stacks in stall_stacks.txt (default 300: above a first save or eval, which the rhythm has not "
                        "measured yet; 0: off)")
    p.add_argument("--startup-timeout", type=float, default=None, metavar="SECONDS",
                   help="the same before the first step: start, data, compilation, CUDA graph capture (default: derived from the "
                        "model's size, device, compilation and checkpoint: workbench.launch.stall.startup_limit)")
    p.add_argument("--run-dir", help="run directory (default: a fresh runs/<name>-<timestamp>); multi-node: the same "
                                     "directory on every node, on a filesystem they share")
    p.add_argument("--run-root", help="parent of fresh run directories (default: runs/ or $WORKBENCH_RUNS)")
    p.add_argument("--dry-run", action="store_true", help="make the launch's checks (all but this machine's GPUs: the "
                                                         "command may be for another machine), print the exact commands, start nothing")
    p.add_argument("--slurm", action="store_true", help="write a SLURM batch script (srun torchrun ...) and submit it if sbatch exists")
    p.add_argument("--detach", action="store_true", help="return at once; the run keeps going")
    p.add_argument("--ignore-memory-plan", action="store_true",
                   help="launch a CUDA run whose memory plan (`workbench plan`) is over this machine's GPU memory (or, "
                        "for a dry run or SLURM, over the most any accelerator has), which is refused otherwise")
    p.set_defaults(func=_cmd_launch)

    s = sub.add_parser("sweep", help="run a notebook over a parameter grid; collect final metrics into a CSV")
    s.add_argument("notebook")
    s.add_argument("--grid", action="append", required=True, metavar="NAME=V1,V2", help="repeatable; the grid is the product")
    s.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", metavar=("NAME", "VALUE"), help="fixed parameter")
    s.add_argument("--out", required=True, help="output directory (one subdirectory per point + sweep.csv)")
    s.add_argument("--html", action="store_true", help="also export each executed notebook to HTML")
    s.set_defaults(func=_cmd_sweep)

    n = sub.add_parser("notebook", help="run notebooks headless (papermill)")
    nsub = n.add_subparsers(dest="notebook_cmd", required=True)
    r = nsub.add_parser("run", help="execute a notebook into runs/<name>-<timestamp>/ (executed .ipynb + HTML)")
    r.add_argument("notebook")
    r.add_argument("-p", "--parameter", dest="parameters", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="papermill parameter (value parsed as YAML: 2, true, 3e-4, text)")
    r.add_argument("--out", help="output directory (default: runs/<name>-<timestamp>)")
    r.add_argument("--run-root", help="parent of the default output directory")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument("--timeout", type=float, default=None, help="seconds a single cell may run before the notebook fails (default: no limit)")
    r.set_defaults(func=_cmd_notebook_run)


def _cmd_export_tensorboard(args: argparse.Namespace) -> int:
    """``workbench runs export-tensorboard RUN_DIR...``: each run's step and eval records as TensorBoard files."""
    if args.logdir and len(args.run_dirs) > 1:
        print("--logdir names the folder of one run; leave it out to write each run's <run_dir>/tensorboard", file=sys.stderr)
        return 2
    if importlib.util.find_spec("tensorboard") is None:
        print("exporting to TensorBoard needs the tensorboard package: pip install tensorboard", file=sys.stderr)
        return 2
    code = 0
    for run_dir in args.run_dirs:
        try:
            print(f"wrote {export(run_dir, args.logdir, replace=args.replace)}")
        except ExportError as e:
            print(e, file=sys.stderr)
            code = 1
    if code == 0:
        print(f"open with: tensorboard --logdir {args.logdir or Path(args.run_dirs[0]).parent}")
    return code


def _add_runs_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("runs", help="work with finished run directories")
    rsub = p.add_subparsers(dest="runs_cmd", required=True)
    e = rsub.add_parser("export-tensorboard", help="write a run's logged metrics as TensorBoard event files "
                                                   "(<run_dir>/tensorboard; what train.tensorboard writes live)")
    e.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    e.add_argument("--logdir", help="write here instead of <run_dir>/tensorboard (one run only)")
    e.add_argument("--replace", action="store_true", help="replace event files already in the folder")
    e.set_defaults(func=_cmd_export_tensorboard)


# --------------------------------------------------------------------------- the parser


def version_text() -> str:
    """``workbench --version``: the installed package's version and those of megatron-core and torch (from
    their distributions' metadata: nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return f"megatron-workbench {v('megatron-workbench')} (megatron-core {v('megatron-core')}, torch {v('torch')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Megatron Workbench")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="the workbench's version with megatron-core's and torch's")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_cli(sub)
    for add in (planner.add_cli,         # plan
                advisor.add_cli,         # advise, calibrate
                _add_schedule_cli,       # schedule
                _add_run_cli,            # launch, sweep, notebook
                _add_runs_cli,           # runs export-tensorboard
                data_cli.add_cli,        # preprocess, tokenizer, data
                conversion.add_cli,      # convert
                generation.add_cli):     # generate
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
