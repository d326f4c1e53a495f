"""How fast the GPUs of this machine talk: NCCL all-reduce and p2p send/recv, sized like TP / PP traffic.

Tensor parallelism without sequence parallelism all-reduces each layer's activations four
times per micro-batch (two forward, two backward); pipeline parallelism sends one activation
per micro-batch and stage boundary.  Whether TP=2 can ever pay depends on this link, so the
benchmark results cite these numbers next to the TP rows.

    torchrun --nproc-per-node 2 bench/allreduce_probe.py --out bench/results/allreduce_probe.jsonl

Prints a table and appends JSON lines (device, date, commit, sizes, times, bus bandwidth).
Bus bandwidth follows nccl-tests: all-reduce busbw = 2 (n-1)/n * bytes / time.
``--cpu`` runs the same over gloo with host timers (checks the script; CI runs it).
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

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.harness import median_ms  # noqa: E402
from workbench.provenance import stamp  # noqa: E402

#: 20 MiB = one GPT-2 large activation [1024, 8, 1280] bf16 (the benchmark's TP=2 micro-batch)
SIZES_MIB = (1, 5, 20, 80)


def _symm_mem_rows(x: torch.Tensor, iters: int) -> list[dict]:
    """torch's symmetric-memory all-reduces on a copy of ``x``: one-shot reads every peer's whole
    buffer over NVLink, two-shot reduce-scatters then all-gathers through peer memory.  (Inductor
    can lower a compiled layer's all-reduces to one-shot only; see bench/README.md "Session 6".)"""
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group)
    buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, group)
    buf.copy_(x)
    world, nbytes = dist.get_world_size(), x.numel() * x.element_size()
    rows = []
    for op, fn in (("symm_one_shot", lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group)),
                   ("symm_two_shot", lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group))):
        try:
            ms = median_ms(fn, iters, True)
        except Exception as e:  # noqa: BLE001 - a torch without the kernel: say so in the table
            rows.append({"op": op, "mib": nbytes >> 20, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        rows.append({"op": op, "mib": nbytes >> 20, "ms": ms, "busbw_gbs": 2 * (world - 1) / world * nbytes / ms / 1e6})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "allreduce_probe.jsonl"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--symm-mem", action="store_true", help="also time torch's symmetric-memory all-reduces (GPUs only)")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, 1 MiB only (a smoke test of the script)")
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = not a.cpu
    a.symm_mem = a.symm_mem and cuda
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    rows = []
    for mib in SIZES_MIB if cuda else SIZES_MIB[:1]:
        x = torch.randn(mib * 2**19, device=device, dtype=torch.bfloat16 if cuda else torch.float16)  # mib MiB
        ms = median_ms(lambda: dist.all_reduce(x), a.iters, cuda)
        nbytes = x.numel() * x.element_size()
        rows.append({"op": "all_reduce", "mib": mib, "ms": ms, "busbw_gbs": 2 * (world - 1) / world * nbytes / ms / 1e6})
        if world == 2:
            peer = 1 - rank

            def exchange():
                ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty_like(x), peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            ms = median_ms(exchange, a.iters, cuda)
            rows.append({"op": "sendrecv", "mib": mib, "ms": ms, "busbw_gbs": nbytes / ms / 1e6})
        if a.symm_mem:
            rows += _symm_mem_rows(x, a.iters)
    if rank == 0:
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout if cuda else ""
        except (OSError, subprocess.SubprocessError):
            topo = ""
        base = {**stamp(), "world_size": world, "backend": dist.get_backend(),
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "env": {k: os.environ.get(k) for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_SHM_DISABLE", "NCCL_MIN_NCHANNELS",
                                                     "NCCL_PROTO", "NCCL_ALGO", "NCCL_BUFFSIZE")}}
        print(topo)
        print(f"{'op':12s} {'MiB':>5s} {'ms':>8s} {'busbw GB/s':>11s}")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as fh:
            for r in rows:
                if "error" in r:
                    print(f"{r['op']:12s} {r['mib']:5d}  failed: {r['error']}")
                else:
                    print(f"{r['op']:12s} {r['mib']:5d} {r['ms']:8.3f} {r['busbw_gbs']:11.1f}")
                fh.write(json.dumps({**base, **r, "topology": topo.strip()}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
