"""Predicted vs measured: the layout advisor's top layouts trained for a few steps each on the GPUs present.

One device call (about 8 minutes on 2 GPUs with the defaults), from the repository root with the wheels carried::

    source tests/gpu_proofs/device_env.sh || exit 1
    python3 tests/gpu_proofs/advisor_measure.py --out $OUT/advisor [--calibrate] [--models gpt2-medium,llama3.2-1b] [--top 3]

For each model (the benchmark's preset, sequence and micro-batch anchor; the global batch of ``bench/train_throughput.py``
times ``--batch-scale``), :func:`workbench.advisor.advise` on every visible GPU picks its ``--top`` layouts that fit
(one per FP8 recipe group) plus the benchmark's default layout; each trains ``--steps`` timed steps through
``bench/train_throughput.py``'s machinery (the backend's own Trainer, one torchrun process group per layout, a fresh
CUDA context; a timeout ends the group).  Every row goes to ``<out>/advisor.jsonl`` with device, date and commit:
the benchmark's fields (tokens/s, MFU, memory, ok / error), the layout's overrides, and the advisor's prediction
(tokens/s, MFU, fits, memory, breakdown, rank).  ``<out>/predicted_vs_measured.png`` plots them.  ``--calibrate``
first runs ``workbench calibrate`` (``<out>/calibration.json``) and predicts with that profile.

Committed under ``evidence/advisor/``, the rows join the measurements ``workbench.advisor.calibration`` fits
(``python -m workbench.advisor.calibration`` rebuilds the shipped profiles) and the tests judge.
``--dry-run`` prints the layouts it would train (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import train_throughput as tt  # noqa: E402
from workbench.advisor import advise  # noqa: E402
from workbench.advisor.enumerate import Layout, layout_of  # noqa: E402,F401
from workbench.advisor.profile import load_profile  # noqa: E402
from workbench.advisor.rows import device_gpu  # noqa: E402
from workbench.provenance import stamp  # noqa: E402


def base_config(model: str, gpus: int, batch_scale: int):
    """The benchmark's config of ``model`` (its preset, sequence, micro-batch anchor) on ``gpus`` GPUs, 4 micro-batches
    per GPU at the anchor, times ``batch_scale``."""
    v = tt.Variant(f"advisor/{model}", "workbench", model, gpus=gpus, microbatches=4 * batch_scale)
    return tt.bench_config(v)


def pick(adv, top: int, own: Layout) -> list:
    """The ``top`` fastest fitting layouts (one per group of FP8 recipes predicted alike), the fastest fitting one with
    TP > 1 and with PP > 1 (the mechanisms the pick may not use), and the config's own."""
    chosen, seen = [], set()
    for r in adv.fitting():
        key = (r.layout.tp, r.layout.pp, r.layout.vpp, r.layout.sp, r.layout.distributed_optimizer, r.layout.recompute,
               r.layout.micro_batch_size, r.layout.fp8 != "off")
        if key in seen:
            continue
        seen.add(key)
        chosen.append(r)
        if len(chosen) >= top:
            break
    for want in (lambda lay: lay.tp > 1, lambda lay: lay.pp > 1, lambda lay: lay == own):
        r = next((r for r in adv.rows if r.fits and want(r.layout)), None)
        if r is not None and r not in chosen:
            chosen.append(r)
    return chosen


