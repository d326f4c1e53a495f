"""Train the demo models the generation, BERT and T5 notebooks show, and export them where the notebooks load them.

    python tools/train_demo_models.py [--device cuda|cpu] [--only bert-tiny-kjv]

Each model is its family's tiny CPU preset (``tiny``, ``bert-tiny``, ``t5-tiny``: the shapes a notebook trains on
a CPU) trained on the embedded corpus far longer than a notebook's default run, through the workbench's
own backend (``Run.launch``, megatron-core), then exported with ``megatron_to_hf`` as a Hugging Face
directory in bf16 (weights and tokenizer, 1-2 MB) in ``workbench/data/corpus/pretrained/``
(:data:`workbench.data.demo.DEMO_MODELS`, shipped with the package), with ``provenance.json``: the
recipe, the final training and evaluation losses, the device, the commit and the date, and what the
model says on the notebook's examples.  The notebooks convert it back to a workbench checkpoint
(:func:`workbench.notebook.demo_checkpoint`) to show what the family does once trained; their own short
runs show the training itself.

What sets a demo model's time on a GPU is building its batches on the host (megatron's BERT masking costs 1-2 ms a
sample on one core), so the models share the host's cores out by what their samples cost (:data:`RECIPES`).  The
three at once on one H200 with 16 cores at 44a083c (GPT 8,000 steps x 512, T5 4,000 x 512, BERT 3,000 x 512): GPT
in 5.0 minutes, T5 in about 5, BERT in 8.2 (loss 3.45, 2 of 07's 4 masks).  At 6f6966e, the shipped models: BERT alone
with 14 loaders at 20 steps/s x 256 (8,898 steps in the 460 s ``--deadline``, loss 3.04, 3 of 4 masks), then T5 and GPT
together at 30 and 37 steps/s (10,000 x 256 in 6.0 minutes, loss 2.00; 8,000 x 512 in 4.0, loss 2.55).  On a 2-core
CPU it takes days: 2,000 steps of 64 sequences (35 minutes here) still fill every mask with "the".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from workbench.data.demo import DEMO_MODELS

HERE = Path(__file__).resolve().parent


def _schedule(steps: int, batch: int, workers: int) -> dict:
    """A demo model's overrides: ``steps`` of ``batch`` sequences, cosine from 3e-3, ``workers`` loader processes."""
    return {"train.train_iters": steps, "train.lr_decay_iters": steps, "train.micro_batch_size": batch,
            "train.global_batch_size": batch, "train.lr": 3e-3, "train.min_lr": 1e-4,
            "train.lr_warmup_iters": max(steps // 20, 1), "train.lr_decay_style": "cosine", "train.eval_interval": max(steps // 4, 1),
            "train.eval_iters": 4, "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0,
            "data.num_workers": workers}


#: name -> (preset, overrides): the tiny shapes a notebook trains on a CPU, trained far longer.  What sets the time
#: on a GPU is building the batches on the host (the module's docstring has the rates), so BERT trains alone with
#: most of a 16-core host's loader processes (``--only bert-tiny-kjv``), T5 and GPT together (``--only t5-tiny-kjv
#: --only gpt-tiny-kjv``): each call under ten minutes.  Three and 2.5 times the steps of half the batch of the run at
#: 44a083c for BERT and T5 (1.5 and 1.25 times the samples: a tiny model is far from its critical batch size);
#: ``--deadline`` stops and exports what is still going, so a call that runs short still returns a model.
#: A T5 twice as wide and deep (128 wide, 4 + 4 layers, FFN 512) trained alone on one H200 at 705bd4a ran at ~20
#: steps/s, not the narrow one's 30: 8,373 of 10,000 steps in its 420 s deadline, loss 2.46 (the narrow 2.00), and it
#: filled 08's sentinels with punctuation and verse numbers; the notebooks' CPU shapes stay the recipe.
RECIPES = {
    "bert-tiny-kjv": ("bert-tiny", _schedule(9000, 256, 14)),
    "t5-tiny-kjv": ("t5-tiny", _schedule(10000, 256, 10)),
    "gpt-tiny-kjv": ("tiny", _schedule(8000, 512, 3)),
}

#: what the notebooks ask each model (07_bert's fill-mask, 08_t5's sentinels)
EXAMPLES = {
    "bert-tiny-kjv": ["In the beginning God created the [MASK] and the earth.",
                      "And God said, Let there be [MASK]: and there was light.",
                      "And the [MASK] spake unto Moses, saying,",
                      "Speak unto the children of [MASK], and say unto them,"],
    "t5-tiny-kjv": ["In the beginning God created the <extra_id_0> and the earth.<|endoftext|>",
                    "And the LORD spake unto <extra_id_0>, saying,<|endoftext|>",
                    "Speak unto the children of <extra_id_0>, and say unto them,<|endoftext|>"],
    "gpt-tiny-kjv": ["In the beginning", "And the LORD said unto Moses,", "Blessed are"],
}


def _fill_mask(ckpt: Path, prompts: list[str]) -> list[str]:
    from workbench.models.bert.fill_mask import fill_mask

    return [str(r) for r in fill_mask(ckpt, prompts, top_k=3)[0]]


def _greedy(ckpt: Path, prompts: list[str]) -> list[str]:
    from workbench.generation import generate

    return [f"{r.prompt!r} -> {r.text!r}" for r in generate(ckpt, prompts, greedy=True, max_new_tokens=8, device="cpu")]


#: how each model is asked its examples (as its notebook asks it)
ASK = {"bert-tiny-kjv": _fill_mask, "t5-tiny-kjv": _greedy, "gpt-tiny-kjv": _greedy}


def examples(name: str, ckpt: Path) -> list[str]:
    """The model's answers to :data:`EXAMPLES`, asked the way its notebook asks (:data:`ASK`)."""
    return ASK[name](ckpt, EXAMPLES[name])


def launch(name: str, device: str, work: Path, steps: int | None = None, batch: int | None = None, share: float = 1.0):
    """Start the training run of demo model ``name``; returns (run, preset, overrides)."""
    from workbench.config import preset
    from workbench.launch import Run

    base, recipe = RECIPES[name]
    # the recipe's schedule, with the steps / batch asked for instead (their warm-up and evaluations follow)
    over = {**recipe, **_schedule(steps or recipe["train.train_iters"], batch or recipe["train.global_batch_size"],
                                  max(int(recipe["data.num_workers"] * share), 1))}
    if device == "cpu":
        del over["data.num_workers"]  # CPU mode builds batches in the rank itself
    cfg = preset(base, **{**over, "parallel.device": device, "parallel.nproc_per_node": 1}).replace(name=name)
    run = Run.launch(cfg, run_root=work)
    print(f"{name}: {run.run_dir}", flush=True)
    return run, base, over


def wait_all(runs: dict, when_done, every: float = 30.0, deadline: float | None = None) -> None:
    """Wait for every run, calling ``when_done(name, seconds)`` as each ends (``seconds``: launch to the run's own end,
    from its ``exit_status.json``) and printing each one's step and steps/s (over the last ``every`` seconds, data
    loading included) every ``every`` seconds.  Runs still going ``deadline`` seconds after the start are stopped
    (each finishes its step and saves: :meth:`~workbench.launch.Run.stop`) and exported as they stand."""
    t0 = last = time.time()
    seen = {name: 0 for name in runs}
    ended: set[str] = set()
    while len(ended) < len(runs):
        if deadline is not None and time.time() - t0 >= deadline:
            going = [(name, run) for name, (run, _b, _o) in runs.items() if name not in ended and not run.done]
            for name, run in going:
                print(f"{name}: stopped at the {deadline:.0f} s deadline, step {run.progress()[0]}", flush=True)
            with ThreadPoolExecutor(max(len(going), 1)) as pool:  # all at once: none trains on while another saves
                list(pool.map(lambda named: named[1].stop(grace=120.0), going))
            deadline = None
        for name, (run, _b, _o) in runs.items():
            if name not in ended and run.done:
                ended.add(name)
                took = float((run.exit_status or {}).get("ended") or time.time()) - t0
                print(f"{name}: {run.status} after {took:.0f} s", flush=True)
                when_done(name, took)
        if time.time() - last >= every:
            dt, last = time.time() - last, time.time()
            for name, (run, _b, _o) in runs.items():
                it, total, _eta = run.progress()
                print(f"[{last - t0:4.0f} s] {name}: step {it}/{total}, {(it - seen[name]) / dt:.1f} steps/s", flush=True)
                seen[name] = it
        time.sleep(2.0)


def export(name: str, run, base: str, over: dict, device: str, seconds: float, out_root: Path) -> dict:
    """Export ``run``'s checkpoint as a bf16 HF directory ``out_root/name`` with ``provenance.json``."""
    from workbench.checkpoint import TRACKER_FILE
    from workbench.conversion import megatron_to_hf

    ckpt = run.run_dir / "checkpoints"
    if run.status != "finished" and not (run.status == "stopped" and (ckpt / TRACKER_FILE).exists()):
        raise SystemExit(f"{name}: the run {run.status}: {run.run_dir}\n{run.log_tail(0)}")
    # the steps it trained, from the checkpoint's tracker (fewer than the recipe's when stopped at the deadline)
    steps = int((ckpt / TRACKER_FILE).read_text().strip())
    out, tmp = out_root / name, out_root / f".{name}.partial"  # the shipped model is replaced only by a whole one
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    megatron_to_hf(ckpt, tmp, dtype="bf16", progress=False)
    cfg = run.config
    losses = run.train_loss["loss"].astype(float)
    evals = run.evals
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                                                            text=True).stdout.strip()
    said = examples(name, ckpt)
    gpu = _gpu_name() if device == "cuda" else "cpu"
    model = [f"{k.split('.', 1)[1]} {v}" for k, v in over.items() if k.startswith("model.")]
    shape = f" ({', '.join(model)})" if model else ""  # the recipe's own shapes, where it changes the preset's
    prov = {"name": name, "preset": base, "overrides": over, "device": gpu, "commit": commit,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "steps": int(steps),
            "train_wall_s": round(seconds, 1),
            "final_train_loss": round(float(losses.iloc[-50:].mean()), 3),
            "final_eval_loss": round(float(evals["loss"].iloc[-1]), 3) if len(evals) else None,
            "examples": said,
            "summary": (f"the {base} preset{shape} trained {steps} of {cfg.train.train_iters} steps x {cfg.train.global_batch_size} "
                        f"sequences on the embedded corpus ({gpu}, {seconds / 60:.1f} min), loss "
                        f"{losses.iloc[-50:].mean():.2f}; made by tools/train_demo_models.py")}
    (tmp / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"{name} ({prov['summary']}):", *said, sep="\n  ", flush=True)
    return prov


