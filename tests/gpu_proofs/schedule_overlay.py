"""Measured-vs-ideal pipeline overlay for GPU runs: one PNG + one JSON per run directory.

Usage (after pipeline-parallel training runs with micro-batch timing enabled)::

    python tests/gpu_proofs/schedule_overlay.py RUN_DIR [RUN_DIR ...] [--iteration N] [--out evidence/schedules]

or, on a 2-GPU machine, train the two evidence runs first (demo-small with 8 layers, 8 micro-batches,
PP=2 and PP=2 x VPP=2, 20 steps, timings every 5 steps; run dirs ``pp2`` and ``pp2_vpp2``)::

    python tests/gpu_proofs/schedule_overlay.py --train evidence/runs --out evidence/schedules

For each run it writes ``<out>/<run name>.png`` (the overlay chart) and ``<out>/<run name>.json``
(the report: measured vs ideal vs closed-form bubble, per-rank time split), and appends one
line per run to ``<out>/schedule_overlay.jsonl``.  Every JSON record carries "device"
(the run's device from its run_start event, else torch.cuda.get_device_name()), "date" and
"git_commit".  Exits 2 with the reason when a run directory has no usable timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workbench.plots.schedule import measured_overlay  # noqa: E402
from workbench.schedules import ScheduleError  # noqa: E402


def _git_commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _cuda_device() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


def train_evidence_runs(runs_root: Path, steps: int = 20, cpu_smoke: bool = False) -> list[Path]:
    """torchrun the workbench backend twice (PP=2, PP=2 x VPP=2) on 2 GPUs; returns the run directories.

    ``cpu_smoke``: the tiny preset on CPU for 3 steps (checks this script's plumbing without GPUs).
    """
    import tempfile

    from workbench.config import preset

    base = preset("tiny" if cpu_smoke else "demo-small")
    interval = 1 if cpu_smoke else 5
    steps = 3 if cpu_smoke else steps
    runs_root.mkdir(parents=True, exist_ok=True)
    cache = Path(tempfile.mkdtemp(prefix="wb-sched-data-"))  # keep the tokenized corpus out of the evidence
    out = []
    for name, vpp in (("pp2", None), ("pp2_vpp2", 2)):
        cfg = base.replace(**{
            "name": f"schedule-{name}", "model.num_layers": 8,
            "parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": vpp, "parallel.nproc_per_node": 2,
            "train.global_batch_size": 8 * base.train.micro_batch_size,  # 8 micro-batches per step
            "train.train_iters": steps, "train.microbatch_timing_interval": interval, "train.eval_interval": 0,
            "checkpoint.save_on_exit": False, "data.cache_dir": str(cache)})
        cfg.check()
        run_dir = runs_root / name
        if run_dir.exists():
            raise SystemExit(f"{run_dir} exists: move it away (evidence is never overwritten)")
        run_dir.mkdir(parents=True)
        cfg_path = cfg.save(run_dir / "config.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "workbench.rank", "--config", str(cfg_path), "--run-dir", str(run_dir)]
        print("+", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(f"training run {name} failed (exit {r.returncode}); see {run_dir}/logs and the output above")
        out.append(run_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="*", type=Path)
    ap.add_argument("--train", type=Path, default=None, metavar="RUNS_ROOT",
                    help="first train the PP=2 and PP=2xVPP=2 evidence runs under RUNS_ROOT (needs 2 GPUs)")
    ap.add_argument("--cpu-smoke", action="store_true", help="with --train: tiny preset on CPU (no GPUs needed)")
    ap.add_argument("--iteration", type=int, default=None, help="step to show (default: latest complete one)")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "schedules")
    args = ap.parse_args(argv)
    if args.train:
        args.run_dirs = list(args.run_dirs) + train_evidence_runs(args.train, cpu_smoke=args.cpu_smoke)
    if not args.run_dirs:
        ap.error("give run directories or --train RUNS_ROOT")
    args.out.mkdir(parents=True, exist_ok=True)
    commit, date = _git_commit(), dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    rc = 0
    for run in args.run_dirs:
        try:
            fig, report = measured_overlay(run, args.iteration)
        except ScheduleError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 2
            continue
        name = run.resolve().name
        png = args.out / f"{name}.png"
        fig.savefig(png, dpi=110, bbox_inches="tight")
        record = {"device": report.get("device") or _cuda_device(), "date": date, "git_commit": commit,
                  "run": name, "png": png.name, **report}
        (args.out / f"{name}.json").write_text(json.dumps(record, indent=2))
        with open(args.out / "schedule_overlay.jsonl", "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"{name}: measured bubble {report['measured_bubble_fraction']:.3f} vs ideal "
              f"{report['ideal_bubble_fraction']:.3f} (closed form {report['closed_form_bubble_fraction']:.3f}) -> {png}")
        print("  " + report["summary"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
