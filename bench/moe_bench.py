"""MoE training throughput: the workbench's ``moe-research`` preset against a compiled plain-PyTorch MoE of the same
shape, and expert parallelism (EP=2 on two GPUs) against one GPU at the same global batch.

On two GPUs (about 8-10 minutes with the protocol's defaults)::

    python bench/moe_bench.py --out bench/results/moe_bench.jsonl

Measured under the protocol of ``bench/harness.py``: each row is run ``--repeats`` times in fresh processes, the rows
interleaved; in each process the warm-up runs until the step times settle (the product's runs record every step, and
:func:`harness.split_recorded` applies the same rule to them), then ``--steps`` steps are timed.  Each row stores its
repeats, their median and spread; each ratio its range (worst and best pairing) and whether the worst pairing
clears the target.  Rows (JSON lines, each with device, date, git commit):

- ``workbench-1gpu``: ``python -m workbench.rank`` under torchrun on one GPU, bf16, the kernel rule's default path
  (grouped-GEMM experts through torch's ``grouped_mm``, SDPA attention, fused AdamW); tokens/s is the median of the
  step events after ``--warmup`` steps; first / last losses on the embedded corpus; the router's coefficient of
  variation per layer from the last ``router`` record.  The run trains ``--warmup-max`` + ``--steps`` iterations.
- ``workbench-ep2``: the same model and global batch on two GPUs with ``parallel.expert_parallel: 2`` (DP 2 for the
  dense part, the experts split); the ratio to ``workbench-1gpu`` (target >= 1.8x).
- ``workbench-1gpu-omp2``: ``workbench-1gpu`` with ``OMP_NUM_THREADS=2`` in the rank's environment (as the rows
  before it ran), for an A/B of the host's thread setting (not a product row).
- ``torch-compiled``: the same shapes written as a capable user would in plain PyTorch: bf16 weights in an fp32
  master copy under autocast, SDPA attention with RoPE and GQA, top-k softmax routing with a sort-based permutation,
  one ``grouped_mm`` per expert linear, the same load-balancing and z-loss (each layer's, summed as megatron
  attaches them; the row records its routers' balance after the timed steps), fused AdamW, the whole model under
  ``torch.compile``; the same micro-batches of the preset's data, in the same order (its loss mask aside: every
  token counts; they wait on the GPU, where the workbench's loader copies each in), the same learning-rate schedule
  (:func:`scheduled_lr`).  Each side times its own steps after its own warm-up, so the timed steps' indices (and the
  routers' balance by then) can differ.  The ratio workbench / torch (target >= 1.1x).

``--phases`` picks rows (default ``workbench-1gpu,workbench-ep2,torch-compiled``);
``--steps`` / ``--repeats`` / ``--warmup`` /
``--warmup-max`` the protocol; ``--smoke`` runs tiny shapes on CPU, the protocol at its smallest, to check the script.

``--profile`` measures where the time goes instead (one process a side, not a ratio): ``workbench-profile`` trains
the one-GPU model with the backend's ``Trainer`` in a one-process torchrun, ``torch-compiled`` the plain model; after
the protocol's warm-up and timed steps each runs the torch profiler (device time by kernel and category) and cProfile
(the host's Python time) over a few steps.  Rows go to ``--out`` with ``"measured": "profile"``::

    python bench/moe_bench.py --profile --repeats 1 --out bench/results/moe_profile.jsonl
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402
from workbench.config import preset  # noqa: E402
from workbench.provenance import git_commit  # noqa: E402
from workbench.run.files import free_port  # noqa: E402
from workbench.run.reader import RunReader  # noqa: E402


def _stamp(device: str) -> dict:
    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": os.environ.get("GIT_COMMIT") or git_commit()}


def bench_config(a: argparse.Namespace, ep: int = 1):
    iters = a.proto.warmup_max + a.proto.steps  # enough for the longest warm-up and the timed steps
    over = {"train.train_iters": iters, "train.lr_decay_iters": iters, "train.lr_warmup_iters": max(iters // 10, 1),
            "train.eval_interval": 0,
            "train.microbatch_timing_interval": 0, "checkpoint.save_on_exit": False, "model.moe.router_stats_interval": min(10, iters),
            "parallel.expert_parallel": ep, "parallel.nproc_per_node": ep}
    if a.smoke:
        over.update({"parallel.device": "cpu", "train.precision": "fp32", "model.num_layers": 2, "model.hidden_size": 64,
                     "model.num_attention_heads": 4, "model.num_query_groups": 2, "model.moe.num_experts": 8,
                     "model.moe.top_k": 2, "model.moe.ffn_hidden_size": 64, "model.seq_length": 64,
                     "train.micro_batch_size": 2, "train.global_batch_size": 8, "train.compile_kernels": False})
    return preset("moe-research", **over).check()


def workbench_row(a: argparse.Namespace, ep: int, name: str) -> dict:
    cfg = bench_config(a, ep)
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as td:
        run_dir = Path(td) / name
        run_dir.mkdir()
        cfg.save(run_dir / "config.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ep), "--master-port", str(free_port()),
               "-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
        t0 = time.time()
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", **RANK_ENV.get(name, {})}
        strangers = harness.check_gpus(name)
        proc = harness.run_group(cmd, a.timeout, cwd=ROOT, env=env)  # a timeout ends the ranks too
        reader = RunReader(run_dir)
        steps = sorted((r for r in reader.records("step") if r.loss is not None), key=lambda r: r.iteration)
        seen, rows = set(), []
        for r in steps:
            if r.iteration not in seen:
                seen.add(r.iteration)
                rows.append(r)
        start = reader.run_start()
        out = {"row": name, "preset": "moe-research", "ep": ep, "gpus": ep, "seconds": round(time.time() - t0, 1),
               "returncode": proc.returncode, "gpu_strangers": strangers, **_stamp(start.device if start else "?")}
        if proc.returncode != 0:
            return {**out, "status": "failed", "log_tail": (proc.stdout + proc.stderr)[-4000:]}
        try:
            meas = harness.split_recorded([r.step_time for r in rows], a.proto)
        except ValueError as e:
            return {**out, "status": "failed", "error": str(e)}
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        router = reader.router()
        return {**out, "status": "ok", "tokens_per_s": tokens / meas["step_s"], "step_time_s": meas["step_s"],
                "warmup_steps": meas["warmup_steps"], "steady": meas["steady"], "step_times": meas["step_times"],
                "every_step_s": [round(r.step_time, 4) for r in rows],  # warm-up included: where a repeat slows
                "mem_peak": max((r.mem_peak or 0) for r in rows),
                "loss_first": rows[0].loss, "loss_last": rows[-1].loss, "kernels": start.kernels if start else None,
                "router_cv_per_layer": router[-1].coefficient_of_variation() if router else None,
                "router_iteration": router[-1].iteration if router else None,
                "global_batch": cfg.train.global_batch_size, "seq_length": cfg.model.seq_length,
                "params_total": cfg.derived().params.total}


# --------------------------------------------------------------------------- the plain-PyTorch reference


def torch_row(a: argparse.Namespace) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    cfg = bench_config(a)
    m, t, moe = cfg.model, cfg.train, cfg.model.moe
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    h, nh, g, d, L = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.num_layers
    E, k, f, V, s = moe.num_experts, moe.top_k, moe.ffn_hidden_size, m.vocab_size, m.seq_length
    grouped = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    gemm_dtype = torch.bfloat16 if cuda else torch.float32  # torch's grouped GEMM kernels on CUDA are bf16

    def rope(x, cos, sin):  # x [b, heads, s, d], rotate-half
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.RMSNorm(h, eps=m.norm_epsilon), nn.RMSNorm(h, eps=m.norm_epsilon)
            self.qkv = nn.Linear(h, (nh + 2 * g) * d, bias=False)
            self.proj = nn.Linear(nh * d, h, bias=False)
            self.router = nn.Linear(h, E, bias=False)
            self.w1 = nn.Parameter(torch.randn(E, 2 * f, h) * 0.02)
            self.w2 = nn.Parameter(torch.randn(E, h, f) * 0.02)

        def forward(self, x, cos, sin):
            b = x.shape[0]
            q, kk, v = self.qkv(self.n1(x)).split([nh * d, g * d, g * d], dim=-1)
            q = rope(q.reshape(b, s, nh, d).transpose(1, 2), cos, sin)
            kk = rope(kk.reshape(b, s, g, d).transpose(1, 2), cos, sin)
            v = v.reshape(b, s, g, d).transpose(1, 2)
            att = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
            x = x + self.proj(att.transpose(1, 2).reshape(b, s, nh * d))
            y = self.n2(x).reshape(-1, h)
            logits = self.router(y).float()
            top, idx = torch.topk(logits, k, dim=-1)
            probs = torch.softmax(top, dim=-1)
            scores = torch.softmax(logits, dim=-1)
            counts = torch.bincount(idx.flatten(), minlength=E)
            aux = E * (scores.mean(0) * counts / (y.shape[0] * k)).sum()
            z = torch.logsumexp(logits, dim=-1).square().mean()
            order = idx.flatten().argsort(stable=True)
            tok = order // k
            xs = y[tok].to(gemm_dtype)  # autocast leaves grouped_mm alone, and the norm's output is fp32 under it
            offs = torch.cumsum(counts, 0).to(torch.int32)
            hmid = grouped(xs, self.w1.to(xs.dtype).transpose(-2, -1), offs=offs)
            gate, up = hmid.chunk(2, dim=-1)
            hmid = F.silu(gate) * up * probs.flatten()[order].unsqueeze(-1).to(hmid.dtype)
            out = grouped(hmid, self.w2.to(hmid.dtype).transpose(-2, -1), offs=offs)
            y2 = torch.zeros_like(y).index_add_(0, tok, out.to(y.dtype))
            return x + y2.view_as(x), aux, z

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, h)
            self.layers = nn.ModuleList(Layer() for _ in range(L))
            self.norm = nn.RMSNorm(h, eps=m.norm_epsilon)
            self.head = nn.Linear(h, V, bias=False)
            inv = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2).float() / d))
            ang = torch.outer(torch.arange(s).float(), inv)
            ang = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos", ang.cos()[None, None], persistent=False)
            self.register_buffer("sin", ang.sin()[None, None], persistent=False)

        def forward(self, tokens, labels):
            x = self.emb(tokens)
            aux = z = 0.0
            for layer in self.layers:
                x, a_, z_ = layer(x, self.cos.to(x.dtype), self.sin.to(x.dtype))
                aux, z = aux + a_, z + z_
            loss = F.cross_entropy(self.head(self.norm(x)).float().reshape(-1, V), labels.reshape(-1))
            # each layer's losses times their coefficients, summed over the layers: megatron attaches every layer's
            # (rows 1-26 averaged them, a 16th of the routers' regularising gradient)
            return loss + moe.aux_loss_coeff * aux + moe.z_loss_coeff * z, loss

    model = Model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay,
                            fused=cuda)
    fwd = torch.compile(model) if cuda else model
    micro = t.global_batch_size // t.micro_batch_size
    batches = preset_batches(cfg, micro * (a.proto.warmup_max + a.proto.steps + 10), dev)
    at = iter(range(10**9))
    done = iter(range(10**9))  # optimizer steps taken: the learning rate's schedule, as the workbench's run has it

    def step():
        for group in opt.param_groups:
            group["lr"] = scheduled_lr(t, next(done))
        opt.zero_grad(set_to_none=True)
        last = None
        for _ in range(micro):
            tokens, labels = batches[next(at) % len(batches)]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                total, lm = fwd(tokens, labels)
            (total / micro).backward()
            last = lm
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        return last

    losses: list[float] = []
    t0 = time.time()
    meas = harness.measure_steps(lambda: losses.append(float(step().detach())), cuda, a.proto)
    cv = router_balance(model, batches[next(at) % len(batches)], k, E, dev, cuda)
    tokens = t.global_batch_size * s
    return {**_profiles(step, cuda, a), "row": "torch-compiled", "preset": "moe-research", "ep": 1, "gpus": 1, "status": "ok",
            "tokens_per_s": tokens / meas["step_s"], "step_time_s": meas["step_s"], "warmup_steps": meas["warmup_steps"],
            "steady": meas["steady"], "step_times": meas["step_times"],
            "every_step_s": [round(x, 4) for x in meas["warmup_times"] + meas["step_times"]],
            "mem_peak": int(torch.cuda.max_memory_allocated()) if cuda else None, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.time() - t0, 1), "data": "the preset's (the workbench's micro-batches, in its order)",
            "first_tokens_sha256": tokens_digest(batches[0][0]), "router_cv_per_layer": cv,
            **_stamp(torch.cuda.get_device_name() if cuda else "cpu")}


def router_balance(model, batch, k: int, experts: int, dev, cuda: bool) -> list[float]:
    """The plain model's routers after its timed steps, as the workbench's ``router`` records state them: per layer the
    coefficient of variation of the experts' token counts over one micro-batch (an eager forward, no grad)."""
    import torch

    from workbench.run.events import Router

    counts: list = []
    hooks = [layer.router.register_forward_hook(
        lambda _m, _i, out: counts.append(torch.bincount(out.float().topk(k, dim=-1).indices.flatten(),
                                                         minlength=experts).tolist()))
        for layer in model.layers]
    try:
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            model(*batch)
    finally:
        for h in hooks:
            h.remove()
    return Router(tokens_per_expert=counts).coefficient_of_variation()


