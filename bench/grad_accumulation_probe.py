"""GPU check of workbench.backend.grad_accumulation: the Triton add equals torch's mixed-dtype add_ bit for bit,
and how long each takes on a large gradient (prints one JSON line with device, date and commit).

    python3 bench/grad_accumulation_probe.py [--numel 262668288]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import torch

    from workbench.backend.grad_accumulation import accumulate
    from workbench.provenance import stamp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=262_668_288)  # Llama-3.2-1B's embedding, the largest weight
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    g = torch.randn(a.numel, device="cuda").bfloat16()
    base = torch.randn(a.numel, device="cuda")
    ours, theirs = base.clone(), base.clone()
    accumulate(ours, g, first=False)
    theirs.add_(g)
    first = torch.empty_like(base)
    accumulate(first, g, first=True)
    bit_equal, copy_equal = bool(torch.equal(ours, theirs)), bool(torch.equal(first, g.float()))

    def ms(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / a.reps

    t_torch = ms(lambda: theirs.add_(g))
    t_ours = ms(lambda: accumulate(ours, g, first=False))
    t_copy = ms(lambda: accumulate(first, g, first=True))
    gb = a.numel * 10 / 1e9
    row = {**stamp(), "check": "grad_accumulation", "numel": a.numel, "bit_equal": bit_equal, "copy_equal": copy_equal,
           "torch_add_ms": round(t_torch, 3), "workbench_add_ms": round(t_ours, 3), "workbench_copy_ms": round(t_copy, 3),
           "torch_add_TBps": round(gb / t_torch, 2), "workbench_add_TBps": round(gb / t_ours, 2),
           "workbench_copy_TBps": round(a.numel * 6 / 1e9 / t_copy, 2)}
    print(json.dumps(row), flush=True)
    return 0 if row["bit_equal"] and row["copy_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
