"""One CPU rank (gloo): megatron's MoE layer as the workbench builds it, against a dense per-token reference.

For each case a one-layer ``moe-tiny`` GPT is built by the family's builder and its MoE layer run on random
hidden states; the reference loops over tokens: router logits (fp32), top-k (softmax over the k scores, or the
softmax over all experts first), the capacity (each expert keeps its ``capacity`` highest-probability tokens),
each chosen expert's SwiGLU MLP weighted by its probability, plus the shared experts.  Prints one JSON line per
case: the largest difference of outputs, and for the grouped-GEMM experts also of the gradients against
megatron's SequentialMLP with the same weights.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

from workbench import kernel_rule
from workbench.backend.distributed import initialize_for_tests
from workbench.rank.build import build_model
from workbench.config import preset

BASE = {"model.num_layers": 1, "model.moe.router_stats_interval": 0, "train.micro_batch_size": 3, "model.seq_length": 16,
        "model.init_method_std": 0.2}


def _cfg(**over):
    return preset("moe-tiny", **{**BASE, **over})


def _expert(x, fc1, fc2):
    gate, up = torch.chunk(x @ fc1.T, 2, dim=-1)
    return (F.silu(gate) * up) @ fc2.T


def reference(mlp, x, cfg):
    m = cfg.model.moe
    tokens = x.reshape(-1, x.shape[-1])
    n, E, k = tokens.shape[0], m.num_experts, m.top_k
    logits = tokens.float() @ mlp.router.weight.float().T
    chosen = []  # (token, expert, prob)
    for t in range(n):
        if m.router_pre_softmax:
            probs, idx = torch.topk(torch.softmax(logits[t], -1), k)
        else:
            top, idx = torch.topk(logits[t], k)
            probs = torch.softmax(top, -1)
        chosen += [(t, int(e), float(p)) for e, p in zip(idx, probs)]
    if m.capacity_factor is not None:
        cap = math.ceil(n * k / E * m.capacity_factor)
        kept = []
        for e in range(E):
            mine = sorted([c for c in chosen if c[1] == e], key=lambda c: -c[2])
            kept += mine[:cap]
        chosen = kept
    experts = mlp.experts.local_experts
    out = torch.zeros_like(tokens)
    for t, e, p in chosen:
        out[t] += p * _expert(tokens[t], experts[e].linear_fc1.weight, experts[e].linear_fc2.weight)
    if m.shared_experts:
        s = mlp.shared_experts
        out += _expert(tokens, s.linear_fc1.weight, s.linear_fc2.weight)
    return out.reshape(x.shape), len(chosen)


def layer(cfg):
    torch.manual_seed(7)
    model = build_model(cfg)
    return model.decoder.layers[0].mlp


CASES = {
    "top2-dropless-alltoall": {},
    "top2-dropless-allgather": {"model.moe.token_dispatcher": "allgather"},
    "top1-pre-softmax": {"model.moe.top_k": 1, "model.moe.router_pre_softmax": True},
    "top3-pre-softmax": {"model.moe.top_k": 3, "model.moe.router_pre_softmax": True},
    "top2-capacity-0.5": {"model.moe.capacity_factor": 0.5},
    "top2-capacity-0.5-allgather": {"model.moe.capacity_factor": 0.5, "model.moe.token_dispatcher": "allgather"},
    "top2-capacity-0.5-padded": {"model.moe.capacity_factor": 0.5, "model.moe.pad_to_capacity": True},
    "top2-shared-expert": {"model.moe.shared_experts": 1, "model.moe.shared_expert_ffn_hidden_size": 48},
}


def main() -> None:
    initialize_for_tests(_cfg(), port=int(sys.argv[1]))
    for name, over in CASES.items():
        cfg = _cfg(**over)
        mlp = layer(cfg).eval()
        x = torch.randn(cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size)
        with torch.no_grad():
            got, _ = mlp(x)
            want, kept = reference(mlp, x, cfg)
        print(json.dumps({"case": name, "experts": type(mlp.experts).__name__, "max_diff": float((got - want).abs().max()),
                          "scale": float(want.abs().max()), "kept": kept,
                          "asked": x.shape[0] * x.shape[1] * cfg.model.moe.top_k}), flush=True)
    # the grouped-GEMM experts (the kernel rule's torch_grouped: fast paths allowed on CPU) against SequentialMLP
    kernel_rule.allow_fast_paths_on_cpu(True)
    for name, over in {"grouped-dropless": {}, "grouped-capacity": {"model.moe.capacity_factor": 0.5},
                       "grouped-shared-expert": {"model.moe.shared_experts": 1}}.items():
        cfg_g = _cfg(**{"train.compile_kernels": True, **over})
        cfg_s = _cfg(**{"train.compile_kernels": True, "model.moe.grouped_gemm": False, **over})
        grouped, seq = layer(cfg_g).train(), layer(cfg_s).train()
        seq.load_state_dict(grouped.state_dict())
        x = torch.randn(cfg_g.model.seq_length, cfg_g.train.micro_batch_size, cfg_g.model.hidden_size)
        outs, grads = [], []
        for mlp in (grouped, seq):
            xi = x.clone().requires_grad_()
            y, _ = mlp(xi)
            y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(3)))
            outs.append(y.detach())
            grads.append([xi.grad] + [p.grad for _, p in sorted(mlp.named_parameters()) if p.grad is not None])
        print(json.dumps({"case": name, "experts": [type(grouped.experts).__name__, type(seq.experts).__name__],
                          "dispatch": [type(grouped.token_dispatcher).__name__, type(seq.token_dispatcher).__name__],
                          "max_diff": float((outs[0] - outs[1]).abs().max()),
                          "grad_diff": max(float((a - b).abs().max()) for a, b in zip(*grads)),
                          "grads": [len(g) for g in grads]}), flush=True)
    # the grouped experts adding their weight gradients into main_grad themselves (main_grad_direct, as
    # grad_accumulation.install_experts sets it under DDP): two micro-batches' sums equal autograd's .grad.  main_grad
    # as separate tensors (the foreach path) and as views of one flat buffer, the weights in reverse order with a gap
    # after each (megatron DDP's layout, one distance apart: the strided path)
    cfg_g = _cfg(**{"train.compile_kernels": True})
    xs = [torch.randn(cfg_g.model.seq_length, cfg_g.train.micro_batch_size, cfg_g.model.hidden_size) for _ in range(2)]
    plain = layer(cfg_g).train()
    for xi in xs:
        y, _ = plain(xi)
        y.square().sum().backward()
    wanted = [p.grad for n, p in plain.experts.named_parameters() if "local_experts" in n]
    for case, flat in (("grouped-main-grad-direct", False), ("grouped-main-grad-direct-strided", True)):
        direct = layer(cfg_g).train()
        weights = [p for n, p in direct.experts.named_parameters() if "local_experts" in n]
        if flat:
            buf, at = torch.zeros(sum(w.numel() + 8 for w in weights)), 0
            for w in reversed(weights):
                w.main_grad, at = buf[at:at + w.numel()].view_as(w), at + w.numel() + 8
        else:
            for w in weights:
                w.main_grad = torch.zeros_like(w, dtype=torch.float32)
        direct.experts.main_grad_direct = True
        path = direct.experts.main_grad_path()
        for xi in xs:
            y, _ = direct(xi)
            y.square().sum().backward()
        print(json.dumps({"case": case, "weights": len(weights), "path": path,
                          "grads_left": sum(w.grad is not None for w in weights),
                          "max_diff": max(float((w.main_grad - g).abs().max()) for w, g in zip(weights, wanted)),
                          "scale": max(float(g.abs().max()) for g in wanted)}), flush=True)
    kernel_rule.allow_fast_paths_on_cpu(False)
    # the parameters the builder makes are the ones the planner counts (workbench.config.derive)
    from workbench.config import derive

    for name, over in {"params-every-layer": {"model.num_layers": 2},
                       "params-shared-every-2nd": {"model.num_layers": 4, "model.moe.layer_freq": 2, "model.moe.shared_experts": 2,
                                                   "model.moe.shared_expert_gate": True}}.items():
        cfg = _cfg(**over)
        model = build_model(cfg)
        print(json.dumps({"case": name, "built": sum(p.numel() for p in model.parameters()),
                          "derived": derive(cfg).params.total}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
