"""GPU proof: BERT and T5 train on the compiled layer (issues 20, 21), through the real backend.

    python3 tests/gpu_proofs/compiled_families_loss.py --out $OUT/compiled_families_loss.jsonl [--steps 150]

Per family (bert-base, t5-base; dropout 0 so the kernel rule puts every layer on the compiled layer with
CUDA graphs; the embedded corpus with the family's demo tokenizer; bf16, one GPU): ``python -m
workbench.rank`` under torchrun, then from the event stream: the kernel path the run reported, the
first and last losses, the smallest loss of the last tenth against the first tenth (must fall), eval
losses and tokens/s.  One JSON line per family with device, date and commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

CASES = {"bert-base": {"train.micro_batch_size": 8, "train.global_batch_size": 32},
         "t5-base": {"train.micro_batch_size": 16, "train.global_batch_size": 64}}


def run(name: str, steps: int, timeout: float) -> dict:
    from workbench.config import preset
    from workbench.provenance import stamp
    from workbench.run.reader import read_events

    cfg = preset(name, **{**CASES[name], "data.source": "demo", "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
                          "train.train_iters": steps, "train.eval_interval": steps // 2, "train.eval_iters": 2,
                          "train.lr": 5e-4, "train.lr_warmup_iters": steps // 10, "train.precision": "bf16",
                          "parallel.device": "cuda", "checkpoint.save_on_exit": False})
    run_dir = Path(tempfile.mkdtemp(prefix=f"wb-{name}-compiled-"))
    cfg.save(run_dir / "config.json")
    proc = harness.torchrun(1, ["-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)], timeout)
    ev = read_events(run_dir)
    start = next((e for e in ev if e["event"] == "run_start"), {})
    losses = [e["loss"] for e in ev if e["event"] == "step" and e.get("loss") is not None]
    tenth = max(len(losses) // 10, 1)
    tail = [e["tokens_per_s"] for e in ev if e["event"] == "step" and e.get("tokens_per_s")][len(losses) // 3:]
    return {**stamp(), "family": name, "returncode": proc.returncode, "steps": len(losses),
            "kernel_layer": (start.get("kernels") or {}).get("layer"), "fast_layer": (start.get("kernel_path") or {}).get("fast_layer"),
            "cuda_graphs": (start.get("kernels") or {}).get("cuda_graphs"),
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "first_tenth_mean": sum(losses[:tenth]) / tenth if losses else None,
            "last_tenth_min": min(losses[-tenth:]) if losses else None,
            "losses": [round(x, 4) for x in losses],
            "evals": [{k: e.get(k) for k in ("iteration", "loss", "mlm accuracy")} for e in ev if e["event"] == "eval"],
            "tokens_per_s": harness.median(tail) if tail else None,
            "error": None if proc.returncode == 0 else proc.stderr[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--only", default=",".join(CASES))
    a = ap.parse_args()
    ok = True
    with open(a.out, "a") as fh:
        for name in a.only.split(","):
            row = run(name, a.steps, a.timeout)
            fh.write(json.dumps(row) + "\n")
            fell = row["last_tenth_min"] is not None and row["last_tenth_min"] < row["first_tenth_mean"]
            ok = ok and row["returncode"] == 0 and fell
            print(json.dumps({k: row[k] for k in ("family", "returncode", "steps", "fast_layer", "first_loss", "last_loss",
                                                   "tokens_per_s", "evals", "error")}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