def tokens_digest(tokens) -> str:
    """A micro-batch's token ids, hashed (the row says which data the plain model trained on)."""
    return hashlib.sha256(tokens.detach().cpu().numpy().tobytes()).hexdigest()


def scheduled_lr(t, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under the run's schedule, as megatron's
    ``OptimizerParamScheduler`` gives it to the workbench's run (from 0: linear warm-up over ``lr_warmup_iters``, then
    ``lr_decay_style`` down to ``min_lr`` at ``lr_decay_iters``): the plain model follows the same rates."""
    warm, decay = t.lr_warmup_iters, t.lr_decay_iters or t.train_iters
    if warm > 0 and step <= warm:
        return t.lr * step / warm
    if t.lr_decay_style == "constant":
        return t.lr
    if step > decay:
        return t.min_lr
    frac = (step - warm) / (decay - warm)
    coeff = 1.0 - frac if t.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)  # cosine
    return t.min_lr + coeff * (t.lr - t.min_lr)


def preset_batches(cfg, n: int, dev) -> list:
    """The first ``n`` micro-batches (tokens, labels) the workbench's one-GPU run trains on -- the preset's data through
    the backend's own data module, in its order -- on ``dev``: the plain model learns from the same text, so its
    routers see the same tokens (synthetic tokens keep the experts near-balanced; the corpus does not)."""
    from workbench.rank.data import MicroBatchStream, build_datasets

    with tempfile.TemporaryDirectory(prefix="moe-bench-data-") as td:
        train_ds, _valid, _desc = build_datasets(cfg, td, log=lambda *_: None)
        stream = MicroBatchStream(train_ds, cfg, 0)
        return [(b["tokens"].to(dev), b["labels"].to(dev)) for b in (next(stream) for _ in range(n))]


def _profiles(step, cuda: bool, a: argparse.Namespace) -> dict:
    """--profile: the torch profiler's and cProfile's summaries of a few more steps (after the timed ones)."""
    if not a.profile:
        return {}
    from bench.profiling import host_profile, profile_steps

    return {"profile": profile_steps(step, cuda, True, top=25), "host_profile": host_profile(step, cuda, True)}


def workbench_profile_row(a: argparse.Namespace) -> dict:
    """The one-GPU workbench model trained in this (one-process torchrun) worker by the backend's ``Trainer``: the
    protocol's warm-up and timed steps, then :func:`_profiles`."""
    import torch

    from workbench.rank.train import Trainer

    cfg = bench_config(a)
    cuda = torch.cuda.is_available() and not a.smoke
    tr = Trainer(cfg, tempfile.mkdtemp(prefix="moe-prof-"))
    tr.setup()
    tr.cfg.train.microbatch_timing_interval = 0
    with tr.collector:  # the garbage collection of the Trainer's own loop
        meas = harness.measure_steps(tr.train_step, cuda, a.proto)
        profiles = _profiles(tr.train_step, cuda, a)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    return {**profiles, "row": "workbench-profile", "preset": "moe-research", "ep": 1, "gpus": 1,
            "status": "ok", "tokens_per_s": tokens / meas["step_s"], "step_time_s": meas["step_s"],
            "warmup_steps": meas["warmup_steps"], "steady": meas["steady"], "step_times": meas["step_times"],
            "mem_peak": int(torch.cuda.max_memory_allocated()) if cuda else None, "kernels": tr.kernel_choice,
            "kernel_path": tr.kernel_path, **_stamp(torch.cuda.get_device_name() if cuda else "cpu")}


