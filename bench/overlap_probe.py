"""Can a TP=2 exchange hide under a GEMM on this machine, and on which transport?

TP=2 + SP's collectives on Llama-3.2-3B cost ~147 ms of a ~800 ms step (2x H200) and none of it overlaps;
chunking each GEMM so NCCL runs beside the other chunk (``parallel.tp_chunked``) overlapped ~58 ms but made the
GEMMs beside NCCL's kernels slower by more than that (bench/README.md).  This probe times the pieces alone
and together, at the 3B's shapes (4,096 tokens a micro-batch, hidden 3,072, the MLP's 8,192 gate + up columns a
rank; each exchange 12 MiB):

- ``gemm``: K GEMMs on the compute stream, alone;
- ``nccl``: K all-gathers of a [T/2, H] shard on a side stream, alone; ``gemm+nccl``: both at once;
- ``ce``: K copies of the peer's shard out of its symmetric-memory buffer (the copy engines over NVLink: no
  SMs), alone; ``gemm+ce``: both at once; ``signal``: K symmetric-memory barriers (what each exchange would
  add to say its data is there).

For each pair it prints how much of the transfer was hidden: (gemm + transfer - both) / transfer, and how
much the GEMMs slowed.  Run what NCCL's channel count does by setting ``NCCL_MAX_NCHANNELS`` around it.

    torchrun --nproc-per-node 2 bench/overlap_probe.py --out bench/results/overlap_probe.jsonl

Appends JSON lines (device, date, commit, env, case, ms).  ``--cpu`` runs the NCCL cases over gloo at a
tiny shape with host timers (checks the script; a test runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workbench.provenance import stamp  # noqa: E402


def _time(fn, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs after 3 warm-ups (CUDA events on GPUs)."""
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


class Probe:
    """The tensors and streams of one rank; every case is a method returning nothing (timed by :func:`_time`)."""

    def __init__(self, tokens: int, hidden: int, cols: int, k: int, cuda: bool):
        self.k, self.cuda = k, cuda
        dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
        self.rank, self.peer = dist.get_rank(), 1 - dist.get_rank()
        self.x = torch.randn(tokens, hidden, device=dev, dtype=dt)
        self.w = torch.randn(hidden, cols, device=dev, dtype=dt) / hidden**0.5
        self.y = torch.empty(tokens, cols, device=dev, dtype=dt)
        self.shard = torch.randn(tokens // 2, hidden, device=dev, dtype=dt)
        self.full = torch.empty(tokens, hidden, device=dev, dtype=dt)
        self.side = torch.cuda.Stream() if cuda else None
        self.symm = None

    def _on_side(self, fn):
        if not self.cuda:
            return fn()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            fn()
        torch.cuda.current_stream().wait_stream(self.side)

    def gemm(self):
        for _ in range(self.k):
            torch.matmul(self.x, self.w, out=self.y)

    def _gathers(self):
        for _ in range(self.k):
            if self.cuda:
                dist.all_gather_into_tensor(self.full, self.shard)
            else:
                dist.all_gather(list(self.full.chunk(2)), self.shard)

    def nccl(self):
        self._on_side(self._gathers)

    def gemm_nccl(self):
        self._on_side_with_gemm(self._gathers)

    def _on_side_with_gemm(self, transfer):
        if not self.cuda:  # one host thread: the pieces run one after the other (the script's own check)
            self.gemm()
            return transfer()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            transfer()
        self.gemm()
        torch.cuda.current_stream().wait_stream(self.side)

    # ------------------------------------------------------------------ copy engines (symmetric memory)
    def setup_symm(self) -> str | None:
        """The peer's shard as a tensor this rank can copy from (None when set up; else why not)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD.group_name
            symm_mem.enable_symm_mem_for_group(group)
            buf = symm_mem.empty(self.shard.shape, dtype=self.shard.dtype, device=self.shard.device)
            hdl = symm_mem.rendezvous(buf, group)
            buf.copy_(self.shard)
            hdl.barrier(channel=0)
            self.symm = (buf, hdl, hdl.get_buffer(self.peer, tuple(self.shard.shape), self.shard.dtype))
        except Exception as e:  # noqa: BLE001 - a torch or link without it: the row says so
            return f"{type(e).__name__}: {e}"[:300]
        return None

    def _copies(self):
        half = self.full.shape[0] // 2
        dst = self.full[self.peer * half:(self.peer + 1) * half]
        for _ in range(self.k):
            dst.copy_(self.symm[2], non_blocking=True)

    def ce(self):
        self._on_side(self._copies)

    def gemm_ce(self):
        self._on_side_with_gemm(self._copies)

    def signal(self):
        for _ in range(self.k):
            self.symm[1].barrier(channel=0)


def run(a) -> list[dict]:
    cuda = not a.cpu
    p = Probe(a.tokens, a.hidden, a.cols, a.k, cuda)
    rows = []

    def case(name, fn):
        dist.barrier()
        rows.append({"case": name, "ms": _time(fn, a.iters, cuda), "k": a.k})

    case("gemm", p.gemm)
    case("nccl", p.nccl)
    case("gemm+nccl", p.gemm_nccl)
    why = p.setup_symm() if cuda else "copy engines: GPUs only"
    if why is None:
        case("ce", p.ce)
        case("gemm+ce", p.gemm_ce)
        case("signal", p.signal)
    else:
        rows.append({"case": "ce", "error": why})
    return rows


def summary(rows: list[dict]) -> list[str]:
    """One line per transfer: hidden fraction and the GEMMs' slow-down beside it."""
    ms = {r["case"]: r["ms"] for r in rows if "ms" in r}
    out = []
    for t in ("nccl", "ce"):
        if t in ms and f"gemm+{t}" in ms:
            both, g, x = ms[f"gemm+{t}"], ms["gemm"], ms[t]
            hidden = (g + x - both) / x if x > 0 else 0.0
            out.append(f"{t:5s}: gemm {g:.3f} ms, transfer {x:.3f} ms, both {both:.3f} ms: {100 * hidden:.0f}% of the "
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
                    "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
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
