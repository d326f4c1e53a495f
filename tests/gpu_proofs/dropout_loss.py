"""GPU proof: under dropout the compiled layer trains like megatron's stock layer, through the backend.

    python3 tests/gpu_proofs/dropout_loss.py --out $OUT/dropout_loss.jsonl --png $OUT/dropout_loss.png \
        [--families bert-base,t5-base] [--runs stock,compiled] [--steps 300]
    python3 tests/gpu_proofs/dropout_loss.py --plot bench/results/dropout_loss.jsonl --png bench/results/dropout_loss.png  (no GPU)

Per family (the preset as shipped: dropout 0.1; the embedded corpus with the family's demo tokenizer; a small batch,
one micro-batch a step; bf16; one GPU; same seed, so the same initial weights and batches) and per run kind:
``stock`` (``train.compile_kernels: false``: megatron's TransformerLayer, dropout from its own calls) or ``compiled``
(the default kernel path: the compiled layer replayed as CUDA graphs, dropout inside its graph), ``python -m
workbench.rank`` under torchrun; from the event stream every step's loss, tokens/s and the kernel path.  The masks
differ between the two (their random streams are consumed differently), so the curves are compared statistically,
by fp8_loss.py's rule: per step, the relative difference of the losses smoothed over ``--window`` steps (centred
moving average), its maximum after the first ``--window`` steps, against the mean curve of the family's stock runs;
the bar is 1.5%.  A second stock run (``--runs stock,stock,compiled``) shows the stock layer's own run-to-run spread.
One JSON line per run with device, date and commit; a compiled run's line carries its comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/gpu_proofs: fp8_loss's comparison rule

from fp8_loss import BAR, compare, mean_curve, smoothed  # noqa: E402

#: per family: a small batch (one micro-batch a step) that keeps 300 steps within a minute or two
BATCH = {"bert-base": {"train.micro_batch_size": 8, "train.global_batch_size": 8},
         "t5-base": {"train.micro_batch_size": 16, "train.global_batch_size": 16}}


def run(family: str, kind: str, steps: int, lr: float, timeout: float) -> dict:
    from bench import harness
    from workbench.config import preset
    from workbench.provenance import stamp
    from workbench.run.reader import read_events

    cfg = preset(family, **{**BATCH.get(family, {}), "data.source": "demo", "train.train_iters": steps, "train.eval_interval": 0,
                            "train.lr": lr, "train.min_lr": lr / 10, "train.lr_warmup_iters": max(steps // 10, 1),
                            "train.precision": "bf16", "parallel.device": "cuda", "checkpoint.save_on_exit": False,
                            "train.compile_kernels": kind == "compiled"})
    run_dir = Path(tempfile.mkdtemp(prefix=f"wb-dropout-{family}-{kind}-"))
    cfg.save(run_dir / "config.json")
    t0 = time.monotonic()
    proc = harness.torchrun(1, ["-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)], timeout)
    ev = read_events(run_dir)
    start = next((e for e in ev if e["event"] == "run_start"), {})
    steps_ev = [e for e in ev if e["event"] == "step" and e.get("loss") is not None]
    speed = [e["tokens_per_s"] for e in steps_ev if e.get("tokens_per_s")][len(steps_ev) // 3:]
    return {**stamp(), "family": family, "kind": kind, "returncode": proc.returncode, "steps": len(steps_ev),
            "hidden_dropout": cfg.model.hidden_dropout, "attention_dropout": cfg.model.attention_dropout,
            "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size, "lr": lr,
            "kernel_layer": (start.get("kernels") or {}).get("layer"),
            "fast_layer": (start.get("kernel_path") or {}).get("fast_layer"),
            "losses": [round(e["loss"], 5) for e in steps_ev], "wall_s": round(time.monotonic() - t0, 1),
            "tokens_per_s": harness.median(speed) if speed else None,
            "error": None if proc.returncode == 0 else proc.stderr[-3000:]}


def rows_of(path: Path) -> list[dict]:
    return [r for r in (json.loads(l) for l in path.read_text().splitlines() if l.strip())
            if r.get("returncode") == 0 and "kind" in r]


def judged(rows: list[dict], r: dict, window: int) -> dict | None:
    """``r`` against the mean of its family's other stock runs (same batch, learning rate and steps); None: none."""
    same = ("family", "micro_batch_size", "global_batch_size", "lr", "steps")
    stocks = [b for b in rows if b["kind"] == "stock" and b is not r and all(b.get(k) == r.get(k) for k in same)]
    if not stocks:
        return None
    return {**compare(mean_curve(stocks), r["losses"], window), "stock_runs": len(stocks)}