#: the rows a plain run measures (``--phases``' default) ...
DEFAULT_PHASES = ("workbench-1gpu", "workbench-ep2", "torch-compiled")
#: ... and every row it knows
PHASES = (*DEFAULT_PHASES, "workbench-1gpu-omp2")
#: what a workbench row sets in its ranks' environment beyond the launching shell's.  The product's rows set nothing
#: (``workbench launch`` passes the shell's environment on); ``workbench-1gpu-omp2`` is the one-GPU row as the rows
#: before this variant ran it (``OMP_NUM_THREADS=2``), kept to measure what that setting costs side by side.
RANK_ENV = {"workbench-1gpu-omp2": {"OMP_NUM_THREADS": "2"}}
#: (row over row, target): the ratios each measurement reports
RATIOS = {"workbench-ep2": ("workbench-1gpu", 1.8), "torch-compiled": ("workbench-1gpu", 1.1),
          "workbench-1gpu-omp2": ("workbench-1gpu", None)}


def one_repeat(a: argparse.Namespace, phase: str) -> dict:
    """One fresh process's measurement of ``phase`` (the workbench rows are fresh torchrun launches; the plain-PyTorch
    row runs this script again with ``--worker``)."""
    try:
        if phase != "workbench-profile" and phase != "torch-compiled":
            return workbench_row(a, 2 if phase == "workbench-ep2" else 1, phase)
        strangers = harness.check_gpus(phase)
        if phase == "workbench-profile":
            proc = harness.torchrun(1, [str(Path(__file__).resolve()), "--worker", phase, *a.passthrough], a.timeout)
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", phase, *a.passthrough]
            proc = harness.run_group(cmd, a.timeout, cwd=ROOT)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            return {"row": phase, "status": "failed", "returncode": proc.returncode, "gpu_strangers": strangers,
                    "log_tail": (proc.stdout + proc.stderr)[-4000:], **_stamp("?")}
        return {**json.loads(lines[-1][len("RESULT "):]), "gpu_strangers": strangers}
    except Exception as e:  # one failed repeat must not lose the others
        return {"row": phase, "status": "failed", "error": repr(e), **_stamp("?")}


