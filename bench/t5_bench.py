"""T5 benchmark rows (issue #21): one-GPU training throughput against a compiled HF T5ForConditionalGeneration,
planner prediction against the measured peak, and generation speed against HF ``generate``.

Rows (``--rows``, comma list):

- ``throughput``: t5-base shape (v1.0: ReLU, tied head; encoder 512 / decoder 114 tokens, micro-batch 16,
  4 micro-batches, bf16, dropout 0 in both) trained by the workbench's Trainer (real mcore T5Model, DDP,
  Megatron optimizer) and by the compiled HF reference (``bench/reference_t5.py``) on the same synthetic
  span-corruption batches, same GPU, same run: tokens/s (encoder tokens), ratio (target >= 1.0x), MFU.
- ``planner``: t5-base and t5-v1_1-base: the planner's peak allocated against ``torch.cuda.max_memory_allocated``
  of the workbench's steps (target within 10%).
- ``generate``: t5-base shape (random weights, bf16): the workbench engine (encoder once, KV-cached decoder,
  CUDA-graph decode step) against HF ``generate`` on the same weights, 128 encoder tokens, 128 new tokens
  (greedy, no early stop), batch 1 and 32: new tokens/s and ratio (target >= 3x at batch 1), tokens equal.

Each row runs in its own torchrun process; results are appended as JSON lines (device, date, commit) to
``--out`` (default ``bench/results/t5_bench.jsonl``).  ``--cpu-smoke`` runs t5-tiny shapes on CPU (a smoke of
the script; ratios there mean nothing).
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
        return preset("t5-tiny", **{**base, **over})
    base = {"data.source": "synthetic", "train.micro_batch_size": 16, "train.global_batch_size": 64, "train.precision": "bf16",
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


def _train_worker(kind: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workbench.config import derive
    from workbench.models.t5.data import SyntheticT5Dataset

    cfg = _cfg(preset_name, a.cpu_smoke)
    cuda = not a.cpu_smoke
    d = derive(cfg)
    out: dict[str, Any] = {"preset": preset_name, "kind": kind, "tokens_per_step": d.tokens_per_step, "flops_per_step": d.flops_per_step}
    if kind == "reference":
        from bench.reference_t5 import ReferenceT5

        dev = "cuda" if cuda else "cpu"
        ref = ReferenceT5(cfg, device=dev, compile=cuda)
        ds = SyntheticT5Dataset(cfg)
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

        tr = Trainer(cfg, tempfile.mkdtemp(prefix="wb-t5-bench-"))
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


def _generate_worker(preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    """The workbench engine and HF generate on the same weights (random init), greedy, fixed lengths."""
    import torch

    from bench.reference_t5 import build_hf_t5
    from workbench.backend import distributed
    from workbench.backend.model import build_model
    from workbench.config import GenerationConfig
    from workbench.models.t5.generate import T5Engine
    from workbench.models.t5.hf import mcore_to_hf

    cuda = not a.cpu_smoke
    cfg = _cfg(preset_name, a.cpu_smoke, **{"model.make_vocab_size_divisible_by": 128 if cuda else 64})
    distributed.initialize(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    full = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and hasattr(v, "shape")}
    hf = build_hf_t5(cfg, "cuda" if cuda else "cpu").eval()
    missing, unexpected = hf.load_state_dict(mcore_to_hf(full, cfg, "t5"), strict=False)
    assert not unexpected and all("embed_tokens" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = hf.to(dtype)
    eng = T5Engine(model, vocab_size=cfg.model.vocab_size, eos_id=None, pad_id=0)
    P, new = (128, 128) if cuda else (16, 8)
    out: dict[str, Any] = {"preset": preset_name, "prompt_tokens": P, "new_tokens": new,
                           "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": []}
    for batch in (1, 32) if cuda else (1, 4):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(2, cfg.model.vocab_size, (batch, P), generator=g)
        gen = GenerationConfig(greedy=True, max_new_tokens=new)
        for _ in range(2):
            ours = eng.generate(prompts.tolist(), gen, decode_text=False)
        t_ours = _median([(_sync(cuda), eng.generate(prompts.tolist(), gen, decode_text=False), _sync(cuda),
                           eng.last_timing["seconds"])[-1] for _ in range(3)])
        dev_prompts = prompts.to(hf.device)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=0, decoder_start_token_id=0)
        with torch.inference_mode():
            for _ in range(2):
                ref = hf.generate(input_ids=dev_prompts, **kw)

            def run_hf():
                _sync(cuda)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    hf.generate(input_ids=dev_prompts, **kw)
                _sync(cuda)
                return time.perf_counter() - t0

            t_hf = _median([run_hf() for _ in range(3)])
        same = [o.token_ids for o in ours] == ref[:, 1:].tolist()
        out["rows"].append({"batch": batch, "workbench_tokens_per_s": batch * new / t_ours, "hf_tokens_per_s": batch * new / t_hf,
                            "ratio": t_hf / t_ours, "tokens_equal": same, "workbench_s": t_ours, "hf_s": t_hf})
    distributed.destroy()
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


def rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    want = [r.strip() for r in a.rows.split(",") if r.strip()]
    base = "t5-tiny" if a.cpu_smoke else "t5-base"
    if "throughput" in want:
        wb, ref = _measure("workbench", base, a), _measure("reference", base, a)
        ratio = wb["tokens_per_s"] / ref["tokens_per_s"] if "tokens_per_s" in wb and "tokens_per_s" in ref else None
        out.append({"row": "throughput", "workbench": wb, "reference": ref, "ratio": ratio, "target": ">= 1.0"})
    if "planner" in want:
        for name in ([base] if a.cpu_smoke else ["t5-base", "t5-v1_1-base"]):
            wb = _measure("workbench", name, a)
            pred, meas = wb.get("planner_peak_allocated"), wb.get("mem_peak")
            out.append({"row": "planner", "preset": name, "predicted": pred, "measured": meas,
                        "rel_error": (pred - meas) / meas if pred and meas else None, "target": "|rel_error| <= 0.10",
                        "error": wb.get("error")})
    if "generate" in want:
        res = _measure("generate", base, a)
        out.append({"row": "generate", **res, "target": ">= 3x at batch 1"})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="throughput,planner,generate", help="comma list: throughput, planner, generate")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--cpu-smoke", action="store_true", help="t5-tiny on CPU, 2 steps (smoke)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "t5_bench.jsonl"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="t5-base", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.steps, a.warmup = min(a.steps, 2), min(a.warmup, 1)
    if a.worker:
        res = _generate_worker(a.preset, a) if a.worker == "generate" else _train_worker(a.worker, a.preset, a)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a.result).write_text(json.dumps(res))
        return 0
    from workbench.provenance import git_commit

    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
             "cpu_smoke": a.cpu_smoke}
    results = rows(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as fh:
        for r in results:
            fh.write(json.dumps({**stamp, **r}) + "\n")
    for r in results:
        brief = {k: v for k, v in r.items() if k not in ("workbench", "reference")}
        if r["row"] == "throughput":
            brief.update(workbench_tokens_per_s=r["workbench"].get("tokens_per_s"), reference_tokens_per_s=r["reference"].get("tokens_per_s"),
                         mfu=r["workbench"].get("mfu"), errors=[x.get("error") for x in (r["workbench"], r["reference"]) if x.get("error")])
        print(json.dumps(brief, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
