"""MoE training throughput: the workbench's ``moe-research`` preset against a compiled plain-PyTorch MoE of the same
shape, and expert parallelism (EP=2 on two GPUs) against one GPU at the same global batch.

One device call on two GPUs (``nvidia-h100-x2``; about 6-8 minutes)::

    python bench/moe_bench.py --out bench/results/moe_bench.jsonl

Rows (JSON lines, each with device, date, git commit):

- ``workbench-1gpu``: ``python -m workbench.backend`` under torchrun on one GPU, bf16, the kernel rule's default path
  (grouped-GEMM experts through torch's ``grouped_mm``, SDPA attention, fused AdamW); tokens/s is the median of the
  step events after ``--warmup`` steps; first / last losses on the embedded corpus; the router's coefficient of
  variation per layer from the last ``router`` record.
- ``workbench-ep2``: the same model and global batch on two GPUs with ``parallel.expert_parallel: 2`` (DP 2 for the
  dense part, the experts split); the ratio to ``workbench-1gpu`` (target >= 1.8x).
- ``torch-compiled``: the same shapes written as a capable user would in plain PyTorch: bf16 weights in an fp32
  master copy under autocast, SDPA attention with RoPE and GQA, top-k softmax routing with a sort-based permutation,
  one ``grouped_mm`` per expert linear, the same load-balancing and z-loss, fused AdamW, the whole model under
  ``torch.compile``; synthetic tokens of the same vocabulary.  The ratio workbench / torch (target >= 1.1x).

``--phases`` picks rows (``workbench-1gpu,workbench-ep2,torch-compiled``); ``--steps`` / ``--warmup`` the timing;
``--smoke`` runs tiny shapes on CPU to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.config import preset  # noqa: E402
from workbench.provenance import git_commit  # noqa: E402
from workbench.run.reader import RunReader  # noqa: E402


def _stamp(device: str) -> dict:
    return {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": os.environ.get("GIT_COMMIT") or git_commit()}


def bench_config(a: argparse.Namespace, ep: int = 1):
    over = {"train.train_iters": a.steps, "train.lr_decay_iters": a.steps, "train.lr_warmup_iters": max(a.steps // 10, 1),
            "train.eval_interval": 0,
            "train.microbatch_timing_interval": 0, "checkpoint.save_on_exit": False, "model.moe.router_stats_interval": 10,
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
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ep), "--master-port", str(29600 + ep),
               "-m", "workbench.backend", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
        t0 = time.time()
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "2"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        reader = RunReader(run_dir)
        steps = sorted((r for r in reader.records("step") if r.loss is not None), key=lambda r: r.iteration)
        seen, rows = set(), []
        for r in steps:
            if r.iteration not in seen:
                seen.add(r.iteration)
                rows.append(r)
        start = reader.run_start()
        out = {"row": name, "preset": "moe-research", "ep": ep, "gpus": ep, "seconds": round(time.time() - t0, 1),
               "returncode": proc.returncode, **_stamp(start.device if start else "?")}
        if proc.returncode != 0 or len(rows) <= a.warmup:
            return {**out, "status": "failed", "log_tail": (proc.stdout + proc.stderr)[-4000:]}
        timed = rows[a.warmup:]
        router = reader.router()
        return {**out, "status": "ok", "tokens_per_s": statistics.median(r.tokens_per_s for r in timed),
                "step_time_s": statistics.median(r.step_time for r in timed), "mem_peak": max((r.mem_peak or 0) for r in rows),
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
            return loss + moe.aux_loss_coeff * aux / L + moe.z_loss_coeff * z / L, loss

    model = Model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.weight_decay,
                            fused=cuda)
    fwd = torch.compile(model) if cuda else model
    mb, micro = t.micro_batch_size, t.global_batch_size // t.micro_batch_size
    gen = torch.Generator(device="cpu").manual_seed(0)

    def step():
        opt.zero_grad(set_to_none=True)
        last = None
        for _ in range(micro):
            tokens = torch.randint(0, V, (mb, s + 1), generator=gen).to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                total, lm = fwd(tokens[:, :-1], tokens[:, 1:])
            (total / micro).backward()
            last = lm
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        opt.step()
        return last

    times, losses = [], []
    t0 = time.time()
    for i in range(a.steps):
        if cuda:
            torch.cuda.synchronize()
        st = time.perf_counter()
        losses.append(float(step().detach()))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - st)
    tokens = t.global_batch_size * s
    timed = times[a.warmup:] or times
    return {"row": "torch-compiled", "preset": "moe-research", "ep": 1, "gpus": 1, "status": "ok",
            "tokens_per_s": tokens / statistics.median(timed), "step_time_s": statistics.median(timed),
            "mem_peak": int(torch.cuda.max_memory_allocated()) if cuda else None, "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": round(time.time() - t0, 1), "data": "synthetic tokens", **_stamp(torch.cuda.get_device_name() if cuda else "cpu")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_bench.jsonl"))
    ap.add_argument("--phases", default="workbench-1gpu,workbench-ep2,torch-compiled")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per workbench run")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script)")
    a = ap.parse_args()
    phases = [p for p in a.phases.split(",") if p]
    unknown = set(phases) - {"workbench-1gpu", "workbench-ep2", "torch-compiled"}
    if unknown:
        print(f"--phases: unknown {sorted(unknown)} -> workbench-1gpu, workbench-ep2, torch-compiled", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in phases:
        try:
            row = {"workbench-1gpu": lambda: workbench_row(a, 1, p), "workbench-ep2": lambda: workbench_row(a, 2, p),
                   "torch-compiled": lambda: torch_row(a)}[p]()
        except Exception as e:  # one failed row must not lose the others
            row = {"row": p, "status": "failed", "error": repr(e), **_stamp("?")}
        if p == "workbench-ep2" and results.get("workbench-1gpu", {}).get("tokens_per_s") and row.get("tokens_per_s"):
            row["speedup_over_1gpu"] = row["tokens_per_s"] / results["workbench-1gpu"]["tokens_per_s"]
        if p == "torch-compiled" and results.get("workbench-1gpu", {}).get("tokens_per_s") and row.get("tokens_per_s"):
            row["workbench_over_torch"] = results["workbench-1gpu"]["tokens_per_s"] / row["tokens_per_s"]
        results[p] = row
        with open(out, "a") as fh:
            fh.write(json.dumps({**row, "smoke": a.smoke}) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "kernels")}), flush=True)
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
