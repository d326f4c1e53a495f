"""Megatron-LM's own memory formula (``theoretical_memory_usage``), re-derived, for comparison with the plan."""

from __future__ import annotations

from workbench.config import RunConfig, derive
from workbench.planner.plan import MegatronEstimate

__all__ = ["megatron_theoretical_memory"]


def megatron_theoretical_memory(cfg: RunConfig) -> MegatronEstimate:
    """Megatron-LM's ``report_theoretical_memory`` for this config, in bytes.

    Re-derived from ``megatron/training/theoretical_memory_usage.py`` (dense GPT, no MoE/MTP):
    weights+optimizer = params of the most loaded shard (1/pp of the layers + the embedding,
    + the untied output layer when pp == 1) / tp x (18 bytes, or 6 + 12/dp with the
    distributed optimizer).  Activations: with SP *and* selective recompute it uses
    Korthikanti's Table 2, ``sbh (18 + 4 f/h)`` per layer over all layers (/ t), else
    ``sbh (10 + 24/t)`` per layer with a 5% margin; both add the embedding terms for ``pp``
    micro-batches, scale by the interleaving penalty or ``min(1, m/pp)``, and add the output
    layer only when pp == 1.  It models the first pipeline stage, whatever the rank.
    """
    m, p = cfg.model, cfg.parallel
    d = derive(cfg)
    h, L, V = m.hidden_size, m.num_layers, d.padded_vocab_size
    a, g = m.num_attention_heads, m.query_groups
    tp, pp, dp = p.tensor_parallel, p.pipeline_parallel, d.data_parallel
    s, b = m.seq_length, cfg.train.micro_batch_size
    gated = 1.5 if m.activation == "swiglu" else 1.0
    norm = 1 if m.normalization == "rmsnorm" else 2
    qproj = m.head_dim * a / h
    attn = 2 * h * h * ((1 + g / a) * qproj)
    per_layer = 2 * h * (m.ffn_size * gated + norm) + attn
    emb = h * V
    block = per_layer * L + norm * h
    shard = (block / pp + emb) / tp
    if not m.tie_embeddings and pp == 1:
        shard += emb / tp
    bytes_per_param = (6 + 12 / dp) if p.distributed_optimizer else 18
    weights = shard * bytes_per_param

    vpp = p.virtual_pipeline_parallel if p.vpp > 1 else None
    micro = d.num_microbatches

    def schedule_factor(x: float) -> float:
        if vpp is not None:
            x *= 1 + (pp - 1) / (pp * vpp)
        elif pp > 1:
            x *= min(1, micro / pp)
        return x

    if p.sequence_parallel and p.recompute == "selective":
        formula = "table2_sp_selective"
        act = s * b * h * (18 + 4 * (m.ffn_size / h)) * L
        act += 8 * s * b * pp + s * b * h * pp
        act = schedule_factor(act)
        if pp == 1:
            act += s * b * h * 4 * (1 + V / h)
        act /= tp
    else:
        formula = "without_sp"
        act = s * b * h * (10 + 24 / tp) * L
        act += 8 * s * b * pp + s * b * h * pp
        act = schedule_factor(act)
        if pp == 1:
            act += (s * b * V / tp + s * b * h) * 2
        act *= 1.05
    return MegatronEstimate(int(weights), int(act), int(weights + act), formula)
