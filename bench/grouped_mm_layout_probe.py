"""The experts' grouped GEMMs at moe-research's shapes (64 experts, hidden 1024, fc1 1024 x 1024, fc2 1024 x 512, top-8
of one micro-batch's 16,384 tokens = 131,072 rows a GEMM, bf16) in the two layouts a stacked expert weight can reach
``grouped_mm`` in: the transposed view of the ``[E, out, in]`` stack (what ``GroupedGemmMLP`` hands it) against the
``[E, in, out]`` stack made contiguous (what inductor makes of the plain MoE's ``w.to(bf16).transpose``).  Forward
and backward (input and weight gradients) of fc1 then fc2, CUDA events over 20 iterations after 5, the rows routed
as the preset's router left them (one skewed and one uniform split).  Prints one JSON line per case; ``--out``
appends them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profiling import cuda_ms, probe_args, probe_emit  # noqa: E402


def offsets(rows: int, experts: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Group end rows: ``skew`` 0 splits evenly; 1 draws each expert's share from an exponential (a router far from
    balanced)."""
    w = torch.ones(experts) if skew == 0 else torch.empty(experts).exponential_(generator=gen) ** (1 + 2 * skew)
    counts = (w / w.sum() * rows).floor().long()
    counts[-1] += rows - counts.sum()
    return torch.cumsum(counts, 0).to(torch.int32)


def case(layout: str, offs: torch.Tensor, rows: int, E: int, h: int, f: int) -> float:
    grouped = getattr(F, "grouped_mm", None) or torch._grouped_mm
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, h, device=dev, dtype=dt, requires_grad=True)
    w1 = torch.randn(E, 2 * f, h, device=dev, dtype=dt) * 0.02  # [E, out, in]
    w2 = torch.randn(E, h, f, device=dev, dtype=dt) * 0.02
    if layout == "transposed-view":
        b1, b2 = w1.transpose(-2, -1).detach(), w2.transpose(-2, -1).detach()
    else:
        b1, b2 = w1.transpose(-2, -1).contiguous(), w2.transpose(-2, -1).contiguous()
    b1.requires_grad_(True)
    b2.requires_grad_(True)
    grad = torch.randn(rows, h, device=dev, dtype=dt)

    def step():
        hmid = grouped(x, b1, offs=offs)
        gate, up = hmid.chunk(2, dim=-1)
        out = grouped(F.silu(gate) * up, b2, offs=offs)
        out.backward(grad)
        x.grad = b1.grad = b2.grad = None

    return cuda_ms(step)


def main() -> int:
    from workbench.provenance import stamp

    a = probe_args("grouped_mm_layout_probe", __doc__)
    if a is None:
        return 2
    E, h, f, rows = 64, 1024, 512, 8 * 2048 * 8  # one micro-batch of 8 x 2048 tokens, top-8
    gen = torch.Generator().manual_seed(0)
    for skew in (0.0, 1.0):
        offs = offsets(rows, E, skew, gen).cuda()
        ms = {layout: case(layout, offs, rows, E, h, f) for layout in ("transposed-view", "contiguous")}
        row = {"probe": "grouped_mm_layout", "experts": E, "hidden": h, "ffn": f, "rows": rows, "skew": skew,
               "ms_fwd_bwd": ms, "contiguous_over_view": ms["transposed-view"] / ms["contiguous"], **stamp()}
        probe_emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
