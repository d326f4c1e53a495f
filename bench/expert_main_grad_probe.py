"""The grouped experts' main_grad accumulation on CUDA, moe-research's shapes (64 experts, fc1 1024x1024, fc2 1024x512,
bf16 gradients, fp32 main_grad laid out as megatron DDP lays them: reverse registration order, fc1/fc2 interleaved):
kernels launched and time per stack backward for the old path (one mixed-dtype foreach: per-tensor) against
:class:`workbench.backend.moe_experts._MainGradSink` (strided, and its foreach fallback), and whether each sums
exactly what the old path sums (two micro-batches).  Prints one JSON line."""

from __future__ import annotations

import ast
import json
import pathlib

import torch

try:
    from workbench.backend.moe_experts import _MainGradSink
except ImportError:  # no megatron here: the two definitions alone
    src = (pathlib.Path(__file__).resolve().parents[1] / "workbench/backend/moe_experts.py").read_text()
    keep = [n for n in ast.parse(src).body if getattr(n, "name", "") in ("_strided_view", "_MainGradSink")]
    ns = {"torch": torch}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "moe_experts", "exec"), ns)
    _MainGradSink = ns["_MainGradSink"]

from types import SimpleNamespace


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a small check of the sums only)


def layout(E=64, hidden=1024, ffn=512):
    fc1, fc2 = (2 * ffn, hidden), (hidden, ffn)
    n1, n2 = fc1[0] * fc1[1], fc2[0] * fc2[1]
    buf = torch.zeros(E * (n1 + n2), device=DEV)
    w1, w2 = [None] * E, [None] * E
    at = 0
    for e in reversed(range(E)):  # reverse registration order: e.fc2 first, then e.fc1
        w2[e] = SimpleNamespace(main_grad=buf[at:at + n2].view(fc2)); at += n2
        w1[e] = SimpleNamespace(main_grad=buf[at:at + n1].view(fc1)); at += n1
    return buf, tuple(w1), tuple(w2)


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    if DEV != "cuda":
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def timed(fn, n=20):
    if DEV != "cuda":
        return float("nan"), float("nan")
    fn(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    import time
    t0 = time.perf_counter(); start.record()
    for _ in range(n):
        fn()
    end.record(); host = (time.perf_counter() - t0) / n; torch.cuda.synchronize()
    return start.elapsed_time(end) / n, host * 1e3


SHAPES = {} if DEV == "cuda" else {"E": 8, "hidden": 32, "ffn": 16}
g = torch.Generator(device=DEV).manual_seed(0)
_, w1, w2 = layout(**SHAPES)
grads = [(torch.randn((len(w1), *w1[0].main_grad.shape), device=DEV, generator=g).bfloat16(),
          torch.randn((len(w2), *w2[0].main_grad.shape), device=DEV, generator=g).bfloat16()) for _ in range(2)]
old = lambda ws, grad: torch._foreach_add_([w.main_grad for w in ws], list(grad.unbind(0)))
out = {}
for name in ("per-tensor (old)", "strided", "foreach"):
    buf, a, b = layout(**SHAPES)
    if name == "per-tensor (old)":
        add1, add2 = (lambda gr: old(a, gr)), (lambda gr: old(b, gr))
    else:
        s1, s2 = _MainGradSink(a), _MainGradSink(b)
        if name == "foreach":
            s1.view = s2.view = None
        assert s1.path == s2.path == name or name == "foreach", (s1.path, s2.path)
        add1, add2 = s1.add, s2.add
    for gr1, gr2 in grads:  # two micro-batches
        add1(gr1); add2(gr2)
    if DEV == "cuda":
        torch.cuda.synchronize()
    if name == "per-tensor (old)":
        want = buf.clone()
    row = {"equal_to_old": bool(torch.equal(buf, want)),
           "kernels_per_layer_microbatch": kernels(lambda: (add1(grads[0][0]), add2(grads[0][1]))),
           "device_ms_per_layer_microbatch": None, "host_ms_per_layer_microbatch": None}
    d, h = timed(lambda: (add1(grads[0][0]), add2(grads[0][1])))
    row["device_ms_per_layer_microbatch"], row["host_ms_per_layer_microbatch"] = round(d, 4), round(h, 4)
    out[name] = row
print(json.dumps({"probe": "expert_main_grad", "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
                  "paths": out}))