def _gpu_name() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else "cuda"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda | cpu (default: cuda when a GPU is visible)")
    ap.add_argument("--only", action="append", choices=sorted(RECIPES), help="train only this model (repeatable)")
    ap.add_argument("--steps", type=int, default=None, help="training steps instead of the recipe's (recorded)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step instead of the recipe's (recorded)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after which runs still going are stopped (they save) and exported as they stand")
    ap.add_argument("--out", type=Path, default=DEMO_MODELS, help=f"where the models go (default: {DEMO_MODELS})")
    args = ap.parse_args(argv)
    from workbench.launch import detect_gpus

    device = args.device or ("cuda" if detect_gpus() else "cpu")
    failed = []

    def when_done(name: str, seconds: float) -> None:  # export each model as soon as its run ends
        run, base, over = runs[name]
        try:
            export(name, run, base, over, device, seconds, args.out)
        except (Exception, SystemExit) as e:  # one model's failure leaves the others' exports
            failed.append(name)
            print(f"{name}: not exported: {e}", flush=True)

    names = args.only or sorted(RECIPES)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 4)
    # the loader processes of the models trained together, scaled down to the cores left beside their ranks
    share = min(1.0, max(cores - 2 * len(names), len(names)) / sum(RECIPES[n][1]["data.num_workers"] for n in names))
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="demo-models-") as tmp:
        try:  # every run started is stopped on the way out, also when a later launch fails
            for name in names:
                runs[name] = launch(name, device, Path(tmp), args.steps, args.batch, share)
            wait_all(runs, when_done, deadline=args.deadline)
        finally:
            for run, _base, _over in runs.values():
                if run.is_alive():
                    run.stop()
    if failed:
        print(f"not exported: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
