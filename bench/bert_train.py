"""BERT benchmark rows: one-GPU training throughput of the presets as shipped against HF's own ``BertForPreTraining``,
planner prediction against the measured peak, 200 steps on the embedded corpus, and the TP=2 / PP=2 rows.

Rows (``--rows``, comma list):

- ``throughput`` (the headline rows): ``bert-base`` and ``bert-large`` AT THEIR PRESETS' DEFAULTS (hidden and
  attention dropout 0.1, seq 512, micro-batch 8, 8 micro-batches, bf16) trained by the workbench's Trainer (real
  mcore BertModel, DDP, Megatron optimizer; the kernel path the rule picks) and by the yardstick
  (``bench/reference_bert.py``: HF ``BertForPreTraining`` with SDPA attention, whole-model ``torch.compile``, bf16
  autocast, fused AdamW, clip 1.0, the same dropout) on the same synthetic BERT batches (padding included), same
  GPU, same run: tokens/s, ratio (target >= 1.15x), MFU (Megatron's FLOPs).
- ``throughput-dropout0``: ``bert-base`` with dropout 0 on both sides (not the preset's setting; named so).
- ``planner``: ``bert-base`` and ``bert-large`` as shipped: the planner's rank-0 peak allocated against
  ``torch.cuda.max_memory_allocated`` of the workbench's steps (target within 10%).
- ``dropout``: ``bert-base`` (dropout 0.1) with ``attention_backend`` sdpa, te and auto.
- ``loss200``: ``python -m workbench.rank`` (torchrun, one GPU) on the embedded corpus, BERT-base shape with
  the demo WordPiece vocabulary, 200 steps: first and last MLM loss (must fall), eval masked-token accuracy.
- ``tp2``, ``pp2``: BERT-base as shipped through the backend on 2 GPUs (TP=2 + SP; PP=2 1F1B), synthetic data,
  30 steps: tokens/s and MFU from the event stream.

Each row runs in its own torchrun process; results are appended as JSON lines (device, date, commit) to
``--out`` (default ``bench/results/bert_train.jsonl``), then a table of the throughput rows' ratios is printed.
``--cpu-smoke`` runs ``bert-tiny`` on CPU (CI smoke).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def _cfg(preset_name: str, smoke: bool, **over: Any):
    return harness.bench_cfg(preset_name, smoke, smoke_preset="bert-tiny", **over)


def worker(a: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (torchrun) process."""

    def reference(cfg: Any, **kw: Any) -> Any:
        from bench.reference_bert import ReferenceBert

        return ReferenceBert(cfg, **kw)

    def dataset(cfg: Any) -> Any:
        from workbench.models.bert.data import SyntheticBertDataset

        return SyntheticBertDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)

    return harness.train_worker(a.worker, a.preset, _cfg(a.preset, a.cpu_smoke, **harness.overrides(a)), a, reference=reference, dataset=dataset,
                                tmp_prefix="wb-bert-bench-")


def _backend_run(cfg: Any, nproc: int, a: argparse.Namespace) -> dict[str, Any]:
    from workbench.run.reader import read_events

    cfg.parallel.nproc_per_node = nproc
    if problems := cfg.validate():  # the backend would exit 2 on them: say so without launching
        return {"returncode": 2, "error": "; ".join(map(str, problems))}
    run_dir = Path(tempfile.mkdtemp(prefix="wb-bert-run-"))
    cfg.save(run_dir / "config.json")
    proc = harness.torchrun(nproc, ["-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)], a.timeout)
    ev = read_events(run_dir)
    steps = [e for e in ev if e["event"] == "step" and e.get("loss") is not None]
    evals = [e for e in ev if e["event"] == "eval"]
    tail = steps[len(steps) // 3:]  # after compilation / warm-up
    return {"returncode": proc.returncode, "run_dir": str(run_dir), "steps": len(steps),
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "losses": [round(e["loss"], 4) for e in steps],
            "tokens_per_s": harness.median([e["tokens_per_s"] for e in tail]) if tail else None,
            "mfu": harness.median([e["mfu"] for e in tail if e.get("mfu") is not None] or [0.0]) if tail else None,
            "evals": [{"iteration": e["iteration"], "loss": e["loss"], "mlm accuracy": e.get("mlm accuracy")} for e in evals],
            "error": None if proc.returncode == 0 else proc.stderr[-3000:]}


def layout_rows(smoke: bool) -> dict[str, dict[str, Any]]:
    """The 2-GPU rows' overrides: TP=2 + SP and PP=2 (1F1B), a short run (warm-up within it)."""
    iters = 4 if smoke else 30
    short = {"train.train_iters": iters, "train.lr_warmup_iters": 1 if smoke else 3, "train.global_batch_size": 4 if smoke else 64}
    return {"tp2": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, **short},
            "pp2": {"parallel.pipeline_parallel": 2, **short}}


def rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    want = harness.wanted(a)
    base = "bert-tiny" if a.cpu_smoke else "bert-base"
    out = harness.training_rows(SCRIPT, a, [base] if a.cpu_smoke else ["bert-base", "bert-large"],
                                lambda name, **over: _cfg(name, a.cpu_smoke, **over))
    if "loss200" in want:
        over = {"data.source": "demo", "train.train_iters": 200, "train.eval_interval": 100, "train.eval_iters": 2,
                "train.lr": 5e-4, "train.lr_warmup_iters": 20}
        if a.cpu_smoke:
            over.update({"train.train_iters": 4, "train.eval_interval": 2, "train.lr_warmup_iters": 1})
        out.append({"row": "loss200", **_backend_run(_cfg(base, a.cpu_smoke, **over), 1, a)})
    for name, over in layout_rows(a.cpu_smoke).items():
        if name in want:
            out.append({"row": name, **_backend_run(_cfg(base, a.cpu_smoke, **over), 2, a)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, rows="throughput,throughput-dropout0,planner",
                        rows_help="comma list: throughput, throughput-dropout0, planner, dropout, loss200, tp2, pp2",
                        smoke_help="bert-tiny on CPU, 2 steps (CI smoke)", out="bert_train.jsonl", preset="bert-base")
    return harness.run(ap.parse_args(argv), worker, rows)


if __name__ == "__main__":
    sys.exit(main())
