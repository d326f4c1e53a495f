"""Can a TP=2 exchange hide under a GEMM on this machine, and on which transport?

TP=2 + SP's collectives on Llama-3.2-3B cost ~147 ms of a ~800 ms step (2x H200) and none of it overlaps;
chunking each GEMM so NCCL runs beside the other chunk (``parallel.tp_chunked``) overlapped ~48 ms more but made the
GEMMs beside NCCL's kernels slower by more than that (bench/README.md).  This probe times the pieces alone
and together, at the 3B's shapes (4,096 tokens a micro-batch, hidden 3,072, the MLP's 8,192 gate + up columns a
rank; each exchange 12 MiB):

- ``gemm``: K GEMMs alone;
- ``nccl_ag`` / ``nccl_rs``: K NCCL all-gathers of a [T/2, H] shard / reduce-scatters into one (async), alone;
- ``lc_ag`` / ``lc_rs``: the same through torch's low-contention symmetric-memory ops (the copy engines over
  NVLink, no SMs for the transfer itself, a barrier before and after each), alone;
- ``gemm+<transfer>``: the transfers issued, then the GEMMs, then the wait.

For each pair it prints how much of the transfer was hidden: (gemm + transfer - both) / transfer, and how
much the GEMMs slowed.  Run what NCCL's channel count does by setting ``NCCL_MAX_NCHANNELS`` around it, and the
training rows' one hardware queue with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (the TP rows run with it).

    torchrun --nproc-per-node 2 bench/overlap_probe.py --out bench/results/overlap_probe.jsonl

Appends JSON lines (device, date, commit, env, case, ms).  ``--cpu`` runs the NCCL cases over gloo at a
tiny shape with host timers (checks the script; a test runs it); the copy-engine cases are GPU-only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.harness import median_ms  # noqa: E402
from workbench.provenance import stamp  # noqa: E402


class Probe:
    """The tensors of one rank.  Each transfer issues its K exchanges asynchronously and returns their waiter; a case
    runs it alone (issue, wait) or beside the K GEMMs (issue, GEMMs, wait)."""

    def __init__(self, tokens: int, hidden: int, cols: int, k: int, cuda: bool):
        self.k, self.cuda = k, cuda
        dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
        self.rank, self.peer = dist.get_rank(), 1 - dist.get_rank()
        self.group = dist.group.WORLD.group_name
        self.x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        self.w = torch.randn(hidden, cols, device=dev, dtype=dt) / hidden**0.5
        self.y = torch.empty(tokens, cols, device=dev, dtype=dt)
        self.shard = torch.randn(tokens // 2, hidden, device=dev, dtype=dt)
        self.full = torch.empty(tokens, hidden, device=dev, dtype=dt)
        if cuda:
            try:  # older torch needs it before the low-contention ops' workspace; newer ones ignore it
                import torch.distributed._symmetric_memory as symm_mem

                symm_mem.enable_symm_mem_for_group(self.group)
            except Exception:  # noqa: BLE001 - the lc cases then fail and say why
                pass

    def gemm(self):
        for _ in range(self.k):
            torch.matmul(self.x, self.w, out=self.y)

    # ------------------------------------------------------------------ transfers: issue K, return the waiter
    def nccl_ag(self):
        if self.cuda:
            works = [dist.all_gather_into_tensor(self.full, self.shard, async_op=True) for _ in range(self.k)]
        else:
            works = [dist.all_gather(list(self.full.chunk(2)), self.shard, async_op=True) for _ in range(self.k)]
        return lambda: [w.wait() for w in works]

    def nccl_rs(self):
        if self.cuda:
            works = [dist.reduce_scatter_tensor(self.shard, self.full, async_op=True) for _ in range(self.k)]
        else:  # gloo has no reduce-scatter: an all-reduce of the same bytes stands in for the script's check
            works = [dist.all_reduce(self.full, async_op=True) for _ in range(self.k)]
        return lambda: [w.wait() for w in works]

    def lc_ag(self):
        """torch's low-contention all-gather: the copy engines pull the peer's shard (plus one SM copy of this rank's
        into the symmetric workspace), between two symmetric-memory barriers, on torch's backend stream."""
        outs = [torch.ops.symm_mem._low_contention_all_gather(self.shard, self.group) for _ in range(self.k)]
        return lambda: [torch.ops._c10d_functional.wait_tensor(o) for o in outs]

    def lc_rs(self):
        outs = [torch.ops.symm_mem._low_contention_reduce_scatter(self.full, "sum", self.group) for _ in range(self.k)]
        return lambda: [torch.ops._c10d_functional.wait_tensor(o) for o in outs]

    def alone(self, transfer):
        return lambda: transfer()()

    def beside(self, transfer):
        def both():
            wait = transfer()
            self.gemm()
            wait()
        return both