def merged(phase: str, reps: list[dict]) -> dict:
    """A row from its repeats: the median repeat's details, every repeat's tokens/s with median and spread."""
    ok = [r for r in reps if r.get("status") == "ok"]
    if len(ok) < len(reps):
        bad = next(r for r in reps if r.get("status") != "ok")
        return {**bad, "row": phase, "status": "failed", "repeats_ok": len(ok), "repeats": len(reps)}
    tps = [r["tokens_per_s"] for r in ok]
    row = dict(next(r for r in ok if r["tokens_per_s"] == harness.median(tps)))
    row.pop("step_times", None)
    return {**row, "tokens_per_s": harness.median(tps), "repeats": harness.side(tps),
            "repeat_rows": [{k: r.get(k) for k in ("tokens_per_s", "warmup_steps", "steady", "repeat_wall_s", "gpu_strangers",
                                                   "every_step_s")} for r in ok]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_bench.jsonl"))
    ap.add_argument("--phases", default=",".join(DEFAULT_PHASES))
    harness.add_protocol_args(ap)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, the protocol at its smallest (checks the script)")
    ap.add_argument("--profile", action="store_true",
                    help="profile the one-GPU workbench model and the plain one instead of measuring ratios (see above)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.cpu_smoke = a.smoke
    a.proto = harness.protocol(a)
    a.passthrough = [f"--steps={a.steps}", f"--repeats={a.repeats}", f"--warmup={a.warmup}", f"--warmup-max={a.warmup_max}",
                     *(["--smoke"] if a.smoke else []), *(["--profile"] if a.profile else [])]
    if a.worker:
        row = workbench_profile_row(a) if a.worker == "workbench-profile" else torch_row(a)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(row), flush=True)
        return 0
    phases = ["workbench-profile", "torch-compiled"] if a.profile else [p for p in a.phases.split(",") if p]
    unknown = set(phases) - set(PHASES) - ({"workbench-profile"} if a.profile else set())
    if unknown:
        print(f"--phases: unknown {sorted(unknown)} -> {', '.join(PHASES)}", file=sys.stderr)
        return 2
    runs = harness.interleaved({p: (lambda i, p=p: one_repeat(a, p)) for p in phases}, a.proto.repeats)
    rows = {p: merged(p, runs[p]) for p in phases}
    for p, (base, target) in RATIOS.items():
        if p in rows and base in rows and rows[p].get("status") == rows[base].get("status") == "ok":
            # workbench over torch; EP=2 over one GPU; the shipped environment over OMP_NUM_THREADS=2
            over, under = (p, base) if p == "workbench-ep2" else (base, p)
            key = {"torch-compiled": "workbench_over_torch",
                   "workbench-ep2": "speedup_over_1gpu"}.get(p, "shipped_env_over_omp2")
            rows[p][key] = harness.ratio(rows[over]["repeats"]["repeats"], rows[under]["repeats"]["repeats"], target)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as fh:
        for p in phases:
            measured = ("cpu smoke: the protocol's code at its smallest, not a measurement" if a.smoke
                        else "profile" if a.profile else "protocol")
            fh.write(json.dumps({**rows[p], "smoke": a.smoke, "measured": measured, "protocol": a.proto.record()}) + "\n")
    for p in phases:
        r = rows[p]
        brief = {k: r.get(k) for k in ("row", "status", "tokens_per_s", "speedup_over_1gpu", "workbench_over_torch",
                                       "shipped_env_over_omp2", "error")}
        print(json.dumps({k: v for k, v in brief.items() if v is not None}), flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
