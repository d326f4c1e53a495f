"""GPU proof: a converted HF GPT-2 is loaded by the backend and training continues from HF's loss.

Steps (all real: transformers, workbench convert, torchrun + ``python -m workbench.rank``):
1. a random HF GPT-2 (small config, gelu_new, no dropout) is saved and converted with
   ``hf_to_megatron`` at ``--tp/--pp`` (bf16 checkpoint, config with ``finetune: true``);
2. the backend trains ``--steps`` steps from it on the demo corpus; a forward-step hook
   records the micro-batches of step 1 (tokens, labels, loss mask);
3. the HF model (fp32 and bf16, on the GPU) computes the token-weighted loss on exactly
   those micro-batches; step 1's loss from the backend's event stream must match HF's
   fp32 loss within ``--atol`` (bf16 tolerance), and the later steps must be finite.

Usage (one GPU is enough; tp*pp GPUs for a parallel layout)::

    python tests/gpu_proofs/conversion_continue_training.py [--tp 1 --pp 1] [--out evidence/conversion_continue_training.jsonl]

Appends one JSON line: device, date, git_commit, layout, losses, |diff|, ok.  Exit 0 when ok.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_CALLS = {"n": 0}


def recording_forward_step(batch: Any, model: Any, record_dir: str = "", record_first: int = 1, **kwargs: Any) -> Any:
    """Backend forward-step hook: saves the first ``record_first`` micro-batches this rank sees, then runs the default step."""
    import torch

    from workbench.hooks import default_forward_step

    i = _CALLS["n"]
    _CALLS["n"] += 1
    rank = int(os.environ.get("RANK", "0"))
    if record_dir and i < record_first:
        # pipeline stages see different parts of a micro-batch (tokens first, labels last): keep what is here
        fields = {k: getattr(batch, k).cpu() for k in ("tokens", "labels", "loss_mask") if getattr(batch, k) is not None}
        if fields:
            torch.save(fields, Path(record_dir) / f"rank{rank}_mb{i}.pt")
    return default_forward_step(batch, model, **kwargs)


def _git_commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _hf_loss(hf_dir: Path, batches: list[dict], dtype: Any, device: str = "cuda") -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).to(device).eval()
    tot, n = 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            logits = model(b["tokens"].to(device)).logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].to(device).reshape(-1), reduction="none")
            m = b["loss_mask"].to(device).reshape(-1).float()
            tot += float((ce * m).sum())
            n += float(m.sum())
    return tot / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--atol", type=float, default=0.05, help="|backend step-1 loss - HF fp32 loss| allowed (bf16 training)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run of this script (fp32, gloo)")
    ap.add_argument("--work", type=Path, default=None, help="keep files here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "conversion_continue_training.jsonl")
    args = ap.parse_args(argv)

    import torch

    from workbench.conversion import hf_to_megatron, make_random_hf_model
    from workbench.run.reader import read_events

    work = args.work or Path(tempfile.mkdtemp(prefix="wb-convert-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = make_random_hf_model(work / "hf-gpt2", "gpt2", hidden=256, layers=4, heads=8, vocab=8192, positions=512, seed=0)
    precision = "bf16" if args.device == "cuda" else "fp32"
    res = hf_to_megatron(hf_dir, work / "megatron", tp=args.tp, pp=args.pp, dtype=precision, device=args.device, force=True)
    world = args.tp * args.pp
    rec = work / "recorded"
    rec.mkdir(exist_ok=True)
    micro, mbs = 2, 4
    cfg = res.config.replace(**{
        "name": "converted-gpt2-continue",
        "model.seq_length": 256,
        "parallel.nnodes": 1, "parallel.nproc_per_node": world,
        "train.micro_batch_size": mbs, "train.global_batch_size": mbs * micro, "train.train_iters": args.steps,
        "train.lr": 1e-4, "train.min_lr": 1e-5, "train.lr_warmup_iters": 0, "train.eval_interval": 0,
        "train.forward_step": "tests.gpu_proofs.conversion_continue_training:recording_forward_step",
        "train.hook_kwargs": {"record_dir": str(rec), "record_first": micro},
        # the random HF model ships no tokenizer (the conversion records none): train on the demo corpus's
        "data.source": "demo", "data.tokenizer": "demo", "checkpoint.save_on_exit": False, "train.precision": precision,
    })
    problems = cfg.validate()
    if problems:
        print("\n".join(map(str, problems)), file=sys.stderr)
        return 2
    cfg_path = cfg.save(work / "run.json")
    run_dir = work / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           "-m", "workbench.rank", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=900)
    (work / "backend.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print((proc.stdout + proc.stderr)[-4000:], file=sys.stderr)
    steps = sorted((e for e in read_events(run_dir) if e.get("event") == "step" and e.get("loss") is not None),
                   key=lambda e: e["iteration"])
    losses = [float(e["loss"]) for e in steps]
    merged: dict[int, dict] = {}
    for p in sorted(rec.glob("rank*_mb*.pt")):  # dp=1: every rank sees the same micro-batch sequence
        mb = int(p.stem.split("_mb")[1])
        for k, v in torch.load(p, weights_only=True).items():
            merged.setdefault(mb, {}).setdefault(k, v)
    batches = [merged[i] for i in sorted(merged) if {"tokens", "labels", "loss_mask"} <= set(merged[i])]
    hf32 = _hf_loss(hf_dir, batches, torch.float32, args.device) if batches else float("nan")
    hf16 = _hf_loss(hf_dir, batches, torch.bfloat16, args.device) if batches else float("nan")
    first = losses[0] if losses else float("nan")
    diff = abs(first - hf32)

    from workbench.backend.model import transformer_config

    act = transformer_config(cfg).activation_func
    ok = (proc.returncode == 0 and len(losses) == args.steps and len(batches) == micro and diff <= args.atol
          and all(math.isfinite(x) for x in losses))
    record = {
        "test": "conversion_continue_training", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": _git_commit(),
        "tp": args.tp, "pp": args.pp, "precision": precision, "backend_exit_code": proc.returncode,
        "backend_losses": losses, "hf_loss_fp32": hf32, "hf_loss_bf16": hf16, "abs_diff_step1_vs_hf_fp32": diff,
        "atol": args.atol, "microbatches_recorded": len(batches),
        "backend_activation": getattr(act, "keywords", {}).get("approximate", "none") if hasattr(act, "keywords") else getattr(act, "__name__", str(act)),
        "checkpoint": str(res.checkpoint), "ok": ok,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
