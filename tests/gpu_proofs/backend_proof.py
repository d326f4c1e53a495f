"""GPU proof for the training backend: layouts, resume and recompute against one GPU.

Run on a machine with 2 GPUs (from the repo root)::

    python tests/gpu_proofs/backend_proof.py --out evidence/backend_proof.jsonl

Every run is a real ``torchrun ... -m workbench.rank`` job on the same small GPT, the same
synthetic data and the same initial weights (one checkpoint made first and loaded with
``checkpoint.finetune`` by every layout, since dist checkpoints load at any TP/PP):

- 50 steps of TP=2, PP=2 (8 micro-batches), PP=2 x VPP=2, DP=2 + distributed optimizer,
  TP=2 + SP, each against TP=1/PP=1 on one GPU: max relative per-step loss difference;
- resume: 20 steps straight vs 10 + resume 10 (max abs loss difference of steps 11-20), on one
  GPU and at DP=2 with the distributed optimizer;
- recompute none / selective / full on one GPU: loss difference, peak memory, step time.

Writes JSON lines (each with device, date, git_commit) to ``--out`` and a tarball of the
PP=2 and PP=2xVPP=2 runs' ``events/`` to ``--runs-tar`` (for the schedule overlay).
``--device cpu --tiny`` runs the same logic on CPU (gloo) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workbench.config import RunConfig, preset  # noqa: E402
from workbench.run.files import free_port  # noqa: E402
from workbench.run.reader import read_events  # noqa: E402


def base_config(device: str, tiny: bool) -> RunConfig:
    if tiny:
        cfg = preset("tiny")
        cfg.train.train_iters = 8
        cfg.train.global_batch_size = 8  # 4 micro-batches of 2 on one rank
    else:
        cfg = preset("demo-small")  # 6 layers would not split into pp*vpp=4; use 8
        cfg.model.num_layers = 8
        cfg.model.hidden_size = 512
        cfg.model.num_attention_heads = 8
        cfg.model.vocab_size = 8192
        cfg.model.seq_length = 512
        cfg.model.max_position_embeddings = 512
        cfg.train.micro_batch_size = 4
        cfg.train.global_batch_size = 32  # 8 micro-batches on one rank, 4 per DP rank at DP=2
        cfg.train.train_iters = 50
        cfg.train.lr = 3e-4
        cfg.train.min_lr = 3e-5
        cfg.train.lr_warmup_iters = 5
        cfg.train.precision = "bf16"
    cfg.name = "backend-proof"
    cfg.data.source = "synthetic"
    cfg.parallel.device = device
    cfg.train.eval_interval = 0
    cfg.train.microbatch_timing_interval = 5
    cfg.train.compile_kernels = False
    cfg.checkpoint.save_on_exit = False
    return cfg


def run(cfg: RunConfig, run_dir: Path, nproc: int, log) -> list[dict]:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.parallel.nproc_per_node = nproc
    cfg.check()
    cfg.save(run_dir / "config.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
        try:  # a hung run fails here, with its log, instead of eating the device call
            rc = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
            proc.wait()
            rc = "timeout (240 s)"
    events = read_events(run_dir)
    log(f"{run_dir.name}: rc={rc} in {time.time() - t0:.1f}s")
    if rc != 0:
        errs = [e for e in events if e["event"] == "error"]
        tail = (run_dir / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"run {run_dir.name} failed (rc={rc}): {errs[0]['traceback'][-2000:] if errs else tail}")
    return events


def losses(events: list[dict], kind: str = "step") -> dict[int, float]:
    """Loss by iteration of a run's ``step`` (or ``eval``) events."""
    return {e["iteration"]: e["loss"] for e in events if e["event"] == kind and e.get("loss") is not None}


def steps(events: list[dict], rank: int = 0) -> list[dict]:
    return [e for e in events if e["event"] == "step" and e["rank"] == rank]


