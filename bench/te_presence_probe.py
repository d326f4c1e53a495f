"""What importing Transformer Engine changes in a torch process (the default path is ~6% slower
with TE importable, though it runs none of TE's modules).

    python3 bench/te_presence_probe.py --out $OUT/te_presence.jsonl

One fresh interpreter per side (``plain``: torch and megatron-core with TE hidden; ``te``: the same with TE
importable, imported the way megatron-core imports it).  Each side reports the process state a kernel choice can
depend on (torch's backend flags, inductor / dynamo config, environment, the shared libraries loaded) and times
the GEMMs, the attention and the optimizer of a GPT-2-medium layer step in isolation (median of CUDA-event
timings).  The parent prints what differs and the ratios, and appends one JSON line per side and one summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _state(cudnn: bool = True) -> dict:
    """``cudnn``: ask torch for its cuDNN version (loads torch's cuDNN: before TE's import, TE's then fails)."""
    import torch

    state = {
        "matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "matmul.bf16_reduced": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "matmul.fp16_reduced": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "sdp": {n: getattr(torch.backends.cuda, f"{n}_sdp_enabled")() for n in ("flash", "mem_efficient", "math", "cudnn")},
        "cudnn.enabled": torch.backends.cudnn.enabled,
        "blas_library": str(getattr(torch.backends.cuda, "preferred_blas_library", lambda: "?")()),
    }
    if cudnn:
        try:
            state["cudnn.version"] = torch.backends.cudnn.version()
        except RuntimeError as e:
            state["cudnn.version"] = f"refused: {str(e)[:200]}"
    import torch._dynamo.config as dc
    import torch._inductor.config as ic

    state["inductor"] = {k: repr(v)[:120] for k, v in ic.get_config_copy().items()}
    state["dynamo"] = {k: repr(v)[:120] for k, v in dc.get_config_copy().items()}
    state["env"] = {k: v[:200] for k, v in os.environ.items()}
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if ".so" in p:
                libs.add(p)
    state["libs"] = sorted(libs)
    return state


def _time(fn, n: int = 30) -> float:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def _timings() -> dict:
    """GPT-2 medium's per-micro-batch GEMMs (tokens 8x1024, hidden 1024), flash attention fwd+bwd, AdamW."""
    import torch

    dev, dt = "cuda", torch.bfloat16
    t, h = 8192, 1024
    out = {}
    for name, (m, k, n) in {"qkv": (t, h, 3 * h), "proj": (t, h, h), "fc1": (t, h, 4 * h), "fc2": (t, 4 * h, h),
                            "wgrad_fc1": (4 * h, t, h), "lm_head": (t, h, 50304)}.items():
        a = torch.randn(m, k, device=dev, dtype=dt)
        b = torch.randn(k, n, device=dev, dtype=dt)
        out[f"gemm_{name}_ms"] = _time(lambda: a @ b)
    q = torch.randn(8, 16, 1024, 64, device=dev, dtype=dt, requires_grad=True)
    k_, v = torch.randn_like(q, requires_grad=True), torch.randn_like(q, requires_grad=True)
    g = torch.randn_like(q)

    def attn():
        o = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
        o.backward(g)

    out["sdpa_fwd_bwd_ms"] = _time(attn)
    out["sdpa_default_choice"] = int(torch._fused_sdp_choice(q, k_, v, is_causal=True))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                out[f"sdpa_{name}_fwd_bwd_ms"] = _time(attn)
        except RuntimeError as e:
            out[f"sdpa_{name}_fwd_bwd_ms"] = f"unavailable: {str(e)[:120]}"
    x = torch.randn(t, h, device=dev, dtype=dt)
    w = torch.ones(h, device=dev, dtype=dt)
    out["layer_norm_ms"] = _time(lambda: torch.nn.functional.layer_norm(x, (h,), w, w))
    params = [torch.nn.Parameter(torch.randn(1024, 1024, device=dev)) for _ in range(300)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    out["adamw_fused_300M_ms"] = _time(opt.step, n=10)
    return out


def side(mode: str) -> dict:
    if mode == "plain":
        sys.modules["transformer_engine"] = None  # type: ignore[assignment]  # hidden, as an absent TE
    import torch

    torch.cuda.init()
    before = _state(cudnn=False) if mode == "te" else None
    import megatron.core  # noqa: F401  (imports TE where it finds it)
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401  (the checkpoint path imports TE's Float8Tensor)
    import megatron.core.optimizer  # noqa: F401

    res = {"mode": mode, "te_in_modules": "transformer_engine.pytorch" in sys.modules and
           sys.modules.get("transformer_engine") is not None, "state": _state(), "timings": _timings()}
    if before is not None:  # what the imports themselves changed in this process
        res["changed_by_import"] = _diff(before, res["state"])
    return res


def _diff(a: dict, b: dict) -> dict:
    out = {}
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            d = {kk: [x.get(kk), y.get(kk)] for kk in sorted(set(x) | set(y)) if x.get(kk) != y.get(kk)}
            if d:
                out[k] = d
        elif k == "libs":
            out["libs_only_first"] = sorted(set(x or []) - set(y or []))
            out["libs_only_second"] = sorted(set(y or []) - set(x or []))
        elif x != y:
            out[k] = [x, y]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=["plain", "te"])
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.side:
        print("RESULT " + json.dumps(side(a.side)), flush=True)
        return 0
    from workbench.provenance import stamp

    res = {}
    for mode in ("plain", "te"):
        p = subprocess.run([sys.executable, __file__, "--side", mode], capture_output=True, text=True, timeout=600)
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            print(p.stdout[-2000:], p.stderr[-4000:])
            return 1
        res[mode] = json.loads(lines[-1][7:])
    diff = _diff(res["plain"]["state"], res["te"]["state"])
    ratios = {k: round(res["te"]["timings"][k] / res["plain"]["timings"][k], 4) for k in res["plain"]["timings"]
              if isinstance(res["plain"]["timings"][k], float) and isinstance(res["te"]["timings"].get(k), float)}
    summary = {"probe": "te presence", "te_in_modules": res["te"]["te_in_modules"],
               "timings_plain": res["plain"]["timings"], "timings_te": res["te"]["timings"],
               "te_over_plain": ratios, "state_diff": diff, "changed_by_import": res["te"].get("changed_by_import")}
    row = {**stamp(), **summary}
    print(json.dumps(row, indent=1)[:20000])
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
