"""GPU evidence for the launch path (Run.launch, stop, failure) and the quickstart notebook.

1. ``quickstart``: executes notebooks/01_quickstart.ipynb through papermill on the GPUs present
   (configure -> plan -> launch -> watch -> evaluate -> generate) and records its metrics.
2. ``memory``: measured peak allocated and reserved per rank of that run vs the planner's prediction;
   passes only when both are within the planner's bar (``workbench.planner.evidence.BAR``, 5%) on every rank.
3. ``stop``: launches a longer run, stops it mid-training (SIGTERM, SIGKILL after the grace) and
   counts the run's processes left behind (must be 0); ``failure``: a run whose last rank raises
   in its forward step must come back failed with the failing rank and its traceback.

Writes JSON lines (device, date, git_commit on each) to --out.  Run from the repo root:

    .venv/bin/python tests/gpu_proofs/bridge_quickstart.py --out evidence/bridge_quickstart.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workbench.notebook import quickstart_config, run_notebook  # noqa: E402
from workbench.launch import Run  # noqa: E402


def _device() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
        names = [n.strip() for n in out.splitlines() if n.strip()]
        return f"{len(names)} x {names[0]}" if names else "no GPU"
    except OSError:
        return "no GPU"


def _commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _run_processes(run_dir: Path) -> int:
    import psutil

    n = 0
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                n += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "evidence/bridge_quickstart.jsonl"))
    ap.add_argument("--preset", default="demo-small")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu-bridge"))
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) / datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = {"device": _device(), "date": datetime.now(timezone.utc).isoformat(), "git_commit": _commit()}
    rows = []

    def emit(row: dict) -> None:
        row = {**base, **row}
        rows.append(row)
        with open(out, "a") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
        print(json.dumps(row, default=str)[:400], flush=True)

    # 1. the quickstart notebook on the GPUs present
    t0 = time.time()
    res = run_notebook(ROOT / "notebooks/01_quickstart.ipynb", {"preset": args.preset, "steps": args.steps, "device": "auto"},
                       work / "quickstart")
    metrics = json.loads((work / "quickstart" / "metrics.json").read_text()) if (work / "quickstart" / "metrics.json").exists() else {}
    emit({"test": "quickstart", "ok": res.ok and metrics.get("status") == "finished", "error": res.error,
          "seconds": time.time() - t0, "metrics": metrics, "executed": str(res.notebook), "html": str(res.html)})

    # 2. measured memory vs planner prediction of that run: allocated and reserved within the planner's bar on every rank
    if metrics.get("run_dir"):
        from workbench.planner.evidence import run_within_bar

        run = Run.attach(metrics["run_dir"])
        check = run_within_bar(run.reader)
        emit({"test": "memory", "ok": check["ok"], "bar": check["bar"], "ranks": check["ranks"], "why": check["why"],
              "last_step": run.steps.tail(1).to_dict("records")})

    # 3a. stop mid-training: zero processes left
    cfg, note = quickstart_config(args.preset, steps=100000, device="auto")
    run = Run.launch(cfg, run_root=work / "stop")
    while len(run.train_loss) < 5 and not run.done:
        time.sleep(0.5)
    t1 = time.time()
    status = run.stop(grace=30)
    left = _run_processes(run.run_dir)
    ends = {e.get("status") for e in run.events("run_end")}
    emit({"test": "stop", "ok": status == "stopped" and left == 0, "status": status, "stop_seconds": time.time() - t1,
          "processes_left": left, "run_end_statuses": sorted(ends), "note": note, "run_dir": str(run.run_dir)})

    # 3b. a failing run: the last rank raises in its forward while the others wait in the gradient
    # all-reduce; the failing rank and its traceback must surface and the job be torn down.
    # (An absurd micro-batch no longer fails: demo-small at micro-batch 4096 fits an H200.)
    last = max(cfg.parallel.world_size - 1, 0)
    failing = cfg.replace(**{"train.train_iters": 50, "train.forward_step": "tests.gpu_proofs.failing_forward:forward_step",
                             "train.hook_kwargs": {"fail_rank": last, "fail_after": 3}})
    run = Run.launch(failing, run_root=work / "fail")
    t2 = time.time()
    status = run.wait(timeout=600)
    f = run.failure
    emit({"test": "failure", "ok": status == "failed" and f is not None and f.rank == last and _run_processes(run.run_dir) == 0,
          "status": status, "seconds_to_end": time.time() - t2, "failed_rank": f.rank if f else None,
          "message": f.message if f else None, "source": f.source if f else None, "run_dir": str(run.run_dir)})
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
