"""Backend model tests: the workbench GPT (SDPA attention, ALiBi, GQA, RoPE, norms) vs plain references.

Each test runs its megatron part in a fresh subprocess (gloo, CPU mode), because parallel
state and the CPU-mode patches are process-global and other test modules share this
pytest process.  The references below are written from the papers / the usual
formulas in plain PyTorch, independently of megatron-core.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable


def _run(code: str, timeout: int = 240, nproc: int = 1) -> dict:
    """Run ``code`` in a subprocess (or ``nproc`` via torch.multiprocessing) and return its last JSON line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([PY, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    return json.loads(lines[-1])


REFERENCE = r'''
import math, torch, torch.nn.functional as F

def alibi_slopes_ref(n):
    # Press et al. 2022: geometric sequence starting at 2^(-8/n); non-power-of-two n uses the
    # closest power of two plus every other slope of the doubled sequence.
    def p2(n):
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]
    if math.log2(n).is_integer():
        return p2(n)
    c = 2 ** math.floor(math.log2(n))
    return p2(c) + p2(2 * c)[0::2][: n - c]

def attention_ref(q, k, v, scale, causal=True, alibi=None, q_offset=0):
    # q: [sq, b, h, d], k/v: [sk, b, g, d] -> [sq, b, h*d]; explicit softmax, GQA by repeat.
    sq, b, h, d = q.shape
    sk, g = k.shape[0], k.shape[2]
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    s = torch.einsum("qbhd,kbhd->bhqk", q.double(), k.double()) * scale
    qpos = torch.arange(sq)[:, None] + q_offset
    kpos = torch.arange(sk)[None, :]
    if alibi is not None:
        s = s - torch.tensor(alibi, dtype=torch.double)[None, :, None, None] * (qpos - kpos).abs()[None, None]
    if causal:
        s = s.masked_fill(kpos > qpos, float("-inf"))
    p = s.softmax(-1)
    o = torch.einsum("bhqk,kbhd->qbhd", p, v.double())
    return o.reshape(sq, b, h * d).float()

def rope_ref(x, pos, base=10000.0):
    # x: [s, b, h, d]; rotate-half RoPE (GPT-NeoX / Llama layout)
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2).double() / d))
    ang = pos.double()[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    rot = torch.cat([-x2, x1], -1)
    return (x.double() * cos + rot * sin).float()

def gpt_ref(sd, cfg, tokens, labels):
    """Plain-PyTorch GPT forward from a megatron GPTModel state dict -> mean token loss."""
    m = cfg.model
    h, a, g = m.hidden_size, m.num_attention_heads, m.query_groups
    d = h // a
    b, s = tokens.shape
    x = sd["embedding.word_embeddings.weight"][tokens]  # [b, s, h]
    if m.position_embedding == "learned":
        x = x + sd["embedding.position_embeddings.weight"][torch.arange(s)][None]
    x = x.transpose(0, 1)  # [s, b, h]
    def norm(x, pre):
        if m.normalization == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.norm_epsilon) * sd[pre + ".weight"]
        return F.layer_norm(x, (h,), sd[pre + ".weight"], sd[pre + ".bias"], m.norm_epsilon)
    def lin(x, pre):
        y = x @ sd[pre + ".weight"].t()
        return y + sd[pre + ".bias"] if (pre + ".bias") in sd else y
    slopes = alibi_slopes_ref(a) if m.position_embedding == "alibi" else None
    for i in range(m.num_layers):
        L = f"decoder.layers.{i}."
        y = norm(x, L + "input_layernorm")
        qkv = lin(y, L + "self_attention.linear_qkv").view(s, b, g, (a // g + 2) * d)
        q, k, v = torch.split(qkv, [a // g * d, d, d], dim=-1)  # megatron: per group [q heads..., k, v]
        q = q.reshape(s, b, a, d)
        if m.position_embedding == "rope":
            pos = torch.arange(s)
            q, k = rope_ref(q, pos, m.rotary_base), rope_ref(k, pos, m.rotary_base)
        o = attention_ref(q, k, v, 1.0 / math.sqrt(d), alibi=slopes)
        x = x + lin(o, L + "self_attention.linear_proj")
        y = norm(x, L + "pre_mlp_layernorm")
        u = lin(y, L + "mlp.linear_fc1")
        if m.activation == "swiglu":
            u1, u2 = torch.chunk(u, 2, dim=-1)
            u = F.silu(u1) * u2
        else:
            u = F.gelu(u)
        x = x + lin(u, L + "mlp.linear_fc2")
    x = norm(x, "decoder.final_layernorm")
    w = sd["embedding.word_embeddings.weight"] if m.tie_embeddings else sd["output_layer.weight"]
    logits = (x @ w.t()).transpose(0, 1)  # [b, s, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)).item()
'''


def test_alibi_slopes_match_the_paper():
    from workbench.backend.attention import alibi_slopes

    # 8 heads: the paper's 1/2, 1/4, ..., 1/256
    assert alibi_slopes(8).tolist() == pytest.approx([2.0 ** -(i + 1) for i in range(8)])
    # 12 heads: 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of the 16-head sequence)
    want = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert alibi_slopes(12).tolist() == pytest.approx(want)


def test_sdpa_attention_matches_reference_causal_gqa_alibi_decode():
    res = _run(REFERENCE + r'''
import json, torch
from workbench.config import preset
from workbench.backend import distributed
from workbench.backend.attention import SDPAttention
from workbench.run.files import free_port
from workbench.backend.model import transformer_config
from megatron.core.transformer.enums import AttnMaskType
out = {}
for name, heads, groups, alibi in [("mha", 4, 4, False), ("gqa", 8, 2, False), ("mqa_alibi", 6, 1, True), ("gqa_alibi", 8, 4, True)]:
    cfg = preset("tiny", **{"model.num_attention_heads": heads, "model.hidden_size": heads * 8,
                            "model.attention_type": "grouped", "model.num_query_groups": groups,
                            "model.position_embedding": "alibi" if alibi else "learned"})
    if name == "mha":
        distributed.initialize_for_tests(cfg, port=free_port())
    tc = transformer_config(cfg)
    att = SDPAttention(tc, 1, AttnMaskType.causal, "self").eval()
    torch.manual_seed(0)
    s, b, d = 7, 2, 8
    q, k, v = torch.randn(s, b, heads, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    slopes = alibi_slopes_ref(heads) if alibi else None
    full = att(q, k, v, None)
    ref = attention_ref(q, k, v, 1 / math.sqrt(d), alibi=slopes)
    # KV-cache decode: one query at the last position attends to all keys (mask type no_mask)
    last = att(q[-1:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
    ref_last = attention_ref(q[-1:], k, v, 1 / math.sqrt(d), causal=False, alibi=slopes, q_offset=s - 1)
    # explicit boolean mask (True = masked), e.g. document boundaries
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    mask[4:, :4] = True
    masked = att(q, k, v, mask[None, None].expand(b, 1, s, s), attn_mask_type=AttnMaskType.arbitrary)
    qq, kk, vv = q.double(), k.repeat_interleave(heads // groups, 2).double(), v.repeat_interleave(heads // groups, 2).double()
    sc = torch.einsum("qbhd,kbhd->bhqk", qq, kk) / math.sqrt(d)
    if alibi:
        pos = torch.arange(s)
        sc = sc - torch.tensor(slopes, dtype=torch.double)[None, :, None, None] * (pos[:, None] - pos[None]).abs()[None, None]
    ref_masked = torch.einsum("bhqk,kbhd->qbhd", sc.masked_fill(mask, float("-inf")).softmax(-1), vv).reshape(s, b, -1).float()
    out[name] = [float((full - ref).abs().max()), float((last - ref_last).abs().max()), float((masked - ref_masked).abs().max()),
                 float((full[-1:] - last).abs().max())]
print(json.dumps(out))
''')
    for name, errs in res.items():
        assert max(errs) < 1e-5, (name, errs)


def test_model_forward_matches_plain_reference():
    """gpt2-like (learned, LayerNorm, GELU, biases, tied), llama-like (RoPE, RMSNorm, SwiGLU, GQA, untied), ALiBi+MQA."""
    res = _run(REFERENCE + r'''
import json, torch
from workbench.config import preset
from workbench.backend import distributed
from workbench.rank.build import build_model
from workbench.run.files import free_port
variants = {
    "gpt2": {},
    "llama": {"model.position_embedding": "rope", "model.normalization": "rmsnorm", "model.activation": "swiglu",
              "model.attention_type": "grouped", "model.num_query_groups": 2, "model.add_bias_linear": False,
              "model.tie_embeddings": False},
    "alibi_mqa": {"model.position_embedding": "alibi", "model.attention_type": "multiquery"},
}
out = {}
for i, (variant, over) in enumerate(variants.items()):
    cfg = preset("tiny", **{"data.source": "synthetic", "model.num_layers": 2, **over})
    if i == 0:
        distributed.initialize_for_tests(cfg, port=free_port())
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg).eval()
    sd = {k: v.detach().float() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
    with torch.no_grad():
        ours = model(tokens, torch.arange(32)[None].expand(2, -1), None, labels=labels).mean().item()
    out[variant] = {"ours": ours, "ref": gpt_ref(sd, cfg, tokens, labels), "names": sorted(n for n, _ in model.named_parameters())}
print(json.dumps(out))
''')
    for variant, r in res.items():
        assert abs(r["ours"] - r["ref"]) < 1e-4 * abs(r["ref"]), (variant, r["ours"], r["ref"])
        # stock megatron parameter names (the converters rely on them)
        assert "decoder.layers.0.self_attention.linear_qkv.weight" in r["names"]
        assert "decoder.layers.1.mlp.linear_fc2.weight" in r["names"]
        assert "decoder.final_layernorm.weight" in r["names"]
        assert ("output_layer.weight" in r["names"]) == (variant == "llama")


TP_WORKER = r'''
import json, os, sys, torch
import torch.multiprocessing as mp

def worker(rank, world, q, port):
    from workbench.config import preset
    from workbench.backend import distributed
    from workbench.rank.build import build_model
    res = []
    for sp in ([False, True] if world > 1 else [False]):
        cfg = preset("tiny", **{"model.num_layers": 2, "parallel.tensor_parallel": world, "parallel.nproc_per_node": world,
                                "parallel.sequence_parallel": sp, "model.position_embedding": "rope",
                                "model.attention_type": "grouped", "model.num_query_groups": 2})
        if not sp:
            os.environ["LOCAL_RANK"] = str(rank)
            distributed.initialize_for_tests(cfg, rank=rank, world_size=world, port=port)
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg)
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(1, cfg.model.vocab_size, (2, 64), generator=g)
        loss = model(tokens, torch.arange(64)[None].expand(2, -1), None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        # SP: the norms' grads are partial per TP rank; megatron all-reduces params flagged sequence_parallel
        norm = model.decoder.layers[0].input_layernorm.weight
        grad = norm.grad.clone()
        if getattr(norm, "sequence_parallel", False):
            torch.distributed.all_reduce(grad)
        res.append({"sp": sp, "loss": float(loss), "grad": grad.tolist(), "sp_flag": bool(getattr(norm, "sequence_parallel", False))})
    q.put((rank, res))
    distributed.destroy()

if __name__ == "__main__":
    from workbench.run.files import free_port
    for world in map(int, sys.argv[1:]):  # each world's result on its own line, in order
        if world == 1:  # in this process (its group is torn down before the next world's ranks start)
            import queue
            q = queue.Queue()
            worker(0, 1, q, free_port())
            print(json.dumps([q.get()[1]]), flush=True)
        else:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_port()  # one rendezvous port for the world's ranks
            procs = [ctx.Process(target=worker, args=(r, world, q, port)) for r in range(world)]
            [p.start() for p in procs]
            res = sorted((q.get(timeout=200) for _ in procs), key=lambda r: r[0])
            [p.join() for p in procs]
            print(json.dumps([r[1] for r in res]), flush=True)
'''


def _tp_run(tmp_path, *worlds: int) -> list:
    """TP_WORKER at each world size in turn, in one script run (world 1 in its process, then the ranks of the next):
    per world, per rank, the results."""
    script = tmp_path / "tp_worker.py"
    script.write_text(TP_WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([PY, str(script), *map(str, worlds)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240 * len(worlds))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("[")]
    assert len(lines) == len(worlds), proc.stdout[-2000:]
    return lines


def test_tp2_and_tp2_sp_forward_backward_match_tp1(tmp_path):
    (one,), ranks = _tp_run(tmp_path, 1, 2)
    one = one[0]
    ref = one["loss"]
    assert ref > 1.0
    for per_rank in ranks:
        for res in per_rank:  # SP off, SP on
            assert abs(res["loss"] - ref) < 1e-5 * ref, (ref, res["sp"], res["loss"])
            # the reduced norm grad equals TP=1's (with SP only because the params are flagged)
            for a, b in zip(one["grad"], res["grad"]):
                assert abs(a - b) < 1e-5 + 1e-4 * abs(a), (res["sp"], a, b)
            assert res["sp_flag"] == res["sp"]
