"""Weight gradients into the fp32 ``main_grad`` at Llama-3.2-1B's shapes (one micro-batch of 4 x 2048 tokens, bf16),
both ways on CUDA: today's (the weight-gradient GEMM writes a bf16 ``.grad``, then
:func:`workbench.backend.grad_accumulation.accumulate` copies it into ``main_grad`` on a step's first micro-batch and
adds it on the others) and :func:`~workbench.backend.grad_accumulation.wgrad_into` (the GEMM adds its fp32 sum into
``main_grad`` itself).  CUDA events over 20 calls after 5, per weight shape, and the totals of one Llama-3.2-1B step
(16 layers x 4 weights, 4 micro-batches, the tied output layer once a micro-batch); each way's error against an fp64
sum over four micro-batches; and whether the compiled layer's ``grad_accumulation.linear`` under ``torch.compile``
adds the same sums as eagerly (row 1 of ``bench/results/wgrad_accum.jsonl`` came from an earlier copy of that
Function, which also compared the buffers' addresses).  Prints one JSON line; ``--out`` appends it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import cuda_ms, probe_args, probe_emit  # noqa: E402

#: Llama-3.2-1B's layer weights [out, in] (q + the GQA k, v; output; SwiGLU's gate + up; down) and its tied head
LAYER_SHAPES = {"qkv": (3072, 2048), "proj": (2048, 2048), "fc1": (16384, 2048), "fc2": (2048, 8192)}
HEAD_SHAPE = (128256, 2048)
LAYERS, MICRO, TOKENS = 16, 4, 4 * 2048


def _compiled_in_backward() -> dict:
    """A two-linear block through the compiled layer's own :func:`~workbench.backend.grad_accumulation.linear`,
    compiled whole, its ``main_grad`` two views of one buffer (as DDP's): the compiled sums equal the eager ones."""
    from workbench.backend.grad_accumulation import MainGradWeight, linear

    def block(x, w1, w2):
        return linear(torch.nn.functional.silu(linear(x, w1, None)), w2, None)

    gen = torch.Generator(device="cuda").manual_seed(1)
    w = [torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for s in ((256, 128), (128, 256))]
    xs = [torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
    out = {}
    for name, fn in (("eager", block), ("compiled", torch.compile(block, fullgraph=True))):
        buf = torch.zeros(2 * 256 * 128, device="cuda")
        m = [buf[:256 * 128].view(256, 128), buf[256 * 128:].view(128, 256)]
        for x in xs:
            fn(x, MainGradWeight(w[0], m[0]), MainGradWeight(w[1], m[1])).float().square().sum().backward()
        out[name] = m
    me, mc = out["eager"], out["compiled"]
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mc, me))
    return {"compiled_vs_eager_max_rel_diff": diff,
            "compiled_ok": bool(diff < 1e-5 and all(bool(t.abs().sum() > 0) for t in mc))}


def main() -> int:
    from workbench.backend.grad_accumulation import accumulate, wgrad_into
    from workbench.provenance import stamp

    a = probe_args("wgrad_accum_probe", __doc__)
    if a is None:
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name, (n, k) in {**LAYER_SHAPES, "head": HEAD_SHAPE}.items():
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.01
        mg = torch.zeros(n, k, device="cuda")
        ms = {"gemm_bf16": cuda_ms(lambda: g.t() @ x),
              "today_first": cuda_ms(lambda: accumulate(mg, g.t() @ x, first=True)),
              "today_add": cuda_ms(lambda: accumulate(mg, g.t() @ x, first=False)),
              "fused": cuda_ms(lambda: wgrad_into(mg, g, x))}
        rows[name] = {"shape": [n, k], "ms": ms, "fused_tflops": 2 * TOKENS * n * k / (ms["fused"] * 1e-3) / 1e12}
    today = LAYERS * sum(r["ms"]["today_first"] + (MICRO - 1) * r["ms"]["today_add"] for k, r in rows.items() if k != "head")
    fused = LAYERS * MICRO * sum(r["ms"]["fused"] for k, r in rows.items() if k != "head")
    head = rows["head"]["ms"]
    today += head["today_first"] + (MICRO - 1) * head["today_add"]
    fused += MICRO * head["fused"]
    # error of each way over four micro-batches at fc2's shape, against an fp64 sum of the bf16 products
    n, k = LAYER_SHAPES["fc2"]
    want = torch.zeros(n, k, device="cuda", dtype=torch.float64)
    via_today, via_fused = torch.zeros(n, k, device="cuda"), torch.zeros(n, k, device="cuda")
    for i in range(MICRO):
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        g = torch.randn(TOKENS, n, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.01
        want += g.double().t() @ x.double()
        accumulate(via_today, g.t() @ x, first=i == 0)
        wgrad_into(via_fused, g, x)
    scale = float(want.abs().max())
    row = {"probe": "wgrad_accum", "tokens": TOKENS, "layers": LAYERS, "micro_batches": MICRO, "per_weight": rows,
           "step_ms": {"today": today, "fused": fused, "saved": today - fused},
           "max_rel_error_vs_fp64": {"today": float((via_today.double() - want).abs().max()) / scale,
                                     "fused": float((via_fused.double() - want).abs().max()) / scale},
           **_compiled_in_backward(), **stamp()}
    probe_emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