def plot(path: Path, png: Path, window: int) -> None:
    """Per family: every run's smoothed loss (top) and its relative difference from the mean of the stock runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(path)
    families = sorted({r["family"] for r in rows})
    fig, axes = plt.subplots(2, len(families), figsize=(7 * len(families), 7), squeeze=False, height_ratios=[2, 1])
    for col, family in enumerate(families):
        ax, ax2 = axes[0][col], axes[1][col]
        runs = [r for r in rows if r["family"] == family]
        stocks = [r for r in runs if r["kind"] == "stock"]
        mean = smoothed(mean_curve(stocks), window) if stocks else None
        for i, r in enumerate(runs):
            style = dict(c=f"C{i}", ls="--" if r["kind"] == "stock" else "-", lw=1.0 if r["kind"] == "stock" else 1.4)
            curve = smoothed(r["losses"], window)
            label = f"{r['kind']} {r['git_commit'][:7]} ({r['tokens_per_s'] or 0:.0f} tok/s)"
            ax.plot(curve, label=label, **style)
            if mean:
                ax2.plot([100 * (y - x) / x for x, y in zip(mean, curve)], **style)
        ax.set_title(f"{family}, dropout {runs[0]['hidden_dropout']:g} / {runs[0]['attention_dropout']:g}: compiled vs stock "
                     f"({runs[0]['device']})")
        ax.set_ylabel(f"loss (moving average, {window} steps)")
        ax.legend(fontsize=7)
        for y in (100 * BAR, -100 * BAR):
            ax2.axhline(y, ls=":", c="grey")
        ax2.set_ylabel(f"% vs mean of {len(stocks)} stock")
        ax2.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON lines, appended")
    ap.add_argument("--png")
    ap.add_argument("--plot", help="draw (and judge) an existing file instead of training")
    ap.add_argument("--families", default="bert-base,t5-base")
    ap.add_argument("--runs", default="stock,compiled", help="comma list of stock / compiled, run in this order per family")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args()
    kinds = [k.strip() for k in a.runs.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("stock", "compiled")] + [f for f in a.families.split(",") if f not in BATCH]
    if bad or not (a.plot or a.out):
        print(f"dropout_loss: {'unknown ' + ', '.join(bad) if bad else 'give --out (train) or --plot FILE'}; "
              f"runs are stock / compiled, families {', '.join(BATCH)}", file=sys.stderr)
        return 2
    path = Path(a.plot or a.out)
    if not a.plot:
        path.parent.mkdir(parents=True, exist_ok=True)
        for family in a.families.split(","):
            for kind in kinds:
                row = run(family, kind, a.steps, a.lr, a.timeout)
                with open(path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"{family} {kind}: rc={row['returncode']} {row['steps']} steps in {row['wall_s']} s, "
                      f"{row['tokens_per_s'] or 0:.0f} tok/s, layer {row['fast_layer'] or row['kernel_layer']}"
                      + (f"\n{row['error']}" if row["error"] else ""), flush=True)
    rows = rows_of(path)
    ok = True
    for r in rows:
        cmp = judged(rows, r, a.window)
        if cmp is None:
            continue
        if r["kind"] == "compiled":
            ok &= cmp["within_bar"]
        print(f"{r['family']:<10} {r['kind']:<9} {r['git_commit'][:7]} vs the mean of {cmp['stock_runs']} stock runs: "
              f"{100 * cmp['max_rel_smoothed']:.2f}% at most (smoothed over {a.window} steps; bar {100 * BAR:g}%"
              f"{'' if r['kind'] == 'stock' else (', within' if cmp['within_bar'] else ', OVER')})")
    if a.png and rows:
        plot(path, Path(a.png), a.window)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
