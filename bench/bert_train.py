"""BERT benchmark rows (issue #20): one-GPU throughput against a compiled HF MegatronBertForPreTraining,
planner prediction against the measured peak, 200 steps on the embedded corpus, and the TP=2 / PP=2 rows.

Rows (``--rows``, comma list):

- ``throughput``: BERT-base shape (seq 512, micro-batch 8, 8 micro-batches, bf16, dropout 0 in both) trained
  by the workbench's Trainer (real mcore BertModel, DDP, Megatron optimizer) and by the compiled HF
  reference (``bench/reference_bert.py``: SDPA attention, fused AdamW) on the same synthetic BERT batches
  (padding included), same GPU, same run: tokens/s, ratio (target >= 1.0x), MFU (Megatron's FLOPs).
- ``planner``: BERT-base and BERT-large (micro-batch 8, seq 512, bf16): the planner's rank-0 peak allocated
  against ``torch.cuda.max_memory_allocated`` of the workbench's steps (target within 10%).
- ``loss200``: ``python -m workbench.backend`` (torchrun, one GPU) on the embedded corpus, BERT-base shape with
  the demo WordPiece vocabulary, 200 steps: first and last MLM loss (must fall), eval masked-token accuracy.
- ``tp2``, ``pp2``: BERT-base through the backend on 2 GPUs (TP=2 + SP; PP=2 1F1B), synthetic data, 30 steps:
  tokens/s and MFU from the event stream (a later GPU issue; runnable now).

Each row runs in its own torchrun process; results are appended as JSON lines (device, date, commit) to
``--out`` (default ``bench/results/bert_train.jsonl``).  ``--cpu-smoke`` runs tiny shapes on CPU (CI smoke).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cfg(preset_name: str, smoke: bool, **over: Any):
    from workbench.config import preset

    if smoke:
        base = {"data.source": "synthetic", "train.micro_batch_size": 2, "train.global_batch_size": 4, "train.eval_interval": 0,
                "checkpoint.save_on_exit": False, "parallel.device": "cpu", "train.precision": "fp32", "train.compile_kernels": False}
        return preset("bert-tiny", **{**base, **over})
    base = {"data.source": "synthetic", "train.micro_batch_size": 8, "train.global_batch_size": 64, "train.precision": "bf16",
            "train.compile_kernels": True, "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0, "train.eval_interval": 0,
            "checkpoint.save_on_exit": False, "train.microbatch_timing_interval": 0, "parallel.device": "cuda"}
    return preset(preset_name, **{**base, **over})


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _time(step, n: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(n):
        _sync(cuda)
        t0 = time.perf_counter()
        step()
        _sync(cuda)
        out.append(time.perf_counter() - t0)
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def worker(kind: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    """One measurement in this (torchrun) process."""
    import torch

    from workbench.config import derive
    from workbench.models.bert.data import SyntheticBertDataset

    cfg = _cfg(preset_name, a.cpu_smoke)
    cuda = not a.cpu_smoke
    d = derive(cfg)
    out: dict[str, Any] = {"preset": preset_name, "kind": kind, "tokens_per_step": d.tokens_per_step, "flops_per_step": d.flops_per_step}
    if kind == "reference":
        from bench.reference_bert import ReferenceBert

        dev = "cuda" if cuda else "cpu"
        ref = ReferenceBert(cfg, device=dev, compile=cuda)
        ds = SyntheticBertDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
        mbs, k = cfg.train.micro_batch_size, d.num_microbatches
        pool = []
        for j in range(8):
            items = [ds[j * mbs + i] for i in range(mbs)]
            pool.append({key: torch.stack([it[key] for it in items]).to(dev) for key in items[0]})
        state = {"i": 0}

        def step() -> float:
            i = state["i"]
            state["i"] += 1
            return ref.step([pool[(i * k + j) % len(pool)] for j in range(k)])

        for _ in range(a.warmup):
            step()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = _time(step, a.steps, cuda)
    else:
        from workbench import planner
        from workbench.backend.train import Trainer

        tr = Trainer(cfg, tempfile.mkdtemp(prefix="wb-bert-bench-"))
        tr.setup()
        for _ in range(a.warmup):
            tr.train_step()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = _time(tr.train_step, a.steps, cuda)
        plan = planner.predict(cfg)
        out["planner_peak_allocated"] = int(plan.stages[0].peak_allocated)
        out["kernel_path"] = tr.kernel_path
    step_s = _median(times)
    out.update(step_times=times, step_s=step_s, tokens_per_s=d.tokens_per_step / step_s,
               mem_peak=int(torch.cuda.max_memory_allocated()) if cuda else None,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    if cuda:
        from workbench.backend.metrics import peak_tflops

        peak = peak_tflops(out["device"], cfg.train.precision, None)
        out["mfu"] = d.flops_per_step / step_s / 1e12 / peak if peak else None
    return out


def _torchrun(nproc: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    from workbench.run.files import free_port

    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # keep carried wheels' site dir
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _measure(kind: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        res_path = fh.name
    extra = ["--cpu-smoke"] if a.cpu_smoke else []
    proc = _torchrun(1, [str(Path(__file__).resolve()), "--worker", kind, "--preset", preset_name, "--result", res_path,
                         "--steps", str(a.steps), "--warmup", str(a.warmup), *extra], a.timeout)
    if proc.returncode != 0:
        return {"kind": kind, "preset": preset_name, "error": (proc.stdout[-1500:] + proc.stderr[-3000:])}
    return json.loads(Path(res_path).read_text())


def _backend_run(cfg: Any, nproc: int, a: argparse.Namespace) -> dict[str, Any]:
    from workbench.run.reader import read_events

    run_dir = Path(tempfile.mkdtemp(prefix="wb-bert-run-"))
    cfg.parallel.nproc_per_node = nproc
    cfg.save(run_dir / "config.json")
    proc = _torchrun(nproc, ["-m", "workbench.backend", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)], a.timeout)
    ev = read_events(run_dir)
    steps = [e for e in ev if e["event"] == "step" and e.get("loss") is not None]
    evals = [e for e in ev if e["event"] == "eval"]
    tail = steps[len(steps) // 3:]  # after compilation / warm-up
    return {"returncode": proc.returncode, "run_dir": str(run_dir), "steps": len(steps),
            "first_loss": steps[0]["loss"] if steps else None, "last_loss": steps[-1]["loss"] if steps else None,
            "losses": [round(e["loss"], 4) for e in steps],
            "tokens_per_s": _median([e["tokens_per_s"] for e in tail]) if tail else None,
            "mfu": _median([e["mfu"] for e in tail if e.get("mfu") is not None] or [0.0]) if tail else None,
            "evals": [{"iteration": e["iteration"], "loss": e["loss"], "mlm accuracy": e.get("mlm accuracy")} for e in evals],
            "error": None if proc.returncode == 0 else proc.stderr[-3000:]}


def rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    want = [r.strip() for r in a.rows.split(",") if r.strip()]
    base = "bert-tiny" if a.cpu_smoke else "bert-base"
    if "throughput" in want:
        wb, ref = _measure("workbench", base, a), _measure("reference", base, a)
        ratio = wb["tokens_per_s"] / ref["tokens_per_s"] if "tokens_per_s" in wb and "tokens_per_s" in ref else None
        out.append({"row": "throughput", "workbench": wb, "reference": ref, "ratio": ratio, "target": ">= 1.0"})
    if "planner" in want:
        for name in ([base] if a.cpu_smoke else ["bert-base", "bert-large"]):
            wb = _measure("workbench", name, a)
            pred, meas = wb.get("planner_peak_allocated"), wb.get("mem_peak")
            out.append({"row": "planner", "preset": name, "predicted": pred, "measured": meas,
                        "rel_error": (pred - meas) / meas if pred and meas else None, "target": "|rel_error| <= 0.10",
                        "error": wb.get("error")})
    if "loss200" in want:
        over = {"data.source": "demo", "train.train_iters": 200, "train.eval_interval": 100, "train.eval_iters": 2,
                "train.lr": 5e-4, "train.lr_warmup_iters": 20, "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
        if a.cpu_smoke:
            over.update({"train.train_iters": 4, "train.eval_interval": 2, "train.lr_warmup_iters": 1})
        out.append({"row": "loss200", **_backend_run(_cfg(base, a.cpu_smoke, **over), 1, a)})
    for name, over in (("tp2", {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}),
                       ("pp2", {"parallel.pipeline_parallel": 2})):
        if name in want:
            over = {**over, "train.train_iters": 4 if a.cpu_smoke else 30, "train.global_batch_size": 4 if a.cpu_smoke else 64}
            out.append({"row": name, **_backend_run(_cfg(base, a.cpu_smoke, **over), 2, a)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="throughput,planner,loss200", help="comma list: throughput, planner, loss200, tp2, pp2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--cpu-smoke", action="store_true", help="bert-tiny on CPU, 2 steps (CI smoke)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "bert_train.jsonl"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="bert-base", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        res = worker(a.worker, a.preset, a)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a.result).write_text(json.dumps(res))
        return 0
    if a.cpu_smoke:
        a.steps, a.warmup = min(a.steps, 2), min(a.warmup, 1)
    from workbench.provenance import git_commit

    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
             "cpu_smoke": a.cpu_smoke}
    results = rows(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as fh:
        for r in results:
            fh.write(json.dumps({**stamp, **r}) + "\n")
    for r in results:
        brief = {k: v for k, v in r.items() if k not in ("workbench", "reference", "losses")}
        if r["row"] == "throughput":
            brief.update(workbench_tokens_per_s=r["workbench"].get("tokens_per_s"), reference_tokens_per_s=r["reference"].get("tokens_per_s"),
                         mfu=r["workbench"].get("mfu"), errors=[x.get("error") for x in (r["workbench"], r["reference"]) if x.get("error")])
        print(json.dumps(brief, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
