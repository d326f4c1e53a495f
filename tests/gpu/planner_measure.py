"""GPU proof for the memory planner (issue 5): measured peak allocated vs predicted, every rank.

Run on a machine with 2 GPUs (from the repo root)::

    python tests/gpu/planner_measure.py --out evidence/planner_measurements.jsonl

Every config is a real ``torchrun ... -m workbench.backend`` job (4 steps, synthetic data, no
eval, no checkpoint).  The backend resets CUDA's peak statistics before its first step and
reports ``torch.cuda.max_memory_allocated()`` as ``mem_peak`` in every ``step`` event; the
measured peak of a rank is the largest one.  Configs span 1 and 2 GPUs: TP=1, TP=2 with and
without SP, PP=2 (both stages), PP=2 x VPP=2, DP=2 with the distributed optimizer, recompute
none / selective / full, unfused (``local``) attention, two model sizes (GPT-2 small and
medium shapes) and two micro-batch sizes; one config keeps the default compiled kernels.
One-GPU jobs run two at a time (one per GPU).

One JSON line per rank and config: config name, overrides, the full config, rank
coordinates, measured peak (and reserved), the planner's prediction and breakdown, megatron's
theoretical formula, both errors in percent, the backend's kernel path, plus device, date and
git commit.  A failed job writes one line with ``status: failed`` and the log's tail.
``--only NAME,...`` runs a subset; ``--list`` prints the configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workbench import planner  # noqa: E402
from workbench.config import RunConfig, preset  # noqa: E402
from workbench.run.reader import read_events  # noqa: E402

SMALL = {"model.num_layers": 12, "model.hidden_size": 768, "model.num_attention_heads": 12}
MEDIUM = {"model.num_layers": 24, "model.hidden_size": 1024, "model.num_attention_heads": 16}

# name -> (GPUs, overrides on top of base())
CONFIGS: dict[str, tuple[int, dict]] = {
    "small-tp1-mbs4-compiled": (1, {**SMALL, "train.micro_batch_size": 4, "train.compile_kernels": True}),
    "small-tp1-mbs8": (1, {**SMALL, "train.micro_batch_size": 8}),
    "small-tp1-mbs4-local-attn": (1, {**SMALL, "train.micro_batch_size": 4, "model.attention_backend": "local"}),
    "medium-tp1-mbs4-full": (1, {**MEDIUM, "train.micro_batch_size": 4, "parallel.recompute": "full"}),
    "medium-tp1-mbs4-selective": (1, {**MEDIUM, "train.micro_batch_size": 4, "parallel.recompute": "selective"}),
    "small-tp2-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.tensor_parallel": 2}),
    "small-tp2-sp-mbs8": (2, {**SMALL, "train.micro_batch_size": 8, "parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}),
    "small-pp2-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.pipeline_parallel": 2}),
    "small-dp2-distopt-mbs4": (2, {**SMALL, "train.micro_batch_size": 4, "parallel.distributed_optimizer": True}),
    "medium-tp2-sp-selective-mbs8": (2, {**MEDIUM, "train.micro_batch_size": 8, "parallel.tensor_parallel": 2,
                                         "parallel.sequence_parallel": True, "parallel.recompute": "selective"}),
    "medium-pp2-vpp2-mbs4": (2, {**MEDIUM, "train.micro_batch_size": 4, "parallel.pipeline_parallel": 2,
                                 "parallel.virtual_pipeline_parallel": 2}),
}


def base(device: str = "cuda") -> RunConfig:
    """GPT-2 shapes (vocab 50257, s=1024, learned positions, tied), bf16, 4 micro-batches per step."""
    return preset("gpt2-small", **{
        "data.source": "synthetic", "parallel.device": device, "train.precision": "bf16", "train.train_iters": 4,
        "train.eval_interval": 0, "train.log_interval": 1, "train.microbatch_timing_interval": 0,
        "train.compile_kernels": False, "train.lr_warmup_iters": 1, "checkpoint.save_on_exit": False,
    })


def make_config(name: str, device: str = "cuda", tiny: bool = False) -> tuple[int, RunConfig]:
    gpus, overrides = CONFIGS[name]
    ov = dict(overrides)
    if tiny:  # script self-check on CPU: same layouts, tiny shapes
        for k in ("model.num_layers", "model.hidden_size", "model.num_attention_heads"):
            ov.pop(k, None)
        ov.update({"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.seq_length": 64,
                   "model.max_position_embeddings": 128, "model.vocab_size": 4096, "train.micro_batch_size": 2,
                   "train.compile_kernels": False})
    mbs = ov.get("train.micro_batch_size", 4)
    dp = gpus // (ov.get("parallel.tensor_parallel", 1) * ov.get("parallel.pipeline_parallel", 1))
    ov.update({"parallel.nproc_per_node": gpus, "train.global_batch_size": mbs * dp * 4})
    return gpus, base(device).replace(**ov)


def _stamp() -> dict:
    from workbench.provenance import stamp

    return stamp()


def launch(name: str, cfg: RunConfig, gpus: int, work: Path, port: int, visible: str | None) -> subprocess.Popen:
    run_dir = work / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus), "--master-port", str(port),
           "-m", "workbench.backend", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "4"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    log = open(run_dir / "launcher.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)


def records(name: str, cfg: RunConfig, run_dir: Path, rc: int, seconds: float, stamp: dict) -> list[dict]:
    events = read_events(run_dir)
    peaks = planner.measured_peaks(run_dir)
    reserved: dict[int, int] = {}
    kernel = {}
    for ev in events:
        if ev.get("event") == "step" and ev.get("mem_reserved") is not None:
            reserved[int(ev["rank"])] = max(reserved.get(int(ev["rank"]), 0), int(ev["mem_reserved"]))
        if ev.get("event") == "run_start" and int(ev.get("rank", 0)) == 0:
            kernel = ev.get("kernel_path") or {}
    common = {"config": name, "overrides": CONFIGS[name][1], "run_config": cfg.to_dict(), "gpus": CONFIGS[name][0],
              "seconds": round(seconds, 1), "kernel_path": kernel, **stamp}
    if rc != 0 or (not peaks and cfg.parallel.device == "cuda"):
        tail = ""
        for p in sorted(run_dir.glob("**/*.log")) + sorted((run_dir / "logs").glob("*") if (run_dir / "logs").exists() else []):
            try:
                tail += f"--- {p.name}\n" + p.read_text(errors="replace")[-3000:]
            except OSError:
                pass
        errors = [ev.get("message") for ev in events if ev.get("event") == "error"]
        return [{**common, "status": "failed", "returncode": rc, "errors": errors, "log_tail": tail[-6000:]}]
    plan = planner.predict(cfg)  # no pandas here: the device's Python may not have it
    out = []
    for rk in plan.ranks:
        r = rk.rank
        st = plan.stages[rk.pp_rank]
        meas = peaks.get(r)
        out.append({
            **common, "rank": r, "tp_rank": rk.tp_rank, "pp_rank": rk.pp_rank, "dp_rank": rk.dp_rank,
            "status": "ok" if peaks else "no_memory_stats (cpu)",
            "measured_peak": meas, "measured_reserved": reserved.get(r), "predicted": rk.peak_allocated,
            "predicted_total": rk.total, "predicted_components": st.components, "predicted_phase": st.peak_phase,
            "planner_kernel_path": dataclasses.asdict(plan.kernel_path),
            "megatron_formula": plan.megatron.total, "megatron_formula_kind": plan.megatron.formula,
            "error_pct": None if not meas else round(100.0 * (rk.peak_allocated - meas) / meas, 2),
            "megatron_error_pct": None if not meas else round(100.0 * (plan.megatron.total - meas) / meas, 2),
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "evidence/planner_measurements.jsonl"))
    ap.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script itself (tiny shapes, gloo)")
    ap.add_argument("--keep", default=None, help="keep run directories here (default: a temp dir, removed)")
    args = ap.parse_args()
    if args.list:
        for n, (g, ov) in CONFIGS.items():
            print(f"{n:32s} {g} GPU(s)  {ov}")
        return 0
    names = [n for n in (args.only.split(",") if args.only else CONFIGS) if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"unknown config(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    tiny = args.device == "cpu"
    stamp = _stamp()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="planner-measure-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fh = open(out, "a")
    t_all = time.time()

    def finish(name: str, cfg: RunConfig, proc: subprocess.Popen, t0: float) -> None:
        rc = proc.wait()
        recs = records(name, cfg, work / name, rc, time.time() - t0, stamp)
        for rec in recs:
            fh.write(json.dumps(rec) + "\n")
        fh.flush()
        ok = [r for r in recs if r["status"] == "ok"]
        if not ok and recs[0]["status"].startswith("no_memory_stats"):
            print(f"[{time.time() - t_all:6.1f}s] {name}: ran (rc {rc}); CPU has no CUDA memory stats", flush=True)
            return
        if ok:
            errs = ", ".join(f"r{r['rank']} {r['measured_peak'] / 2**30:.2f} GiB meas / {r['predicted'] / 2**30:.2f} pred "
                             f"({r['error_pct']:+.1f}%; megatron {r['megatron_error_pct']:+.1f}%)" for r in ok)
            print(f"[{time.time() - t_all:6.1f}s] {name}: {errs}", flush=True)
        else:
            print(f"[{time.time() - t_all:6.1f}s] {name}: FAILED (rc {rc}): {recs[0].get('errors')}", flush=True)

    singles = [n for n in names if CONFIGS[n][0] == 1]
    doubles = [n for n in names if CONFIGS[n][0] == 2]
    port = 29611
    n_gpus = 0
    if not tiny:
        import torch

        n_gpus = torch.cuda.device_count()
        if n_gpus < 2 and doubles:
            print(f"only {n_gpus} GPU(s): skipping the 2-GPU configs {doubles}", flush=True)
            doubles = []
    # one-GPU jobs side by side, one per GPU (CPU self-check: one at a time)
    lanes = [str(i) for i in range(max(n_gpus, 1))] if not tiny else [None]
    i = 0
    while i < len(singles):
        batch = []
        for lane in lanes:
            if i >= len(singles):
                break
            name = singles[i]
            gpus, cfg = make_config(name, args.device, tiny)
            batch.append((name, cfg, launch(name, cfg, gpus, work, port, lane), time.time()))
            port += 1
            i += 1
        for name, cfg, proc, t0 in batch:
            finish(name, cfg, proc, t0)
    for name in doubles:
        gpus, cfg = make_config(name, args.device, tiny)
        t0 = time.time()
        finish(name, cfg, launch(name, cfg, gpus, work, port, None if tiny else "0,1"), t0)
        port += 1
    fh.close()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} in {time.time() - t_all:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
