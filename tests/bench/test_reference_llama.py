"""bench/reference_llama.py is the workbench's Llama layout: the same weights give the same loss.

The workbench side is the real megatron-core GPTModel (stock layer, CPU, fp32) built by the backend
in a subprocess (megatron's parallel state is global); its weights are copied into the reference
(megatron's fused QKV rows are per KV group [q_1..q_{a/g}, k, v], the reference's [q | k | v]).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = r'''
import json, socket, sys
import torch
sys.path.insert(0, ".")
from bench.reference_llama import ReferenceLlama, spec_from_config
from bench.train_throughput import TINY_LLAMA
from workbench.backend import distributed
from workbench.rank import build as wm
from workbench.config import derive, preset


def to_reference(cfg, sd, regroup=True):
    """The workbench state dict in the reference's names and layout (regroup=False: QKV rows as they are)."""
    m = cfg.model
    a, g, d, h = m.num_attention_heads, m.query_groups, m.head_dim, m.hidden_size
    new = {"wte.weight": sd["embedding.word_embeddings.weight"], "norm_f.weight": sd["decoder.final_layernorm.weight"]}
    for i in range(m.num_layers):
        p, r = f"decoder.layers.{i}.", f"blocks.{i}."
        w = sd[p + "self_attention.linear_qkv.weight"]
        if regroup:  # [g, a/g + 2, d, h] -> q of every group, then k, then v
            w = w.view(g, a // g + 2, d, h)
            w = torch.cat([w[:, :a // g].reshape(a * d, h), w[:, a // g].reshape(g * d, h), w[:, a // g + 1].reshape(g * d, h)])
        new.update({r + "attn_norm.weight": sd[p + "self_attention.linear_qkv.layer_norm_weight"]
                    if p + "self_attention.linear_qkv.layer_norm_weight" in sd else sd[p + "input_layernorm.weight"],
                    r + "qkv.weight": w, r + "o_proj.weight": sd[p + "self_attention.linear_proj.weight"],
                    r + "mlp_norm.weight": sd[p + "mlp.linear_fc1.layer_norm_weight"]
                    if p + "mlp.linear_fc1.layer_norm_weight" in sd else sd[p + "pre_mlp_layernorm.weight"],
                    r + "gate_up.weight": sd[p + "mlp.linear_fc1.weight"], r + "down.weight": sd[p + "mlp.linear_fc2.weight"]})
    new["lm_head.weight"] = new["wte.weight"] if m.tie_embeddings else sd["output_layer.weight"]
    return new


with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
base = preset("tiny", **TINY_LLAMA, **{"model.rotary_base": 500000.0})
distributed.initialize_for_tests(base, port=port)
out = {}
for name, over in (("tied", {}), ("untied", {"model.tie_embeddings": False})):
    cfg = base.replace(**over)
    torch.manual_seed(0)
    wb = wm.build_model(cfg)
    wb = wb[0] if isinstance(wb, list) else wb
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off megatron's init (norms all ones, small weights): a mixed-up tensor shows
        for prm in wb.parameters():
            prm.add_(torch.randn(prm.shape, generator=noise) * 0.1)
    sd = {k: v for k, v in wb.state_dict().items() if "_extra_state" not in k}
    ref = ReferenceLlama(spec_from_config(cfg))
    ref.load_state_dict(to_reference(cfg, sd), strict=True)
    g = torch.Generator().manual_seed(2)
    b, s = 2, cfg.model.seq_length
    tok = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    lab = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    with torch.no_grad():
        wb_loss = wb(tok, pos, None, labels=lab).mean().item()
        ref_loss = ref(tok, lab).item()
        ref.load_state_dict(to_reference(cfg, sd, regroup=False), strict=True)  # the layout matters: a plain copy differs
        naive_loss = ref(tok, lab).item()
    out[name] = {"wb_loss": wb_loss, "ref_loss": ref_loss, "naive_loss": naive_loss,
                 "wb_params": sum(p.numel() for p in wb.parameters()), "ref_params": sum(p.numel() for p in ref.parameters()),
                 "derived_params": derive(cfg).params.total, "groups": cfg.model.query_groups,
                 "heads": cfg.model.num_attention_heads}
print("RESULT " + json.dumps(out))
'''


def test_reference_llama_is_the_workbench_llama():
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert set(r) == {"tied", "untied"}
    for name, c in r.items():
        assert 1 < c["groups"] < c["heads"], c  # grouped attention: the per-group QKV layout is exercised
        assert abs(c["ref_loss"] - c["wb_loss"]) <= 1e-5 * abs(c["wb_loss"]), (name, c)
        assert abs(c["naive_loss"] - c["wb_loss"]) > 1e-3, (name, c)  # the check can fail
        assert c["ref_params"] == c["wb_params"] == c["derived_params"], (name, c)
    assert r["untied"]["ref_params"] > r["tied"]["ref_params"]
