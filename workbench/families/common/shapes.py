"""The transformer stack's shape terms: parameter counts, Megatron FLOPs, and the planner's per-stage memory terms.

A stack of pre-norm transformer layers with an embedding and an output layer (GPT-2 and
Llama-style: learned/RoPE/ALiBi positions, LayerNorm/RMSNorm, GELU/SwiGLU, MHA/GQA/MQA, dense or
mixture-of-experts MLPs, tied or untied output layer).  These are GPT's shape terms as they stand
(``FAMILY.shapes`` of :mod:`workbench.families.gpt`); BERT and T5 start from them and add their heads
and stacks.  The planner (:mod:`workbench.planner`) and :func:`workbench.config.derive` call them through the family;
the kernel path argument ``kp`` is a :class:`workbench.kernel_rule.KernelChoice`.
Torch-free and config-free (configs are read by attribute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.families.common import moe_shapes

__all__ = ["param_counts", "layer_and_head_flops", "Shape", "shape", "stage_params", "layer_activation_terms",
           "layer_backward_transient", "logits_bytes", "largest_param_elements"]


def param_counts(cfg: Any, padded_vocab: int) -> dict[str, int]:
    """Parameters of the whole model: embedding (words + learned positions), one layer, final norm, untied output layer."""
    m = cfg.model
    h, d = m.hidden_size, m.head_dim
    a, g, f = m.num_attention_heads, m.query_groups, m.ffn_size
    bias = m.add_bias_linear
    norm = (2 * h) if m.normalization == "layernorm" else h
    qkv_out = d * (a + 2 * g)
    attn = h * qkv_out + (qkv_out if bias else 0) + a * d * h + (h if bias else 0)
    if getattr(m, "qk_layernorm", False) and getattr(m, "qk_norm_scope", "head") == "all_heads":
        attn += (a + g) * d  # RMSNorms over all query heads and all KV heads (OLMoE's)
    elif getattr(m, "qk_layernorm", False):  # per-head q and k norms (head_dim wide each)
        attn += 2 * d * (2 if m.normalization == "layernorm" else 1)
    fc1_out = 2 * f if m.activation == "swiglu" else f
    mlp = h * fc1_out + (fc1_out if bias else 0) + f * h + (h if bias else 0)
    per_layer = attn + mlp + 2 * norm
    layers = m.num_layers * per_layer
    n_moe = sum(moe_shapes.moe.moe_layers(cfg))
    if n_moe:  # MoE layers (model.moe): per_layer is the mean over the model's layers
        layers = (m.num_layers - n_moe) * per_layer + n_moe * moe_shapes.layer_params(cfg, attn, 2 * norm)[0]
        per_layer = round(layers / max(m.num_layers, 1))
    emb = padded_vocab * h + (m.max_position_embeddings * h if m.position_embedding == "learned" else 0)
    out = 0 if m.tie_embeddings else padded_vocab * h
    total = emb + layers + norm + out
    return dict(embedding=emb, per_layer=per_layer, final_norm=norm, output_layer=out, total=total)


def layer_and_head_flops(cfg: Any, padded_vocab: int) -> tuple[float, float]:
    """Megatron's two kinds of term, in units of ``12 * tokens * h^2`` FLOPs (forward + backward):
    one transformer layer ``(1 + g/a + s/h) * (d*a/h) + (f/h) * gate``, and the output layer
    with its loss ``V / (2 h)``."""
    m = cfg.model
    h, a, g = m.hidden_size, m.num_attention_heads, m.query_groups
    gate = 1.5 if m.activation == "swiglu" else 1.0
    mlp = (m.ffn_size / h) * gate
    frac = sum(moe_shapes.moe.moe_layers(cfg)) / max(m.num_layers, 1)
    if frac:  # MoE layers: top_k experts and the shared ones per token (moe_shapes.mlp_flops), mixed by their share
        mlp = (1 - frac) * mlp + frac * moe_shapes.mlp_flops(cfg)
    layer = (1 + g / a + m.seq_length / h) * (m.head_dim * a / h) + mlp
    return layer, padded_vocab / (2 * h)


# --------------------------------------------------------------------------- planner shapes


@dataclass(frozen=True)
class Shape:
    """The numbers the formulas need, computed once per config (micro-batch overridable)."""

    s: int
    b: int
    h: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    fc1_out: int
    vocab: int  # padded
    layers: int
    tp: int
    pp: int
    vpp: int
    dp: int
    m: int  # micro-batches per step
    sp: bool
    e: int  # bytes per activation element
    w: int  # bytes per weight element
    grad_bytes: int
    mixed: bool  # bf16/fp16 with fp32 master weights
    swiglu: bool
    layernorm: bool
    bias: bool
    rope: bool
    learned_pos: bool
    tied: bool
    hidden_dropout: bool
    attention_dropout: bool
    recompute: str
    recompute_num_layers: int
    dist_opt: bool
    max_pos: int
    relu: bool = False  # ReLU keeps only its output (fc2's input), not its input
    qk_norm: str = ""  # model.qk_layernorm: "head" (megatron's per-head norms), "all_heads" (OLMoE's), "" (none)
    offload: float = 0.0  # parallel.optimizer_cpu_offload: the share of the optimizer's shard kept in host memory
    head_rows: int = 0  # the positions of a sequence the LM head runs on in training (0: every one; BERT's masked ones)
    # mixture of experts (workbench.families.common.moe_shapes.shape_fields): share of MoE layers, experts, EP / ETP /
    # expert DP, top_k, a routed expert's and all shared experts' FFN sizes, capacity factor (0: dropless)
    moe_frac: float = 0.0
    experts: int = 0
    ep: int = 1
    etp: int = 1
    edp: int = 1
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    capacity_factor: float = 0.0


def shape(cfg: Any, d: Any, micro_batch: int | None = None) -> Shape:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    e = 4 if t.precision == "fp32" else 2
    return Shape(
        s=m.seq_length, b=micro_batch or t.micro_batch_size, h=m.hidden_size, heads=m.num_attention_heads,
        groups=m.query_groups, head_dim=m.head_dim, ffn=m.ffn_size,
        fc1_out=2 * m.ffn_size if m.activation == "swiglu" else m.ffn_size,
        vocab=d.padded_vocab_size, layers=m.num_layers, tp=p.tensor_parallel, pp=p.pipeline_parallel,
        vpp=p.vpp, dp=d.data_parallel, m=d.num_microbatches, sp=p.sequence_parallel, e=e, w=e,
        grad_bytes=4 if (t.grad_reduce_in_fp32 or t.precision == "fp32") else 2, mixed=t.precision != "fp32",
        swiglu=m.activation == "swiglu", layernorm=m.normalization == "layernorm", bias=m.add_bias_linear,
        rope=m.position_embedding == "rope", learned_pos=m.position_embedding == "learned", tied=m.tie_embeddings,
        hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0, recompute=p.recompute,
        recompute_num_layers=p.recompute_num_layers, dist_opt=p.distributed_optimizer, max_pos=m.max_position_embeddings,
        relu=m.activation == "relu", offload=p.offload_fraction,
        qk_norm=(getattr(m, "qk_norm_scope", "head") if getattr(m, "qk_layernorm", False) else ""),
        **moe_shapes.shape_fields(cfg),
    )


# --------------------------------------------------------------------------- parameters


def stage_params(cfg: Any, sh: Shape, d: Any) -> list[dict[str, int]]:
    """Parameters on one TP rank of each stage, split into where they live.

    Totals per stage come from ``derive().params_per_stage``; only the TP split is done here:
    norms, row-parallel biases (attention output, fc2) and learned positions are replicated
    on every TP rank, everything else is divided by ``t`` (vocab is padded so shards are equal).  MoE: the routers are
    replicated too, the routed experts split over EP x ETP (``experts``: this rank's, which the distributed optimizer
    shards over the expert data-parallel group; :mod:`workbench.families.common.moe_shapes`).
    """
    h, t = sh.h, sh.tp
    norm = (2 if sh.layernorm else 1) * h
    replicated_per_layer = 2 * norm + (2 * h if sh.bias else 0) + round(sh.moe_frac * sh.experts * h)
    word = sh.vocab * h
    pos = sh.max_pos * h if sh.learned_pos else 0
    out = []
    for r, total in enumerate(d.params_per_stage):
        layers = d.stage_layers[r]
        layer_part = layers * d.params.per_layer
        emb_word = word if r == 0 else 0
        emb_pos = pos if r == 0 else 0
        final_norm = d.params.final_norm if r == sh.pp - 1 else 0
        output = total - layer_part - emb_word - emb_pos - final_norm  # untied head or the tied copy on the last stage
        expert_total, experts = moe_shapes.stage_expert_params(cfg, sh, layers)
        sharded = (layer_part - layers * replicated_per_layer - expert_total) + emb_word + output
        per_rank = sharded // t + layers * replicated_per_layer + emb_pos + final_norm + experts
        out.append({
            "total": per_rank,
            "experts": experts,
            "layers": (layer_part - layers * replicated_per_layer - expert_total) // t + layers * replicated_per_layer + experts,
            "embedding": emb_word // t + emb_pos,
            "output_layer": output // t,
            "final_norm": final_norm,
            "vocab_padding": (sh.vocab - cfg.model.vocab_size) * h // t * ((1 if emb_word else 0) + (1 if output else 0)),
        })
    return out


# --------------------------------------------------------------------------- activations


def layer_activation_terms(sh: Shape, kp: Any) -> dict[str, float]:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one TP rank.

    Eager megatron layer (local spec linears + SDPA/TE attention or mcore's unfused one):

    ========================  ============================================  =========
    term                      tensor kept                                    bytes
    ========================  ============================================  =========
    norm1_input               layer input (saved by the norm)                e sbh / t_sp
    qkv_input                 norm output (saved by linear_qkv)              e sbh / t_sp
    qkv_output                q, k, v (views of the fused QKV output)        e sb(a+2g)d / t
    rope_qk                   rotated q, k copies (RoPE)                      e sb(a+g)d / t
    attention_output          context (SDPA output = linear_proj input)      e sb a d / t
    softmax_lse               flash log-sum-exp (fp32)                        4 b a s / t
    scores                    local: fp32 softmax + its bf16 copy             (4+e) a s^2 b / t
    causal_mask               local: bool [s, s] kept by masked_fill           s^2
    norm2_input / fc1_input   residual / pre-MLP norm output                  e sbh / t_sp each
    fc1_output                GELU / SwiGLU input (ReLU: none, it keeps       e sb f1 / t
                              only its output, fc2's input)
    act_output                fc2 input (SwiGLU on megatron's layer: +         e sb f / t (x3)
                              silu(gate), x_lin copy; compiled layer: x1)
    dropout_masks             hidden dropout (1 byte, when p > 0)             sbh / t_sp each
    norm_stats                mean / rstd (fp32)                              4-8 sb / t_sp each
    qk_norm_stats             per-head q/k norms: mean / rstd per head        4-8 sb(a+g) / t
    qk_norm_output            per-head q/k norms without RoPE: normed q, k     e sb(a+g)d / t
                              (RoPE's rotated copies replace them)
    qk_norm_all_heads         all-heads q/k RMSNorms (OLMoE's): the fp32      (4+e) sb(a+g)d / t
                              copy rms_norm keeps, the normed bf16 the          + 8 sb
                              weight's product keeps, rstd per token
    ========================  ============================================  =========

    ``t_sp`` is ``t`` with sequence parallelism, else 1.  Selective recompute drops the MLP
    intermediates (workbench RecomputedMLP) or, on the TE spec, core attention's kept
    tensors; ``recompute: full`` is handled by the caller.  The compiled dense layer (TP=1) lets Inductor's min-cut
    partitioner choose what to keep; measured on CPU it keeps the eager set above, except SwiGLU's two
    extra tensors (:func:`_act_tensors`).
    """
    s, b, h, t, e = sh.s, sh.b, sh.h, sh.tp, sh.e
    tok = s * b
    tsp = t if sh.sp else 1
    a_loc, g_loc = sh.heads / t, sh.groups / t
    d = sh.head_dim
    terms: dict[str, float] = {}
    terms["norm1_input"] = e * tok * h / tsp
    terms["qkv_input"] = e * tok * h / tsp
    terms["qkv_output"] = e * tok * (a_loc + 2 * g_loc) * d
    if sh.rope:
        terms["rope_qk"] = e * tok * (a_loc + g_loc) * d
    elif sh.groups != sh.heads:
        terms["gqa_query_copy"] = e * tok * a_loc * d  # q of a grouped layout is reshaped by copy
    terms["attention_output"] = e * tok * a_loc * d
    if kp.flash:
        terms["softmax_lse"] = 4 * b * a_loc * s
    else:
        if sh.groups != sh.heads:
            terms["kv_repeat"] = 2 * e * tok * a_loc * d
        probs = 4 + (e if e < 4 else 0)  # fp32 softmax output + the low-precision copy bmm keeps
        if sh.attention_dropout:
            probs += 1 + e
        terms["scores"] = probs * b * a_loc * s * s
        terms["causal_mask"] = s * s  # the bool mask masked_fill keeps, one per layer
    terms["norm2_input"] = e * tok * h / tsp
    terms["fc1_input"] = e * tok * h / tsp
    if not sh.relu:  # relu's backward reads its output, which fc2 keeps anyway: fc1's output is freed
        terms["fc1_output"] = e * tok * sh.fc1_out / t
    terms["act_output"] = e * tok * sh.ffn / t * _act_tensors(sh, kp)
    if sh.hidden_dropout:
        terms["dropout_masks"] = 2 * tok * h / tsp
    stat_bytes = 8 if sh.layernorm else 4  # per normalised row: fp32 mean and rstd (LayerNorm), rstd alone (RMSNorm)
    terms["norm_stats"] = 2 * stat_bytes * tok / tsp
    if sh.qk_norm == "head":  # megatron's q/k norms over each head: the norm's input is the QKV output's view
        terms["qk_norm_stats"] = stat_bytes * tok * (a_loc + g_loc)
        if not sh.rope:  # attention keeps the normed q, k (with RoPE it keeps the rotated copies instead)
            terms["qk_norm_output"] = e * tok * (a_loc + g_loc) * d
    elif sh.qk_norm == "all_heads":  # workbench.backend.qk_norms: rms_norm over an fp32 copy, then the weight
        terms["qk_norm_all_heads"] = (4 + e) * tok * (a_loc + g_loc) * d + 2 * 4 * tok
        if not sh.rope:
            terms["qk_norm_output"] = e * tok * (a_loc + g_loc) * d
    if sh.moe_frac:  # MoE layers' router, dispatched tokens, experts (workbench.families.common.moe_shapes)
        moe_shapes.apply_activation_terms(terms, sh, kp)

    if sh.recompute == "selective":
        if kp.selective == "mlp":
            # the workbench's RecomputedMLP: the checkpoint keeps the MLP input (fc1_input) and
            # rebuilds fc1's output and the activation in backward
            for k in ("fc1_output", "act_output"):
                terms.pop(k, None)
        else:
            # mcore's core-attention recompute (TE spec): q, k, v are the checkpoint's inputs
            for k in ("softmax_lse", "scores", "causal_mask", "kv_repeat"):
                terms.pop(k, None)
    return terms