def run(a) -> list[dict]:
    cuda = not a.cpu
    p = Probe(a.tokens, a.hidden, a.cols, a.k, cuda)
    rows = []

    def case(name, fn):
        dist.barrier()
        try:
            rows.append({"case": name, "ms": median_ms(fn, a.iters, cuda), "k": a.k})
        except Exception as e:  # noqa: BLE001 - a torch or link without it: the row says so
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
            if cuda:  # (an op that failed on one rank only can leave the peer in a device barrier: the call's limit ends it)
                torch.cuda.synchronize()

    case("gemm", p.gemm)
    for t in ("nccl_ag", "nccl_rs") + (("lc_ag", "lc_rs") if cuda else ()):
        case(t, p.alone(getattr(p, t)))
        case(f"gemm+{t}", p.beside(getattr(p, t)))
    if not cuda:
        rows += [{"case": t, "error": "copy engines: GPUs only"} for t in ("lc_ag", "lc_rs")]
    return rows


def summary(rows: list[dict]) -> list[str]:
    """One line per transfer: hidden fraction and the GEMMs' slow-down beside it."""
    ms = {r["case"]: r["ms"] for r in rows if "ms" in r}
    out = []
    for t in ("nccl_ag", "nccl_rs", "lc_ag", "lc_rs"):
        if t in ms and f"gemm+{t}" in ms:
            both, g, x = ms[f"gemm+{t}"], ms["gemm"], ms[t]
            hidden = (g + x - both) / x if x > 0 else 0.0
            out.append(f"{t:7s}: gemm {g:.3f} ms, transfer {x:.3f} ms, both {both:.3f} ms: {100 * hidden:.0f}% of the "
                       f"transfer hidden, the pair {both / max(g, x):.2f}x the longer alone")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "overlap_probe.jsonl"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--k", type=int, default=8, help="GEMMs and transfers a timed piece")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--cols", type=int, default=8192)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU at a tiny shape (a smoke test of the script)")
    a = ap.parse_args()
    if a.cpu:
        a.tokens, a.hidden, a.cols, a.iters, a.k = 64, 32, 48, 3, 2
    rank = int(os.environ["RANK"])
    if int(os.environ["WORLD_SIZE"]) != 2:
        print("overlap_probe: run it on exactly 2 ranks (torchrun --nproc-per-node 2)", file=sys.stderr)
        return 2
    if not a.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("gloo" if a.cpu else "nccl")
    try:
        rows = run(a)
        if rank == 0:
            base = {**stamp(), "probe": "overlap", "tokens": a.tokens, "hidden": a.hidden, "cols": a.cols,
                    "exchange_mib": a.tokens // 2 * a.hidden * (4 if a.cpu else 2) / 2**20,
                    "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "CUDA_DEVICE_MAX_CONNECTIONS"}}
            for r in rows:
                print(f"{r['case']:10s} " + (f"{r['ms']:8.3f} ms" if "ms" in r else f"skipped: {r['error']}"))
            for line in summary(rows):
                print(line)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "a") as fh:
                for r in rows:
                    fh.write(json.dumps({**base, **r}) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