def max_rel(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    common = sorted(set(a) & set(b))
    worst, at = 0.0, -1
    for i in common:
        r = abs(a[i] - b[i]) / abs(b[i])
        if r > worst:
            worst, at = r, i
    return worst, at


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "evidence/backend_proof.jsonl"))
    ap.add_argument("--work", default="/tmp/backend_proof")
    ap.add_argument("--runs-tar", default=None, help="tar.gz of the PP runs' events (default: next to --out)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--commit", default=None, help="git commit to record (when the tree has no .git)")
    ap.add_argument("--compile", action="store_true", help="train.compile_kernels on (the performance helper's fast paths)")
    ap.add_argument("--set", default=None, help='dotted config overrides on every run, JSON (e.g. \'{"model.attention_backend": '
                    '"te", "train.eval_interval": 5}\': TE\'s layer, graphed, with evaluation during training)')
    ap.add_argument("--only", default=None,
                    help="comma-separated parts to run: layouts (tp2, pp2, ...), resume, resume_dp2_distopt, recompute")
    args = ap.parse_args()

    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    from workbench.provenance import git_commit

    commit = args.commit or git_commit()
    stamp = {"device": device_name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "git_commit": commit}
    records: list[dict] = []

    def emit(rec: dict) -> None:
        rec = {**stamp, **rec}
        records.append(rec)
        with open(out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)

    log = lambda m: print(f"[proof] {m}", flush=True)  # noqa: E731
    tiny = args.tiny
    base = base_config(args.device, tiny)
    base.train.compile_kernels = bool(args.compile)
    if args.set:
        base = base.replace(**json.loads(args.set))
    ngpu = 2

    # 0) one set of initial weights for every layout
    init_dir = work / "init"
    init_cfg = base
    init_dir.mkdir(parents=True, exist_ok=True)
    init_cfg.save(init_dir / "config.json")
    script = (
        "import sys; from workbench.config import load_config; from workbench.rank.train import Trainer; "
        f"t=Trainer(load_config('{init_dir}/config.json'), '{init_dir}'); t.setup(); t.save(); "
        "from workbench.backend import distributed; distributed.destroy()"
    )
    rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()), "--no-python", sys.executable, "-c", script],
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}).returncode
    if rc != 0:
        print("failed to create the initial checkpoint", file=sys.stderr)
        return 1
    init_ckpt = str(init_dir / "checkpoints")

    def cfg_for(**over) -> RunConfig:
        return base.replace(**{"checkpoint.load_dir": init_ckpt, "checkpoint.finetune": True, **over})

    # 1) reference and layouts
    ref_events = run(cfg_for(), work / "ref_1gpu", 1, log)
    ref = losses(ref_events)
    ref_steps = steps(ref_events)
    emit({"test": "reference_1gpu", "steps": len(ref), "first_loss": ref.get(1), "last_loss": ref.get(max(ref)),
          "median_step_time_s": statistics.median([e["step_time"] for e in ref_steps[5:]] or [0.0]),
          "tflops_per_gpu": statistics.median([e["tflops_per_gpu"] for e in ref_steps[5:]] or [0.0]),
          "mfu": statistics.median([e["mfu"] or 0.0 for e in ref_steps[5:]] or [0.0]),
          "compile_kernels": base.train.compile_kernels, "pass": ref.get(max(ref), 99) < ref.get(1, 0),
          "kernel_path": next((e["kernel_path"] for e in ref_events if e["event"] == "run_start"), None)})
    layouts = {
        "tp2": {"parallel.tensor_parallel": 2},
        "pp2_even": {"parallel.pipeline_parallel": 2, "parallel.pipeline_split": "even"},
        "pp2": {"parallel.pipeline_parallel": 2},  # balanced split: 5 + 3 layers
        "pp2_vpp2": {"parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2},
        "dp2_distopt": {"parallel.distributed_optimizer": True},
        "tp2_sp": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True},
    }
    only = set(args.only.split(",")) if args.only else None
    if only:
        layouts = {k: v for k, v in layouts.items() if k in only}
    for name, over in layouts.items():
        ev = run(cfg_for(**over), work / name, ngpu, log)
        l = losses(ev)
        rel, at = max_rel(l, ref)
        mb = [e for e in ev if e["event"] == "microbatch"]
        emit({"test": "layout_vs_1gpu", "layout": name, "steps": len(l), "max_rel_loss_diff": rel, "at_step": at,
              "target": 0.02, "pass": rel <= 0.02 and len(l) == len(ref), "first_loss": l.get(1), "last_loss": l.get(max(l)),
              "ref_last_loss": ref.get(max(ref)), "microbatch_events": len(mb), "precision": base.train.precision,
              "kernel_path": next((e["kernel_path"] for e in ev if e["event"] == "run_start"), None)})

    # 2) resume: 20 straight vs 10 + 10, on one GPU and at DP=2 with the distributed optimizer
    n = 4 if tiny else 10
    rs = {"train.lr_decay_iters": 2 * n, "train.lr_warmup_iters": 2 if tiny else 5}
    for name, nproc, over in (("resume", 1, {}), ("resume_dp2_distopt", ngpu, {"parallel.distributed_optimizer": True})):
        if only and name not in only:
            continue
        straight_ev = run(cfg_for(**rs, **over, **{"train.train_iters": 2 * n}), work / f"{name}_straight", nproc, log)
        first = work / f"{name}_first"
        run(cfg_for(**rs, **over, **{"train.train_iters": n, "checkpoint.save_on_exit": True}), first, nproc, log)
        second_ev = run(base.replace(**rs, **over, **{"train.train_iters": 2 * n, "checkpoint.load_dir": str(first / "checkpoints")}),
                        work / f"{name}_second", nproc, log)
        straight, second = losses(straight_ev), losses(second_ev)
        per_step = {i: second[i] - straight[i] for i in range(n + 1, 2 * n + 1) if i in second and i in straight}
        diffs = [abs(d) for d in per_step.values()]
        # evaluation during training (train.eval_interval > 0): the resumed run's evaluations after the resume
        ev_straight, ev_second = losses(straight_ev, "eval"), losses(second_ev, "eval")
        eval_diffs = [abs(ev_second[i] - ev_straight[i]) for i in sorted(ev_second) if i > n and i in ev_straight]
        evals_ok = not base.train.eval_interval or (bool(eval_diffs) and max(eval_diffs) <= 1e-3)
        emit({"test": name, "straight_iters": 2 * n, "resumed_at": n, "compared_steps": len(diffs),
              "max_abs_loss_diff": max(diffs) if diffs else None, "target": 1e-3,
              "loss_diff_per_step": per_step,
              "eval_interval": base.train.eval_interval, "compared_evals": len(eval_diffs),
              "max_abs_eval_loss_diff": max(eval_diffs) if eval_diffs else None,
              "overrides": json.loads(args.set) if args.set else {},
              "kernel_path": next((e["kernel_path"] for e in second_ev if e["event"] == "run_start"), None),
              "pass": bool(diffs) and len(diffs) == n and max(diffs) <= 1e-3 and evals_ok})

    # 3) recompute: none (the reference run) vs selective vs full
    def perf(ev: list[dict]) -> dict:
        st = steps(ev)
        times = [e["step_time"] for e in st[5:]] or [e["step_time"] for e in st]
        peaks = [e["mem_peak"] for e in st if e.get("mem_peak") is not None]
        return {"median_step_time_s": statistics.median(times), "mem_peak_bytes": max(peaks) if peaks else None}

    none_perf = perf(ref_events)
    for mode in ("selective", "full") if not only or "recompute" in only else ():
        ev = run(cfg_for(**{"parallel.recompute": mode}), work / f"recompute_{mode}", 1, log)
        l = losses(ev)
        rel, at = max_rel(l, ref)
        p = perf(ev)
        emit({"test": "recompute", "mode": mode, "max_rel_loss_diff_vs_none": rel, "at_step": at, "pass": rel <= 0.02,
              "mem_peak_bytes": p["mem_peak_bytes"], "none_mem_peak_bytes": none_perf["mem_peak_bytes"],
              "mem_change": (p["mem_peak_bytes"] / none_perf["mem_peak_bytes"] - 1) if p["mem_peak_bytes"] and none_perf["mem_peak_bytes"] else None,
              "median_step_time_s": p["median_step_time_s"], "none_median_step_time_s": none_perf["median_step_time_s"],
              "speed_vs_none": none_perf["median_step_time_s"] / p["median_step_time_s"],
              "kernel_path": next((e["kernel_path"] for e in ev if e["event"] == "run_start"), None)})

    if only:
        return 0 if all(r.get("pass") for r in records) else 3
    # 4) the PP runs' events for the schedule overlay
    tar_path = Path(args.runs_tar) if args.runs_tar else out.with_name("backend_runs.tar.gz")
    with tarfile.open(tar_path, "w:gz") as tar:
        for name in ("pp2", "pp2_vpp2"):
            tar.add(work / name / "events", arcname=f"runs/{name}/events")
            tar.add(work / name / "config.json", arcname=f"runs/{name}/config.json")
    log(f"wrote {out} and {tar_path}")
    return 0 if all(r.get("pass") for r in records) else 3


if __name__ == "__main__":
    sys.exit(main())