def _act_tensors(sh: Shape, kp: Any) -> int:
    """``[s, b, ffn]`` tensors the activation keeps: SwiGLU on megatron's layer (mcore's glu) keeps silu(gate),
    the ``x_linear + offset`` copy and their product; the compiled layer keeps the product only (fc2's input;
    silu(gate) is rebuilt from the kept fc1 output in backward: Llama-1B shape on an H100, planner
    +15% with three, evidence/planner_1gpu_compiled_layer.jsonl)."""
    return 3 if sh.swiglu and kp.layer != "compiled" else 1


def layer_backward_transient(sh: Shape, kp: Any, assumptions: Any) -> float:
    """Extra bytes alive while one layer runs backward (besides what it keeps).

    The gradients of the largest intermediates (fc1 output and activation output) coexist
    with the saved tensors until the fc1 backward frees them; plus the fc1 weight gradient
    before mcore's DDP hook folds it into the main-grad buffer, plus the incoming and outgoing
    residual-stream gradients.
    """
    s, b, h, t, e = sh.s, sh.b, sh.h, sh.tp, sh.e
    tok = s * b
    tsp = t if sh.sp else 1
    grads = e * tok * (sh.fc1_out + sh.ffn) / t * assumptions.backward_overlap
    weight_grad = e * h * sh.fc1_out / t
    stream = 2 * e * tok * h / tsp
    recomputed = 0.0
    if sh.recompute == "selective" and kp.selective == "mlp":
        # the MLP intermediates are rebuilt for the layer in backward
        recomputed = e * tok * (sh.fc1_out + sh.ffn * _act_tensors(sh, kp)) / t
    return grads + weight_grad + stream + recomputed + moe_shapes.backward_transient(sh)


def logits_bytes(sh: Shape, kp: Any) -> tuple[float, float]:
    """(forward/backward peak of the logits + loss, bytes kept from forward to backward)."""
    tok = sh.s * sh.b
    vt = sh.vocab / sh.tp
    if kp.cross_entropy == "compiled":
        # F.cross_entropy(logits.float()) compiled: bf16 logits kept, fp32 work fused away
        kept = sh.e * tok * vt
        return kept + sh.e * tok * vt, kept
    if sh.e >= 4:
        kept = 4 * tok * vt  # .float() is a no-op: the softmax is computed in place
        return kept, kept
    kept = 4 * tok * vt  # fp32 softmax saved by the vocab-parallel cross entropy
    return kept + sh.e * tok * vt, kept  # + the bf16 logits (forward) / bf16 grad (backward)


def largest_param_elements(sh: Shape) -> float:
    """Elements of the largest parameter tensor on one TP rank (the word embedding / output layer,
    else the widest MLP or QKV weight): the largest block the optimizer's per-parameter tensors free."""
    qkv = sh.h * (sh.heads + 2 * sh.groups) * sh.head_dim
    return max(sh.vocab * sh.h, qkv, sh.h * sh.fc1_out, sh.ffn * sh.h) / sh.tp
