"""Two gloo ranks: the workbench's token dispatch at EP=2 (``LocalTokenDispatcher`` with its all-gather of counts,
all-to-all each way and regrouping by local expert) against a dense per-token reference on each rank: the combined
output and the gradients of the tokens and of the routing probabilities.  Rank 1 routes nothing to experts 0 and 1
(empty blocks).  Prints one JSON line per rank.  Usage: ``moe_ep_dispatch_check.py PORT``."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXPERTS, TOP_K, HIDDEN, TOKENS, EP = 8, 3, 6, 13, 2
WEIGHTS = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))


def _data(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    if rank == 1:
        logits[:, 0:2] -= 100
    top, idx = torch.topk(logits, TOP_K, -1)
    probs = torch.zeros(TOKENS, EXPERTS).scatter(1, idx, torch.softmax(top, -1))
    routing = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, idx, True)
    return torch.randn(TOKENS, HIDDEN, generator=g), probs, routing, torch.randn(TOKENS, HIDDEN, generator=g)


def _reference(rank: int):
    x, probs, routing, grad = _data(rank)
    x, p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    rows = []
    for t in range(TOKENS):
        rows.append(sum((x[t] @ WEIGHTS[e]) * p[t, e] for e in range(EXPERTS) if routing[t, e]))
    y = torch.stack(rows)
    (y * grad).sum().backward()
    return y.detach(), x.grad, p.grad


def _worker(rank: int, port: int) -> None:
    from workbench.backend.moe_dispatch import LocalTokenDispatcher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=EP)
    local = EXPERTS // EP
    megatron = SimpleNamespace(ep_group=dist.group.WORLD, ep_size=EP, num_local_experts=local,
                               local_expert_indices=list(range(rank * local, (rank + 1) * local)))
    d = LocalTokenDispatcher(SimpleNamespace(moe_router_topk=TOP_K), megatron)
    x, probs, routing, grad = _data(rank)
    x, p = x.clone().requires_grad_(), probs.clone().requires_grad_()
    hx, hp = d.token_dispatch(*d.dispatch_preprocess(x, routing, p))
    hx, counts, hp = d.dispatch_postprocess(hx, hp)
    outs, start = [], 0
    for i, c in enumerate(counts.tolist()):  # the local experts, their rows grouped
        outs.append((hx[start:start + c] @ WEIGHTS[rank * local + i]) * hp[start:start + c].unsqueeze(-1))
        start += c
    y = d.combine_postprocess(d.token_combine(d.combine_preprocess(torch.cat(outs))))
    (y * grad).sum().backward()
    want_y, want_x, want_p = _reference(rank)
    row = json.dumps({"rank": rank, "counts": counts.tolist(), "y": float((y - want_y).abs().max()),
                      "x_grad": float((x.grad - want_x).abs().max()), "p_grad": float((p.grad - want_p).abs().max()),
                      "scale": float(want_y.abs().max())})
    # one write of one line (under PIPE_BUF): the two ranks share the pipe, and print's separate writes of the text
    # and its newline interleaved under load ('{..}{..}' on one line)
    os.write(1, (row + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(_worker, args=(int(sys.argv[1]),), nprocs=EP)
