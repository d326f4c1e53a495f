"""The compiled layer's hand-written Triton ops (``KernelChoice.triton_ops``) at Llama-3.2-1B's shapes (one
micro-batch of 4 x 2048 tokens, bf16), each piece compiled whole as the layer is, both ways:

- the MLP (:func:`workbench.backend.compiled_layer._mlp_partial`: fc1, SwiGLU, fc2) with the activation as inductor
  fuses ``silu(gate) * up`` ("swiglu") and as :mod:`workbench.backend.glu`'s ops ("swiglu_triton");
- the attention's QKV GEMM, split, rotary, GQA repeat and SDPA
  (:func:`workbench.backend.compiled_layer._self_attention`) as inductor fuses them ("torch") and with
  :mod:`workbench.backend.qkv_rope`'s op ("triton");
- the loss over the 128,256-token vocabulary (:func:`workbench.backend.cross_entropy.cross_entropy_sb`) compiled as
  ``F.cross_entropy(logits.float())`` ("torch") and as the Triton op ("triton"), 4 calls a step, and the op's two
  kernels alone at several block sizes and warp counts.

Forward + backward milliseconds (CUDA events, 20 calls after 5), the step's total (64 calls: 16 layers x 4
micro-batches), each way's top kernels (torch profiler), and the errors of outputs and gradients against the same
function in fp32.  Prints one JSON line; ``--out`` appends it.  (Row 1 of ``bench/results/triton_ops_probe.jsonl``, at
daf3c89, timed the SwiGLU op and rotary cos / sin tables made once and handed to inductor instead: 1.63 against
1.43 ms an attention call, inductor's backward slower; that variant was dropped.)"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import cuda_ms, probe_args, probe_emit, profile_steps  # noqa: E402

S, B, H, F, HEADS, GROUPS, D = 2048, 4, 2048, 8192, 32, 8, 64
CALLS_PER_STEP = 64
VOCAB, MICROBATCHES = 128256, 4


def _fwd_bwd(fn, inputs: list, grad: torch.Tensor):
    def run():
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(grad)
    return run


def _errors(got: list, want: list) -> float:
    return max(float((g.float() - w.float()).abs().max() / w.float().abs().max()) for g, w in zip(got, want))


def _mlp(gen) -> dict:
    from workbench.backend.compiled_layer import _mlp_partial

    h = (torch.randn(S, B, H, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(2 * F, H, device="cuda", generator=gen) / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(H, F, device="cuda", generator=gen) / F ** 0.5).bfloat16().requires_grad_()
    gy = torch.randn(S, B, H, device="cuda", generator=gen).bfloat16()
    ref_in = [t.detach().float().requires_grad_() for t in (h, w1, w2)]
    ref_out = _mlp_partial(*ref_in[:2], None, ref_in[2], "swiglu")
    ref_out.backward(gy.float())
    want = [ref_out.detach()] + [t.grad for t in ref_in]
    out = {}
    for act in ("swiglu", "swiglu_triton"):
        fn = torch.compile(lambda a, b, c, act=act: _mlp_partial(a, b, None, c, act), fullgraph=True)
        run = _fwd_bwd(fn, [h, w1, w2], gy)
        run()
        got = [fn(h, w1, w2).detach()] + [t.grad.clone() for t in (h, w1, w2)]
        ms = cuda_ms(run)
        prof = profile_steps(run, True, True, steps=3, top=8)
        out[act] = {"ms": round(ms, 4), "ms_per_step": round(ms * CALLS_PER_STEP, 2),
                    "max_rel_err_vs_fp32": _errors(got, want),
                    "top_kernels": (prof or {}).get("top_kernels")}
    return out


def _attention(gen) -> dict:
    from workbench.backend.compiled_layer import _self_attention

    h = (torch.randn(S, B, H, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn((HEADS + 2 * GROUPS) * D, H, device="cuda", generator=gen) / H ** 0.5).bfloat16().requires_grad_()
    gy = torch.randn(S, B, HEADS * D, device="cuda", generator=gen).bfloat16()
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device="cuda") / D))
    f = torch.outer(torch.arange(S, dtype=torch.float32, device="cuda"), inv)
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]

    def attend(a, b, triton=False):
        return _self_attention(a, b, None, heads=HEADS, groups=GROUPS, head_dim=D, scale=D ** -0.5, causal=True,
                               mask=None, bias=None, rope=freqs, triton=triton)

    ref_in = [t.detach().float().requires_grad_() for t in (h, w)]
    ref_out = attend(*ref_in)
    ref_out.backward(gy.float())
    want = [ref_out.detach()] + [t.grad for t in ref_in]
    out = {}
    for name in ("torch", "triton"):
        fn = torch.compile(lambda a, b, t=name == "triton": attend(a, b, t), fullgraph=True)
        run = _fwd_bwd(fn, [h, w], gy)
        run()
        got = [fn(h, w).detach()] + [t.grad.clone() for t in (h, w)]
        ms = cuda_ms(run)
        prof = profile_steps(run, True, True, steps=3, top=8)
        out[name] = {"ms": round(ms, 4), "ms_per_step": round(ms * CALLS_PER_STEP, 2),
                     "max_rel_err_vs_fp32": _errors(got, want), "top_kernels": (prof or {}).get("top_kernels")}
    return out


def _cross_entropy(gen) -> dict:
    """The loss over Llama-3.2-1B's vocabulary (one micro-batch: 8192 tokens x 128,256, bf16 logits) compiled as
    ``F.cross_entropy(logits.float())`` ("torch") and as :mod:`workbench.backend.cross_entropy`'s op ("triton"),
    forward + backward; then each kernel alone at several block sizes and warp counts."""
    from workbench.backend import cross_entropy as ce

    x = (torch.randn(S, B, VOCAB, device="cuda", generator=gen) * 2).bfloat16().requires_grad_()
    labels = torch.randint(0, VOCAB, (B, S), device="cuda", generator=gen)
    w = torch.rand(B, S, device="cuda", generator=gen) / (B * S)  # (a loss mask over the tokens)
    ref_in = x.detach().float().requires_grad_()
    ref = ce.cross_entropy_sb(ref_in, labels)
    (ref * w).sum().backward()
    want = [ref.detach(), ref_in.grad]
    out: dict = {}
    for name in ("torch", "triton"):
        fn = torch.compile(lambda a, b, t=name == "triton": ce.cross_entropy_sb(a, b, t), fullgraph=True)

        def run(fn=fn):
            x.grad = None
            (fn(x, labels) * w).sum().backward()
        run()
        got = [fn(x, labels).detach(), x.grad.clone()]
        ms = cuda_ms(run)
        prof = profile_steps(run, True, True, steps=3, top=6)
        out[name] = {"ms": round(ms, 4), "ms_per_step": round(ms * MICROBATCHES, 2),
                     "max_rel_err_vs_fp32": _errors(got, want), "top_kernels": (prof or {}).get("top_kernels")}
    fwd, bwd = ce._kernels()
    n, rows = B * S, x.detach().reshape(B * S, VOCAB)
    flat = labels.t().reshape(n).contiguous()
    loss, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    dx, g, dlse = torch.empty_like(rows), torch.rand(n, device="cuda", generator=gen), torch.zeros(n, device="cuda")
    sweep = {}
    for block in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            sweep[f"forward {block} x{warps}"] = round(cuda_ms(lambda: fwd[(n,)](
                rows, flat, loss, lse, VOCAB, IGNORE=ce.IGNORE_INDEX, BLOCK=block, num_warps=warps)), 4)
            if block <= 8192:
                sweep[f"backward {block // 2} x{warps}"] = round(cuda_ms(lambda: bwd[(n, -(-VOCAB // (block // 2)))](
                    g, dlse, rows, flat, lse, dx, VOCAB, IGNORE=ce.IGNORE_INDEX, BLOCK=block // 2, num_warps=warps)), 4)
    out["kernel_ms"] = sweep
    out["bytes_ms_at_4tb"] = round(rows.numel() * 2 / 4e9, 4)  # one read of the bf16 logits at 4 TB/s
    return out


def main() -> int:
    from workbench.provenance import stamp

    a = probe_args("triton_ops_probe", __doc__)
    if a is None:
        return 2
    from workbench.backend import cross_entropy, glu, qkv_rope

    glu.register()  # (as the compiled layer does when built: before a compile traces a first use)
    qkv_rope.register()
    cross_entropy.register()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ce = _cross_entropy(gen)
    mlp, attn = _mlp(gen), _attention(gen)
    row = {"probe": "triton_ops", "shape": {"s": S, "b": B, "hidden": H, "ffn": F, "heads": HEADS, "groups": GROUPS},
           "mlp": mlp, "attention": attn, "cross_entropy": ce,
           "ce_saved_ms_per_step": round(ce["torch"]["ms_per_step"] - ce["triton"]["ms_per_step"], 2),
           "swiglu_saved_ms_per_step": round(mlp["swiglu"]["ms_per_step"] - mlp["swiglu_triton"]["ms_per_step"], 2),
           "qkv_saved_ms_per_step": round(attn["torch"]["ms_per_step"] - attn["triton"]["ms_per_step"], 2),
           **stamp()}
    probe_emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