def overrides_of(row, cfg) -> dict:
    over = {k: v for k, v in row.overrides.items() if k not in ("parallel.nnodes", "parallel.device")}
    over["train.global_batch_size"] = cfg.train.global_batch_size
    return over


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    ok = [r for r in rows if r.get("ok")]
    for model in sorted({r["model"] for r in ok}):
        pts = [r for r in ok if r["model"] == model]
        ax.scatter([r["predicted_tokens_per_s"] for r in pts], [r["tokens_per_s"] for r in pts], label=model, s=24)
    hi = max([r["tokens_per_s"] for r in ok] + [r["predicted_tokens_per_s"] for r in ok] + [1.0])
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="measured = predicted")
    for f in (0.85, 1.15):
        ax.plot([0, hi], [0, hi * f], ":", color="0.6", lw=0.8)
    ax.set_xlabel("predicted tokens/s")
    ax.set_ylabel("measured tokens/s")
    ax.set_title(f"advisor: {rows[0]['device'] if rows else ''}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for advisor.jsonl, the plot and the calibration")
    ap.add_argument("--models", default="gpt2-medium,llama3.2-1b")
    ap.add_argument("--top", type=int, default=2)
    ap.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    ap.add_argument("--gpu", default=None, help="planner GPU name (default: from the device name)")
    ap.add_argument("--batch-scale", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variant-timeout", type=float, default=110.0)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting layouts after this many seconds")
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if a.dry_run:
        gpus, device = a.gpus or 2, "dry run"
    else:
        import torch

        gpus, device = a.gpus or torch.cuda.device_count(), torch.cuda.get_device_name(0)
    gpu = a.gpu or device_gpu(device) or "H100-80GB"
    profile = None
    if a.calibrate and not a.dry_run:
        cal = out / "calibration.json"
        first = base_config(a.models.split(",")[0], gpus, a.batch_scale)
        cfg_path = first.save(out / "calibration_config.json")
        rc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", str(cfg_path), "--out", str(cal),
                             "--gpu", gpu, "--timeout", "240"], cwd=ROOT).returncode
        profile = load_profile(cal) if rc == 0 and cal.exists() else None
        print(f"[advisor] calibration {'written' if profile else 'FAILED; the shipped profile is used'} after {time.time() - t0:.0f}s")
    ns = argparse.Namespace(variant_timeout=a.variant_timeout, cpu_smoke=False)
    passthrough = [f"--steps={a.steps}", f"--warmup={a.warmup}", "--no-stream-cost"]
    rows = []
    for model in [m.strip() for m in a.models.split(",") if m.strip()]:
        cfg = base_config(model, gpus, a.batch_scale)
        adv = advise(cfg, gpus, gpu=gpu, top=None, profile=profile)  # every layout's memory: TP / PP / own rows too
        for r in pick(adv, a.top, layout_of(cfg)):
            over = overrides_of(r, cfg)
            v = tt.Variant(f"advisor/{model}/{r.label.replace(' ', '-')}", "workbench", model, gpus=gpus,
                           microbatches=4 * a.batch_scale, overrides=over)
            pred = {"predicted_tokens_per_s": r.prediction.tokens_per_s, "predicted_mfu": r.prediction.mfu,
                    "predicted_fits": r.fits, "predicted_memory_gib": r.memory_gib, "predicted_rank": r.rank,
                    "predicted_breakdown_s": r.prediction.breakdown, "layout": r.layout.to_dict(), "profile": adv.profile}
            print(f"[advisor] {v.name}: predicted {r.prediction.tokens_per_s:.0f} tok/s, rank {r.rank}", flush=True)
            if a.dry_run:
                continue
            if time.time() - t0 > a.budget_s:
                print(f"[advisor] budget spent: {v.name} not run", flush=True)
                continue
            res = tt._launch(v, ns, passthrough)
            row = tt.summarise(v, res, tt.bench_config(v), tt.PEAK_TFLOPS, gpus)
            row.update(pred)
            row.update({**stamp(device), "peak_tflops": tt.PEAK_TFLOPS, "quick": True, "cpu_smoke": False})
            if row.get("ok"):
                row["error_vs_predicted"] = row["predicted_tokens_per_s"] / row["tokens_per_s"] - 1
            rows.append(row)
            with open(out / "advisor.jsonl", "a") as fh:
                fh.write(json.dumps(row, default=str) + "\n")
            print(f"[advisor] {v.name}: " + (f"measured {row['tokens_per_s']:.0f} tok/s ({row['error_vs_predicted'] * 100:+.1f}%)"
                                             if row.get("ok") else f"FAILED: {str(row.get('error'))[:200]}"), flush=True)
    if rows:
        plot(rows, out / "predicted_vs_measured.png")
        ok = [r for r in rows if r.get("ok")]
        oom_agree = sum(1 for r in rows if bool(r.get("ok")) == bool(r.get("predicted_fits")))
        print(f"[advisor] {len(ok)}/{len(rows)} ran; fits/OOM agreement {oom_agree}/{len(rows)}; "
              + ", ".join(f"{r['variant']}: {r['error_vs_predicted'] * 100:+.1f}%" for r in ok))
    print(f"[advisor] done after {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    sys.exit(main())
