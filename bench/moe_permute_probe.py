"""The MoE token permutation's gathers at moe-research's shapes (one micro-batch of 8 x 2048 tokens, top-8 of 64
experts, hidden 1024, bf16), each way it can run on CUDA: the un-permutation's gather-and-sum eagerly (three
kernels), compiled by inductor (the path before :mod:`workbench.backend.moe_kernels`) and as the workbench's Triton
kernel.  CUDA events over 50 calls after 10; the Triton kernel's output against the eager result (elements that
differ and the largest difference, in units of the eager value's last place).  (At 21afaaa it also timed a Triton row
gather against ``index_select``: no faster, ``bench/results/moe_permute.jsonl:2``; not kept.)  Prints one JSON line;
``--out`` appends it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import cuda_ms, probe_args, probe_emit  # noqa: E402


def main() -> int:
    from workbench.backend import moe_kernels
    from workbench.backend.moe_dispatch import _gather_sum, routing_indices
    from workbench.provenance import stamp

    a = probe_args("moe_permute_probe", __doc__)
    if a is None:
        return 2
    tokens, experts, k, hidden = 8 * 2048, 64, 8, 1024
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    routing = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    routing.scatter_(1, logits.topk(k, dim=1).indices, True)
    _, slots, _ = routing_indices(routing, k)
    y = torch.randn(tokens * k, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    moved = (tokens * k + tokens) * hidden * 2  # bytes each op reads and writes (the index aside)
    compiled = torch.compile(_gather_sum)
    want = _gather_sum(y, slots, k)
    got = moe_kernels.gather_sum(y, slots, k)
    ulp = (want.float().abs().clamp_min(1e-30).log2().floor() - 7).exp2()  # bf16: 8 significant bits
    ms = {"eager": cuda_ms(lambda: _gather_sum(y, slots, k), 50, 10),
          "inductor": cuda_ms(lambda: compiled(y, slots, k), 50, 10),
          "triton": cuda_ms(lambda: moe_kernels.gather_sum(y, slots, k), 50, 10)}
    row = {"probe": "moe_permute", "tokens": tokens, "experts": experts, "top_k": k, "hidden": hidden,
           "op": "gather_sum (un-permute; the permutation's backward)", "ms": ms,
           "tb_per_s": {n: moved / (v * 1e-3) / 1e12 for n, v in ms.items()},
           "triton_over_inductor": ms["inductor"] / ms["triton"],
           "elements_differing": int((got != want).sum()), "elements": want.numel(),
           "max_diff_in_ulps": float(((got.float() - want.float()).abs() / ulp).max()), **stamp()}
    probe_emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
