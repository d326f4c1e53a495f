"""The compiled dense layer: one ``torch.compile``'d function per transformer layer, its CUDA graphs, and the
compiled cross-entropy, for megatron-core when Transformer Engine and apex are absent (the usual case).

Where stock megatron-core (local spec, no TE/apex) loses time against a compiled plain-PyTorch GPT, and what this
module does about it -- every change keeps the training maths (same ops, same dtypes, no skipped work):

1. **One compiled function per transformer layer** (:class:`CompiledTransformerLayer`, put in the layer spec by
   :mod:`workbench.backend.model` when ``train.compile_kernels`` is on and the device is CUDA).  Eagerly, a megatron
   layer is ~40 kernel launches with Python between each and every element-wise op makes its own pass over HBM.  On
   the dense path (GPT's causal self-attention, BERT's padding-masked bidirectional one, T5's relative-position bias
   and cross-attention, rotary embeddings, GELU / GEGLU / SwiGLU / ReLU, hidden and attention dropout on megatron's
   RNG streams) the layer's forward runs as one ``torch.compile``'d free function of its parameters (norms fuse with
   the residual adds, biases with GEMM epilogues; backward is one compiled graph too), shared by all layers (guarded
   on shapes).  The parameters are the layer's own; gradients reach them through autograd, so mcore DDP's hooks,
   buffers and overlap are untouched.  With tensor parallelism the graph holds the TP collectives exactly where
   Column/RowParallelLinear put them (all-reduce, or all-gather / reduce-scatter under sequence parallelism), so CUDA
   graphs capture the whole layer.  ``parallel.tp_comm_overlap``: the backward's collectives under the weight-gradient
   GEMMs (:func:`workbench.backend.tp_overlap.sink_weight_gradients`); ``parallel.tp_chunked``: each GEMM in two row
   chunks (:mod:`workbench.backend.tp_chunked`).  The kernel rule's ``wgrad_fused``: the GEMM weights' gradients go into
   megatron DDP's ``main_grad`` in their GEMMs; its ``triton_ops``: SwiGLU (:mod:`workbench.backend.glu`) and the QKV
   split + rotary + GQA repeat (:mod:`workbench.backend.qkv_rope`) as hand-written Triton kernels.
   Any other case (ALiBi, a KV cache, packed sequences, ...) falls back to the stock forward.  Dropout's random
   numbers come from torch's generator inside the graph (inductor's philox; under CUDA graphs each replay reads the
   generator's seed and offset and advances it), so the checkpointed RNG state (``checkpointing.rng_state``) carries
   the stream.
2. **Cross-entropy at TP=1** (:func:`prepare_model`, :mod:`workbench.backend.cross_entropy`): instead of megatron's
   vocab-parallel cross entropy (~10 passes over the fp32 up-cast logits), ``F.cross_entropy(logits.float())``
   compiled, or with ``triton_ops`` a Triton op that reads the bf16 logits once each way.

The other fast paths live beside it: the optimizer's (:mod:`workbench.backend.optimizer_paths`) and megatron's
fused switches for the stock forward (:func:`workbench.backend.model.transformer_config_overrides`).

CUDA graphs (``train.cuda_graphs``, :func:`graphs_wanted`): the whole step where the kernel rule says ``step``
(:mod:`workbench.backend.step_graph`), else the compiled layers' cudagraph trees; TE's layer replays as megatron's
own per-layer graphs (``cuda_graph_impl: local``; :class:`workbench.backend.model.GraphedTransformerLayer`).
FP8 is opt-in (``train.fp8``, :mod:`workbench.backend.fp8`): the compiled layer's GEMMs only.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Iterable, Optional

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from megatron.core import tensor_parallel
from torch.distributed import _functional_collectives as funcol
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from workbench import kernel_rule
from workbench.backend.attention import sdpa_mask
from workbench.backend.layer_rules import MASK_TYPES, activation_name, eps_of, fast_path_blocker, norm_kind, softmax_scale
from workbench.backend.fp8 import cached as fp8_cached, close_step as fp8_close_step, linear as fp8_linear, open_step as fp8_open_step
from workbench.backend.grad_accumulation import fused_weight
from workbench.backend.optimizer_paths import STATE as _STATE
from workbench.backend.tp_overlap import chunked_pass, enable_async_tp, tp_overlap_pass
from workbench.backend import cross_entropy, glu, qkv_rope, tp_chunked
_waited = tp_chunked.waited

__all__ = [
    "layer_module",
    "compiling",
    "CompiledTransformerLayer",
    "dense_layer_forward",
    "enable_async_tp",
    "fast_path_blocker",
    "prepare_model",
    "step_begin",
    "training_step",
    "graphs_wanted",
    "lm_cross_entropy",
    "set_compile",
    "allow_on_cpu",
    "summary",
]

#: When False the fast paths still run, but eagerly (CPU tests compare the maths; debugging).
_COMPILE = True


def allow_on_cpu(enabled: bool = True) -> None:
    """Tests: enable the fast paths for ``parallel.device: cpu`` too (they are GPU-only otherwise)."""
    kernel_rule.allow_fast_paths_on_cpu(enabled)


def set_compile(enabled: bool) -> None:
    """Run the fused paths compiled (default) or eagerly (same maths, for tests / debugging)."""
    global _COMPILE
    _COMPILE = bool(enabled)
    _compiled.cache_clear()


def compiling() -> bool:
    """Whether the fused paths run compiled (:func:`set_compile`)."""
    return _COMPILE


def summary() -> dict[str, str]:
    """What the fast paths (this module's and :mod:`workbench.backend.optimizer_paths`') switched on in this
    process, e.g. ``{"layer": "compiled dense layer", ...}``."""
    return dict(_STATE)


def _wanted(cfg: Any) -> bool:
    return kernel_rule.fast_paths_wanted(cfg)


# --------------------------------------------------------------------------- the layer's class


def layer_module(cfg: Any) -> type:
    """The TransformerLayer class the kernel rule picks for this config: compiled dense layer or stock."""
    return CompiledTransformerLayer if kernel_rule.choose(cfg).layer == "compiled" else TransformerLayer


# --------------------------------------------------------------------------- the dense layer


def _norm(x: torch.Tensor, kind: str, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    if kind == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# torch >= 2.12 names them *_single (the *_tensor names warn); 2.11 has only the old names
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _all_gather_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """All-gather along dim 0 (the sequence), waited."""
    return _waited(_all_gather(x.contiguous(), 0, group))


def _reduce_scatter_seq(x: torch.Tensor, group: str) -> torch.Tensor:
    """Sum-reduce-scatter along dim 0 (the sequence), waited."""
    return _waited(_reduce_scatter(x.contiguous(), "sum", 0, group))


def _all_reduce_sum(x: torch.Tensor, group: str) -> torch.Tensor:
    return _waited(funcol.all_reduce(x.contiguous(), "sum", group))


class _EnterTensorParallel(torch.autograd.Function):
    """Input of a column-parallel GEMM: megatron's ``copy_to`` / ``gather_from_sequence_parallel``.

    Forward: identity (all-gather along the sequence under SP); backward: all-reduce of the
    input gradient (reduce-scatter under SP).  Functional collectives, so ``torch.compile``
    keeps them inside the layer's graph (and CUDA graphs capture them).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str, sequence_parallel: bool) -> torch.Tensor:
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return _all_gather_seq(x, group) if sequence_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sequence_parallel:
            return _reduce_scatter_seq(grad, ctx.group), None, None
        return _all_reduce_sum(grad, ctx.group), None, None


class _LeaveTensorParallel(torch.autograd.Function):
    """Partial output of a row-parallel GEMM: megatron's ``reduce_from`` / ``reduce_scatter_to_sequence_parallel``.

    Forward: all-reduce (reduce-scatter along the sequence under SP); backward: identity
    (all-gather under SP).
    """

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: str, sequence_parallel: bool) -> torch.Tensor:
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return _reduce_scatter_seq(y, group) if sequence_parallel else _all_reduce_sum(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_all_gather_seq(grad, ctx.group) if ctx.sequence_parallel else grad), None, None


def _column_parallel_input(h: torch.Tensor, tp_group: Optional[str], sp: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM (unchanged without TP)."""
    return h if tp_group is None else _EnterTensorParallel.apply(h, tp_group, sp)


def _row_parallel_linear(h: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], tp_group: Optional[str], sp: bool,
                         fp8: Optional[str] = None) -> torch.Tensor:
    """``h @ w.T + bias``; with TP the partial product is reduced across ranks first and the
    (unsplit) bias added after, as megatron's RowParallelLinear does."""
    if tp_group is None:
        return fp8_linear(h, w, bias, fp8)
    return _row_parallel_sum(fp8_linear(h, w, None, fp8), bias, tp_group, sp)


def _row_parallel_sum(partial: torch.Tensor, bias: Optional[torch.Tensor], tp_group: Optional[str], sp: bool) -> torch.Tensor:
    """A row-parallel GEMM's partial product, reduced across the TP ranks, plus the bias."""
    y = partial if tp_group is None else _LeaveTensorParallel.apply(partial, tp_group, sp)
    return y if bias is None else y + bias


def _mlp_partial(h: torch.Tensor, fc1_w: torch.Tensor, fc1_b: Optional[torch.Tensor], fc2_w: torch.Tensor, activation: str,
                 fp8: Optional[str] = None) -> torch.Tensor:
    """fc1, activation, fc2 without its bias: this rank's partial MLP output."""
    return fp8_linear(_activate(fp8_linear(h, fc1_w, fc1_b, fp8), activation), fc2_w, None, fp8)


def _activate(z: torch.Tensor, activation: str) -> torch.Tensor:
    """SwiGLU / GEGLU on the [gate, up] halves (megatron's order; ``swiglu_triton``: :mod:`.glu`'s), ReLU, or GELU."""
    if activation == "swiglu_triton":
        return glu.swiglu(z, triton=True)
    if activation in ("swiglu", "geglu", "geglu_tanh"):
        gate, up = torch.chunk(z, 2, dim=-1)
        if activation == "swiglu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh" if activation == "geglu_tanh" else "none") * up
    if activation == "relu":
        return F.relu(z)
    return F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
    mask: Optional[torch.Tensor], bias: Optional[torch.Tensor], dropout: float = 0.0, bnsd: bool = False,
) -> torch.Tensor:
    """Core attention on ``[s, b, n, d]`` q and k / v with as many heads as q (GQA already expanded): the
    context ``[sq, b, n * d]``, masked as :class:`workbench.backend.attention.SDPAttention` masks (:func:`sdpa_mask`):

    ``mask``: megatron's boolean mask (True = masked out; ``[b, 1, 1, sk]`` keys or ``[b, 1, sq, sk]``);
    ``bias``: an additive score bias (T5's relative positions), masked positions set to -inf;
    ``causal``: top-left aligned when sq == sk (bottom-right otherwise), combined with either;
    ``dropout``: attention dropout on the probabilities (SDPA's ``dropout_p``, the current RNG stream);
    ``bnsd``: q, k, v come as ``[b, n, s, d]`` already (:mod:`workbench.backend.qkv_rope`'s op).
    """
    if not bnsd:  # (else already [b, n, s, d])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    sq, b = q.shape[2], q.shape[0]
    attn_mask, is_causal = sdpa_mask(None if mask is None else ~mask, bias, causal, sq, k.shape[2], q.device)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal, scale=scale)
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _ring_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                  mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Context parallelism's attention inside the compiled layer: this CP rank's ``[s_local, b, n, d]`` queries against
    the whole sequence's keys and values (``[s_local, b, n_kv, d]`` each), by
    :func:`workbench.backend.context_parallel.ring_attention` over megatron's CP group, as the stock layer's
    :class:`workbench.backend.attention.SDPAttention` runs it: GPT's implicit causal mask, or BERT's key padding
    (``mask [b, 1, 1, s_local]``, True = padded).  Returns the context ``[s_local, b, n * d]``.

    Outside the compiled graph (``torch.compiler.disable``, applied by :func:`_eager_in_graphs`: a graph break): the ring's point-to-point exchanges and
    its autograd function run eagerly between the layer's compiled pieces (norm, QKV and rotary before; output
    projection, residual and MLP after), whose backward graphs surround the ring's own backward."""
    from megatron.core import parallel_state

    from workbench.backend.context_parallel import key_padding, ring_attention

    sq, b = q.shape[0], q.shape[1]
    kv_padding = None
    if mask is not None and causal:  # as SDPAttention._ring: no family sends both
        raise NotImplementedError("context parallelism: a causal layer with a padding mask (padding_causal) is not wired")
    if mask is not None:
        kv_padding = key_padding(mask, b)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    out = ring_attention(q, k, v, parallel_state.get_context_parallel_group(), causal=causal, scale=scale,
                         kv_padding=kv_padding)
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _self_attention(
    h: torch.Tensor, qkv_w: torch.Tensor, qkv_b: Optional[torch.Tensor], *, heads: int, groups: int, head_dim: int,
    scale: float, causal: bool, mask: Optional[torch.Tensor], bias: Optional[torch.Tensor], rope: Optional[torch.Tensor],
    fp8: Optional[str] = None, dropout: float = 0.0, cp: bool = False, chunk: Optional[tuple] = None, triton: bool = False,
) -> torch.Tensor:
    """Fused QKV GEMM in megatron's layout (per KV group ``[q_1..q_{n/g}, k, v]``), then :func:`_sdpa`, or under
    context parallelism (``cp``) :func:`_ring_context` over the CP group.  ``chunk``: ``(rank, tp group)`` where the
    QKV GEMM gathers its sequence-parallel input itself (:func:`tp_chunked.column_linear`; ``h`` is the shard)."""
    qkv = fp8_linear(h, qkv_w, qkv_b, fp8) if chunk is None else tp_chunked.column_linear(h, qkv_w, qkv_b, *chunk)
    s, b, _ = qkv.shape
    per_group = heads // groups
    if triton and chunk is None and not cp and qkv_rope.applies(qkv, rope, head_dim):  # KernelChoice.triton_ops
        q, k, v = qkv_rope.rotate_split(qkv, rope, groups, per_group)
        return _sdpa(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias, dropout=dropout, bnsd=True)
    qkv = qkv.view(s, b, groups, (per_group + 2) * head_dim)
    q, k, v = qkv.split([per_group * head_dim, head_dim, head_dim], dim=3)
    q = qkv_rope.rotate(q.reshape(s, b, heads, head_dim), rope)
    k = qkv_rope.rotate(k, rope)
    if cp:  # the ring takes K/V per group (GQA) and gathers no more than it needs
        if bias is not None:
            raise NotImplementedError("context parallelism: the ring attention takes no additive bias (attention_bias)")
        return _ring_context(q, k, v, scale, causal, mask)
    if per_group > 1:
        k = k.repeat_interleave(per_group, dim=2)
        v = v.repeat_interleave(per_group, dim=2)
    return _sdpa(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias, dropout=dropout)


def _cross_attention(
    h: torch.Tensor, context: torch.Tensor, q_w: torch.Tensor, q_b: Optional[torch.Tensor], kv_w: torch.Tensor,
    kv_b: Optional[torch.Tensor], *, heads: int, head_dim: int, scale: float, mask: Optional[torch.Tensor],
    fp8: Optional[str] = None, dropout: float = 0.0,
) -> torch.Tensor:
    """megatron's ``CrossAttention``: q from ``h``, k / v from ``context`` (``linear_kv`` output viewed
    ``[sk, b, heads, 2 * d]`` and split in halves), no bias, not causal."""
    s, b, _ = h.shape
    q = fp8_linear(h, q_w, q_b, fp8).view(s, b, heads, head_dim)
    k, v = fp8_linear(context, kv_w, kv_b, fp8).view(context.shape[0], b, heads, 2 * head_dim).split(head_dim, dim=3)
    return _sdpa(q, k, v, scale=scale, causal=False, mask=mask, bias=None, dropout=dropout)


def _hidden_dropout(y: torch.Tensor, p: float, masks: Optional[tuple], i: int) -> torch.Tensor:
    """megatron's bias-dropout (before the residual add) of the ``i``-th sublayer's output ``y`` (bias included):
    ``F.dropout`` on the current RNG stream, or ``y * masks[i]`` with pre-drawn masks (:func:`draw_hidden_masks`)."""
    if masks is not None:
        return y * masks[i]
    return F.dropout(y, p, training=True) if p > 0 else y


def draw_hidden_masks(x: torch.Tensor, p: float, n: int) -> tuple:
    """``n`` hidden-dropout masks for a ``[s, b, h]`` layer, drawn as ``F.dropout`` draws its noise off CUDA
    (``bernoulli_(1 - p)`` in the activations' dtype, scaled by ``1 / (1 - p)``) on the current RNG stream."""
    return tuple(torch.empty_like(x).bernoulli_(1 - p).div_(1 - p) for _ in range(n))


def dense_layer_forward(
    x: torch.Tensor,
    ln1_w: torch.Tensor,
    ln1_b: Optional[torch.Tensor],
    qkv_w: torch.Tensor,
    qkv_b: Optional[torch.Tensor],
    proj_w: torch.Tensor,
    proj_b: Optional[torch.Tensor],
    ln2_w: torch.Tensor,
    ln2_b: Optional[torch.Tensor],
    fc1_w: torch.Tensor,
    fc1_b: Optional[torch.Tensor],
    fc2_w: torch.Tensor,
    fc2_b: Optional[torch.Tensor],
    mask: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    rope: Optional[torch.Tensor] = None,
    cross: Optional[tuple] = None,
    hidden_masks: Optional[tuple] = None,
    *,
    norm: str,
    eps1: float,
    eps2: float,
    heads: int,
    groups: int,
    head_dim: int,
    scale: float,
    activation: str,
    causal: bool = True,
    eps_cross: float = 0.0,
    tp_group: Optional[str] = None,
    sequence_parallel: bool = False,
    recompute_mlp: bool = False,
    fp8: Optional[str] = None,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    cp: bool = False,
    tp_chunk_rank: Optional[int] = None,
    triton: bool = False,
) -> torch.Tensor:
    """One pre-norm transformer layer on ``[s, b, h]``, with megatron's exact layouts and maths.

    megatron's fused QKV output is grouped per KV group: ``[q_1..q_{n/g}, k, v]`` for each of the g groups (see
    ``SelfAttention.get_query_key_value_tensors``).  Self-attention is SDPA, ``causal`` (GPT, T5's decoder) or not
    (BERT, T5's encoder), under megatron's boolean ``mask`` (True = masked out) and an additive score ``bias`` (T5's
    relative positions), with the rotary embedding ``rope`` (freqs ``[s, 1, 1, rot]``) applied to q and k.  ``cross``:
    T5's decoder cross-attention block between attention and MLP, ``(context, context_mask, norm_w, norm_b, q_w, q_b,
    kv_w, kv_b, proj_w, proj_b)``.  Biases of the output projections are added before the residual (megatron adds
    them in bias-dropout-add, which is the same sum).

    ``tp_group`` (a process-group name): this rank's shard of a tensor-parallel layer, with the TP collectives in the
    graph exactly where Column/RowParallelLinear put them (``x`` is the local sequence shard ``[s/tp, b, h]`` under
    ``sequence_parallel``).

    ``recompute_mlp`` (``parallel.recompute: selective``): only the MLP's input is kept for backward; fc1 and the
    activation (the layer's largest activations) are rebuilt there (a recompute tag on the graph's partition).

    ``fp8`` (``train.fp8``: ``tensorwise`` | ``rowwise`` | ``delayed``): every GEMM above in FP8
    (:mod:`workbench.backend.fp8`); norms, attention and residuals unchanged.

    Dropout, where megatron's layer has it: ``attention_dropout`` on the attention probabilities (SDPA's
    ``dropout_p``) and ``hidden_dropout`` on each sublayer's output (bias included) before its residual add, in
    megatron's order, from the current RNG stream; or the ``hidden_masks`` given (one per sublayer,
    :func:`draw_hidden_masks`) where the caller draws them on another stream.  Zero (eval) is the dropout-free layer.

    ``cp`` (``parallel.context_parallel`` > 1): ``x`` is this CP rank's load-balanced sequence shard and self-attention
    runs the ring over the CP group (:func:`_ring_context`, outside the graph); no attention bias, cross-attention or
    attention dropout (the config refuses them under CP).

    ``tp_chunk_rank`` (``parallel.tp_chunked``, TP = 2 + SP: this rank's index in the TP group): the attention and
    (without ``recompute_mlp``) MLP GEMMs in two row chunks (:mod:`workbench.backend.tp_chunked`).  ``triton``: the
    QKV split, rotary and GQA repeat as :mod:`workbench.backend.qkv_rope`'s op (``KernelChoice.triton_ops``).
    """
    sp, p, masks = sequence_parallel, hidden_dropout, hidden_masks
    x = attention_sublayer_forward(x, ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, mask, bias, rope, masks, norm=norm,
                                   eps1=eps1, heads=heads, groups=groups, head_dim=head_dim, scale=scale, causal=causal,
                                   tp_group=tp_group, sequence_parallel=sp, fp8=fp8, hidden_dropout=p,
                                   attention_dropout=attention_dropout, cp=cp, tp_chunk_rank=tp_chunk_rank,
                                   triton=triton)
    if cross is not None:
        y = _cross_attention_sublayer(x, cross, norm=norm, eps=eps_cross, heads=heads, head_dim=head_dim, scale=scale,
                                      tp_group=tp_group, sp=sp, fp8=fp8, dropout=attention_dropout)
        x = x + _hidden_dropout(y, p, masks, 1)
    if tp_chunk_rank is not None and not recompute_mlp:
        c = (tp_chunk_rank, tp_group)
        h = tp_chunked.column_linear(_norm(x, norm, ln2_w, ln2_b, eps2), fc1_w, fc1_b, *c)
        y = tp_chunked.row_linear(_activate(h, activation), fc2_w, *c)
        return x + _hidden_dropout(y if fc2_b is None else y + fc2_b, p, masks, -1)
    h_mlp = _column_parallel_input(_norm(x, norm, ln2_w, ln2_b, eps2), tp_group, sp)
    y = _mlp_sublayer(h_mlp, fc1_w, fc1_b, fc2_w, fc2_b, activation, tp_group, sp, fp8, recompute=recompute_mlp)
    return x + _hidden_dropout(y, p, masks, -1)


def attention_sublayer_forward(
    x: torch.Tensor,
    ln1_w: torch.Tensor,
    ln1_b: Optional[torch.Tensor],
    qkv_w: torch.Tensor,
    qkv_b: Optional[torch.Tensor],
    proj_w: torch.Tensor,
    proj_b: Optional[torch.Tensor],
    mask: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    rope: Optional[torch.Tensor] = None,
    hidden_masks: Optional[tuple] = None,
    *,
    norm: str,
    eps1: float,
    heads: int,
    groups: int,
    head_dim: int,
    scale: float,
    causal: bool = True,
    tp_group: Optional[str] = None,
    sequence_parallel: bool = False,
    fp8: Optional[str] = None,
    hidden_dropout: float = 0.0,
    attention_dropout: float = 0.0,
    cp: bool = False,
    tp_chunk_rank: Optional[int] = None,
    triton: bool = False,
) -> torch.Tensor:
    """The self-attention half of :func:`dense_layer_forward` (its arguments, the same maths): ``x`` plus the
    attention block's output (norm, QKV, SDPA, output projection with its bias, hidden dropout with the first of
    ``hidden_masks``).  Compiled alone for a mixture-of-experts layer, whose MLP half is megatron's own."""
    sp = sequence_parallel
    if tp_chunk_rank is not None:
        c = (tp_chunk_rank, tp_group)
        ctx = _self_attention(_norm(x, norm, ln1_w, ln1_b, eps1), qkv_w, qkv_b, heads=heads, groups=groups,
                              head_dim=head_dim, scale=scale, causal=causal, mask=mask, bias=bias, rope=rope,
                              dropout=attention_dropout, cp=cp, chunk=c)
        y = tp_chunked.row_linear(ctx, proj_w, *c)
        return x + _hidden_dropout(y if proj_b is None else y + proj_b, hidden_dropout, hidden_masks, 0)
    h_in = _column_parallel_input(_norm(x, norm, ln1_w, ln1_b, eps1), tp_group, sp)
    ctx = _self_attention(h_in, qkv_w, qkv_b, heads=heads, groups=groups, head_dim=head_dim, scale=scale,
                          causal=causal, mask=mask, bias=bias, rope=rope, fp8=fp8, dropout=attention_dropout, cp=cp,
                          triton=triton)
    return x + _hidden_dropout(_row_parallel_linear(ctx, proj_w, proj_b, tp_group, sp, fp8), hidden_dropout,
                               hidden_masks, 0)


def _cross_attention_sublayer(
    x: torch.Tensor, cross: tuple, *, norm: str, eps: float, heads: int, head_dim: int, scale: float,
    tp_group: Optional[str], sp: bool, fp8: Optional[str], dropout: float,
) -> torch.Tensor:
    """T5's decoder cross-attention block of :func:`dense_layer_forward` on the residual stream ``x``: its norm,
    :func:`_cross_attention` over the ``cross`` tuple's context and mask, and the output projection (bias
    included); the caller applies hidden dropout and the residual add."""
    context, context_mask, lnx_w, lnx_b, q_w, q_b, kv_w, kv_b, xproj_w, xproj_b = cross
    h_x = _column_parallel_input(_norm(x, norm, lnx_w, lnx_b, eps), tp_group, sp)
    ctx = _cross_attention(h_x, _column_parallel_input(context, tp_group, sp), q_w, q_b, kv_w, kv_b,
                           heads=heads, head_dim=head_dim, scale=scale, mask=context_mask, fp8=fp8, dropout=dropout)
    return _row_parallel_linear(ctx, xproj_w, xproj_b, tp_group, sp, fp8)


def _mlp_sublayer(
    h: torch.Tensor, fc1_w: torch.Tensor, fc1_b: Optional[torch.Tensor], fc2_w: torch.Tensor,
    fc2_b: Optional[torch.Tensor], activation: str, tp_group: Optional[str], sp: bool, fp8: Optional[str], *,
    recompute: bool,
) -> torch.Tensor:
    """The MLP block of :func:`dense_layer_forward` on its normed input ``h``: fc1, activation, fc2 (bias
    included, reduced across the TP ranks); the caller applies hidden dropout and the residual add.
    ``recompute`` (with grad enabled): only ``h`` is kept, :func:`_mlp_partial` is rebuilt in backward."""
    if recompute and torch.is_grad_enabled():
        partial = torch.utils.checkpoint.checkpoint(_mlp_partial, h, fc1_w, fc1_b, fc2_w, activation, fp8,
                                                    use_reentrant=False, preserve_rng_state=False)
        return _row_parallel_sum(partial, fc2_b, tp_group, sp)
    return _row_parallel_linear(_activate(fp8_linear(h, fc1_w, fc1_b, fp8), activation), fc2_w, fc2_b, tp_group, sp, fp8)


@functools.lru_cache(maxsize=None)
def _compiled(name: str, graphs: bool = False, tp_overlap: bool = False, async_tp: bool = False, chunked: bool = False):
    """The compiled piece ``name``; ``graphs``: replayed as CUDA graphs (cudagraph trees).

    With graphs, each call site in a step (layer i, micro-batch j, forward or backward) becomes one node of inductor's
    cudagraph tree, recorded once and replayed every step: the parameters are static inputs (marked in
    :func:`prepare_model`), a layer's input is the previous node's output, and :func:`step_begin` starts each path.

    ``tp_overlap`` (``parallel.tp_comm_overlap`` at TP > 1): the backward's collectives run under the weight-gradient
    GEMMs (:func:`workbench.backend.tp_overlap.sink_weight_gradients`); inductor's peak-memory reordering is off for
    this graph so it keeps that order (it would move the GEMMs back).

    ``async_tp`` (``parallel.async_tp``): inductor's micro-pipeline TP pass turns each sequence-parallel all-gather
    and its GEMM, and each GEMM and its reduce-scatter, into one ``symm_mem`` op that splits them per rank and
    pipelines the pieces (the TP group's symmetric memory: :func:`enable_async_tp`).

    ``chunked`` (``parallel.tp_chunked``): each exchange waited at its first use (``tp_overlap.sink_exchange_waits``).
    """
    fn = {"layer": dense_layer_forward, "attention": attention_sublayer_forward, "ce": cross_entropy.cross_entropy_sb}[name]
    if not _COMPILE:
        return fn
    import torch._dynamo

    _eager_in_graphs()

    # one graph serves every layer (guards are on shapes/dtypes); leave room for eval shapes
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 32))
    options: dict[str, Any] = {"triton.cudagraphs": True} if graphs else {}  # = mode="reduce-overhead"
    if tp_overlap or chunked:
        options.update({"reorder_for_peak_memory": False,
                        "post_grad_custom_post_pass": tp_overlap_pass() if tp_overlap else chunked_pass()})
    if async_tp:
        options["_micro_pipeline_tp"] = True
    return torch.compile(fn, dynamic=False, options=options or None)


#: what the compiled pieces call but dynamo must not trace (a graph break each): ``torch.compiler.disable`` applied at
#: the first compile, not at import (which would import torch's compiler in every process, CPU ones too)
_EAGER_IN_GRAPHS = ["_ring_context"]


def _eager_in_graphs() -> None:
    while _EAGER_IN_GRAPHS:
        name = _EAGER_IN_GRAPHS.pop()
        globals()[name] = torch.compiler.disable(globals()[name])


#: CUDA graphs for the compiled layer's training calls (set by :func:`prepare_model`).
_GRAPHS = False


def _piece(name: str, tp_overlap: bool = False, async_tp: bool = False, chunked: bool = False):
    """The compiled piece for this call: graph-replayed in training (grad on), plain otherwise."""
    return _compiled(name, _GRAPHS and torch.is_grad_enabled(), tp_overlap, async_tp, chunked)


def graphs_wanted(cfg: Any, config: Any = None) -> bool:
    """CUDA graphs for the compiled layers: what the kernel rule says (the decision a built model's ``config``
    carries, else the rule's now: :func:`workbench.kernel_rule.decided`), when compiling (not the eager test mode) on
    a process that sees a GPU."""
    return kernel_rule.decided(cfg, config).cuda_graphs_impl == "torch" and _COMPILE and torch.cuda.is_available()


def step_begin() -> None:
    """Mark the start of a training step / eval pass for the CUDA-graph trees (no-op without)."""
    if _GRAPHS:
        torch.compiler.cudagraph_mark_step_begin()


@contextlib.contextmanager
def training_step():
    """A training step's forward-backward: a new path through the CUDA-graph trees, and the weights
    fixed until it ends (``train.fp8``: each GEMM weight cast to FP8 once, not per micro-batch)."""
    step_begin()
    fp8_open_step()
    try:
        yield
    finally:
        fp8_close_step()


class CompiledTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer whose dense forward (+backward) is one compiled graph.

    Same submodules, parameters and checkpoint keys as :class:`TransformerLayer`; only
    ``forward`` differs (one graph, with the TP collectives inside at TP>1), and only when
    :func:`fast_path_blocker` finds nothing and the call is plain: self-attention causal (GPT),
    or under a padding mask (BERT, T5's encoder), with T5's relative-position ``attention_bias``,
    a rotary embedding, T5's cross-attention over ``context``; no KV cache, no packed sequences.
    Otherwise the stock forward runs.  Calls in eval mode (evaluation, generation) take the compiled
    path at the input shapes training used (one inference graph each); other shapes (prompts of any
    length) run the stock forward rather than compile a graph per length.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fast_path_blocker = fast_path_blocker(self)
        self._static: dict[str, Any] = {}
        if self.fast_path_blocker is None:
            c = self.config
            attn = self.self_attention
            self._static = dict(
                norm=norm_kind(self.input_layernorm),
                eps1=eps_of(self.input_layernorm),
                heads=attn.num_attention_heads_per_partition,
                groups=attn.num_query_groups_per_partition,
                head_dim=attn.hidden_size_per_attention_head,
                scale=softmax_scale(attn),
                causal=MASK_TYPES[attn.attn_mask_type],
                fp8=getattr(c, "workbench_fp8", None),
            )
            if getattr(getattr(c, "workbench_kernels", None), "triton_ops", False):
                self._static["triton"] = True  # the QKV op (SwiGLU's: in the activation's name)
                glu.register()  # the ops, before a compile traces their first use
                qkv_rope.register()
            if not self._moe:  # the dense MLP half's
                self._static.update(eps2=eps_of(self.pre_mlp_layernorm), activation=activation_name(c, kernels=True),
                                    recompute_mlp=bool(getattr(c, "workbench_recompute_mlp", False)))
            if self._cross:
                self._static["eps_cross"] = eps_of(self.pre_cross_attn_layernorm)
            if c.context_parallel_size > 1:  # the ring between the layer's compiled pieces
                self._static["cp"] = True
            if c.tensor_model_parallel_size > 1:  # the TP collectives go inside the layer's graph
                self._static.update(tp_group=attn.linear_qkv.tp_group.group_name, sequence_parallel=bool(c.sequence_parallel))
                if getattr(c, "workbench_tp_chunked", False):  # parallel.tp_chunked (the kernel rule checked TP = 2 + SP)
                    self._static["tp_chunk_rank"] = attn.linear_qkv.tp_group.rank()
            self._attention_dropout = float(attn.core_attention.dropout_p)
        #: parallel.tp_comm_overlap: backward collectives under the weight-gradient GEMMs
        self.tp_overlap = self.fast_path_blocker is None and "tp_group" in self._static \
            and bool(getattr(self.config, "workbench_tp_comm_overlap", False))
        #: parallel.tp_chunked: the GEMMs in two row chunks, each exchange under the other chunk's GEMM
        self.tp_chunked = "tp_chunk_rank" in self._static
        #: parallel.async_tp (the kernel rule's choice: TP > 1 with SP): the SP all-gathers / reduce-scatters
        #: micro-pipelined with their GEMMs
        self.async_tp = self.fast_path_blocker is None and "tp_group" in self._static \
            and bool(getattr(getattr(self.config, "workbench_kernels", None), "async_tp", False))
        if self.async_tp:
            enable_async_tp(self._static["tp_group"])
        #: the kernel rule's ``wgrad_fused``: GEMM weights' gradients into main_grad in their GEMMs (marked: no hook adds them)
        self.wgrad_fused = self.fast_path_blocker is None and not self._static["fp8"] and "tp_group" not in self._static \
            and bool(getattr(getattr(self.config, "workbench_kernels", None), "wgrad_fused", False))
        for linear in self._gemm_linears() if self.wgrad_fused else ():
            linear.weight._workbench_wgrad_fused = True
        self.fast_calls = 0  # observable: how many forwards took the compiled path

    def _gemm_linears(self) -> list:
        """The linear modules whose weights the compiled graph multiplies (``gemm_w`` in :meth:`forward`)."""
        attn, xa = self.self_attention, self.cross_attention
        return ([attn.linear_qkv, attn.linear_proj] + ([] if self._moe else [self.mlp.linear_fc1, self.mlp.linear_fc2])
                + ([xa.linear_q, xa.linear_kv, xa.linear_proj] if self._cross else []))

    @property
    def _cross(self) -> bool:
        return not isinstance(self.cross_attention, IdentityOp)

    @property
    def _moe(self) -> bool:
        """A mixture-of-experts layer: only its attention half is compiled (:func:`attention_sublayer_forward`)."""
        return bool(getattr(self, "is_moe_layer", False))

    _PLAIN_NONE = ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "inference_context", "packed_seq_params",
                   "sequence_len_offset", "inference_params", "padding_mask")
    #: input shapes (hidden states, masks, bias, context) of training calls: eval-mode calls at these shapes take the
    #: compiled path (one more graph per shape: grad mode is guarded), others the stock forward
    _TRAINED_SHAPES: set = set()

    def _call_is_plain(self, args: tuple, kwargs: dict) -> bool:
        if self.fast_path_blocker is not None or args or "hidden_states" not in kwargs:
            return False
        if any(kwargs.get(k) is not None for k in self._PLAIN_NONE):
            return False
        mask_type = self.self_attention.attn_mask_type
        if kwargs.get("attention_mask") is not None and mask_type in (AttnMaskType.causal, AttnMaskType.no_mask):
            return False  # a mask given to a causal layer replaces causality (SDPAttention's rule): stock
        if (kwargs.get("context") is not None) != self._cross:
            return False
        rope = kwargs.get("rotary_pos_emb")
        if isinstance(rope, tuple) and not (len(rope) == 2 and rope[0] is rope[1]):
            return False
        shape = tuple(None if kwargs.get(k) is None else tuple(kwargs[k].shape)
                      for k in ("hidden_states", "attention_mask", "attention_bias", "context", "context_mask"))
        if torch.is_grad_enabled() or self.training:  # training (megatron's full recompute runs forward without grad)
            self._TRAINED_SHAPES.add(shape)
            return True
        return shape in self._TRAINED_SHAPES

    def __call__(self, *args: Any, **kwargs: Any):
        out = super().__call__(*args, **kwargs)
        if self.config.cuda_graph_impl == "local" and isinstance(out, tuple) and isinstance(out[0], torch.Tensor) \
                and out[0]._base is not None:
            # megatron's graph manager hands its outputs back as views (its record step returns the eager output
            # through an autograd Function): pipeline parallelism frees stage outputs by swapping .data, which
            # views refuse.  The viewless alias shares the storage (no copy).
            out = (make_viewless_tensor(inp=out[0], requires_grad=out[0].requires_grad, keep_graph=True), *out[1:])
        return out

    def _should_call_local_cudagraph(self, *args: Any, **kwargs: Any) -> bool:
        """megatron's CUDA graphs (``cuda_graph_impl: local``, pipeline parallelism) replay training calls only:
        evaluation and generation run the compiled function without them."""
        return self.training and torch.is_grad_enabled() and super()._should_call_local_cudagraph(*args, **kwargs)

    def _bypassed_pre_hooks(self) -> None:
        """Run the forward pre-hooks of the submodules whose ``forward`` the compiled graph replaces, as their
        own call would: megatron's DDP finishes a parameter's all-gather there (``overlap_param_gather`` with the
        distributed optimizer), so the graph and the step's FP8 weight copies never read a stale shard."""
        subs = self.__dict__.get("_submodules")
        if subs is None:  # the layer's submodules, walked once (not a ``modules()`` walk every call)
            subs = self.__dict__["_submodules"] = [m for m in self.modules() if m is not self]
        for m in subs:
            if not m._forward_pre_hooks:
                continue
            for hid, hook in list(m._forward_pre_hooks.items()):
                if m._forward_pre_hooks_with_kwargs.get(hid):
                    hook(m, (), {})
                else:
                    hook(m, ())

    def forward(self, *args: Any, **kwargs: Any):
        if not self._call_is_plain(args, kwargs):
            if self.wgrad_fused and torch.is_grad_enabled():  # megatron's GEMMs write .grad: DDP's hook must add it
                for linear in self._gemm_linears():
                    linear.weight.grad_added_to_main_grad = False
            return super().forward(*args, **kwargs)
        x = kwargs["hidden_states"]
        self._bypassed_pre_hooks()
        attn, mlp = self.self_attention, self.mlp
        ln1, ln2 = self.input_layernorm, self.pre_mlp_layernorm
        rope = kwargs.get("rotary_pos_emb")
        mask = kwargs.get("attention_mask") if attn.attn_mask_type != AttnMaskType.no_mask else None
        cross = None
        context = kwargs.get("context")
        recipe = self._static["fp8"]

        def gemm_w(linear: torch.nn.Module):  # under FP8: the weight with this step's FP8 copies
            if self.wgrad_fused and self.training:  # (never with FP8: the kernel rule's)
                return fused_weight(linear.weight)
            return fp8_cached(linear.weight, recipe)

        # dropout in training mode (megatron's rule: eval has none).  megatron draws attention dropout on each TP
        # rank's stream (its tracker's fork) and hidden dropout on the default stream, the same on the TP ranks that
        # hold the same activations.  Under SP its block has forked already: one stream for both, as here.  Without
        # SP at TP > 1 the hidden masks are drawn here on the default stream and the graph runs forked.  At TP = 1
        # both draw from the current stream (one rank: no stream to keep apart from another's).
        p_hidden = float(self.hidden_dropout) if self.training else 0.0
        p_attn = self._attention_dropout if self.training else 0.0
        fork = p_attn > 0 and "tp_group" in self._static and not self._static["sequence_parallel"]
        masks = draw_hidden_masks(x, p_hidden, 3 if self._cross else 2) if fork and p_hidden > 0 else None
        if self._moe:
            return self._moe_forward(x, kwargs, mask, rope, gemm_w, masks, fork, p_hidden, p_attn), context
        if self._cross:
            xa, lnx = self.cross_attention, self.pre_cross_attn_layernorm
            cross = (context, kwargs.get("context_mask"), lnx.weight, getattr(lnx, "bias", None), gemm_w(xa.linear_q),
                     xa.linear_q.bias, gemm_w(xa.linear_kv), xa.linear_kv.bias, gemm_w(xa.linear_proj),
                     xa.linear_proj.bias)
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            out = _piece("layer", self.tp_overlap, self.async_tp, self.tp_chunked)(
                x,
                ln1.weight, getattr(ln1, "bias", None),
                gemm_w(attn.linear_qkv), attn.linear_qkv.bias,
                gemm_w(attn.linear_proj), attn.linear_proj.bias,
                ln2.weight, getattr(ln2, "bias", None),
                gemm_w(mlp.linear_fc1), mlp.linear_fc1.bias,
                gemm_w(mlp.linear_fc2), mlp.linear_fc2.bias,
                None if mask is None else mask.bool(),
                kwargs.get("attention_bias"),
                rope[0] if isinstance(rope, tuple) else rope,
                cross,
                masks,
                **self._static,
                hidden_dropout=p_hidden,
                attention_dropout=p_attn,
            )
        self.fast_calls += 1
        # pipeline parallelism frees stage outputs by swapping .data: they must not be views
        out = make_viewless_tensor(inp=out, requires_grad=out.requires_grad, keep_graph=True)
        return out, context

    def _moe_forward(self, x, kwargs, mask, rope, gemm_w, masks, fork, p_hidden, p_attn) -> torch.Tensor:
        """A mixture-of-experts layer: the attention half compiled, then megatron's own MLP half (pre-MLP norm,
        router, token dispatch, experts, bias-dropout-add: ``TransformerLayer._forward_mlp``)."""
        attn, ln1 = self.self_attention, self.input_layernorm
        with tensor_parallel.get_cuda_rng_tracker().fork() if fork else contextlib.nullcontext():
            h = _piece("attention", chunked=self.tp_chunked)(
                x, ln1.weight, getattr(ln1, "bias", None), gemm_w(attn.linear_qkv), attn.linear_qkv.bias,
                gemm_w(attn.linear_proj), attn.linear_proj.bias, None if mask is None else mask.bool(),
                kwargs.get("attention_bias"), rope[0] if isinstance(rope, tuple) else rope, masks, **self._static,
                hidden_dropout=p_hidden, attention_dropout=p_attn)
        self.fast_calls += 1
        return self._forward_mlp(h)


# --------------------------------------------------------------------------- cross entropy


def lm_cross_entropy(self: Any, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Drop-in for ``LanguageModule.compute_language_model_loss`` at TP=1 (bound per model instance; its
    ``_workbench_ce_triton``: :mod:`workbench.backend.cross_entropy`'s op, ``KernelChoice.triton_ops``)."""
    return _compiled("ce")(logits, labels, getattr(self, "_workbench_ce_triton", False))


# --------------------------------------------------------------------------- model hook


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def prepare_model(model_chunks: Iterable[torch.nn.Module], cfg: Any) -> dict[str, str]:
    """Per-model fast paths (called by the training loop after the model is built/wrapped).

    Binds the compiled cross-entropy on last-stage chunks at TP=1.  Returns what it did.
    """
    global _GRAPHS
    _GRAPHS = False  # per model: a process may build several (tests, benchmarks)
    notes: dict[str, str] = {}
    if not _wanted(cfg):
        return notes
    for chunk in model_chunks:
        gpt = _unwrap(chunk)
        if not getattr(gpt, "post_process", False) or not hasattr(gpt, "compute_language_model_loss"):
            continue
        c = gpt.config
        if c.tensor_model_parallel_size == 1 and getattr(c, "calculate_per_token_loss", False) is False:
            triton = gpt._workbench_ce_triton = kernel_rule.decided(cfg, c).triton_ops
            if triton:
                cross_entropy.register()  # (before a compile traces its first use)
            gpt.compute_language_model_loss = types.MethodType(lm_cross_entropy, gpt)
            notes["cross_entropy"] = ("Triton cross-entropy (workbench::cross_entropy: fp32 online log-softmax, one "
                                      "read of the logits each way)" if triton else
                                      "compiled F.cross_entropy (fp32 log-softmax)")
    layers = [m for chunk in model_chunks for m in _unwrap(chunk).modules() if isinstance(m, TransformerLayer)]
    if layers:
        choice = kernel_rule.decided(cfg, getattr(layers[0], "config", None))  # what the model was built with
        compiled = [m for m in layers if isinstance(m, CompiledTransformerLayer) and m.fast_path_blocker is None]
        if compiled:
            notes["layer"] = f"compiled dense layer ({len(compiled)}/{len(layers)} layers)"
            if moe := sum(m._moe for m in compiled):
                notes["layer"] += f", the attention half only in the {moe} MoE layers (their MLP half megatron's)"
            if compiled[0].config.tensor_model_parallel_size > 1:
                sp = " + sequence parallel" if compiled[0].config.sequence_parallel else ""
                notes["layer"] += f", one graph per layer with its TP collectives{sp}"
                if compiled[0].async_tp:
                    notes["layer"] += ", its all-gathers / reduce-scatters micro-pipelined with their GEMMs (async TP)"
                if compiled[0].tp_chunked:
                    notes["layer"] += ", its GEMMs in two row chunks, each exchange with the TP peer under the other chunk's GEMM"
                if compiled[0].tp_overlap:
                    notes["layer"] += ", backward collectives under the weight-gradient GEMMs"
                    if compiled[0]._static["fp8"]:
                        notes["layer"] += " (with FP8 in part: inductor fuses an FP8 operand into the norm backward)"
            if compiled[0]._static["fp8"]:
                from workbench.backend.fp8 import GEMMS, supported_here

                if (why_not := supported_here()) is not None:
                    raise RuntimeError(f"train.fp8: {why_not}; fix: train.fp8: off")
                notes["fp8"] = (f"FP8 GEMMs ({compiled[0]._static['fp8']} scaling, torch._scaled_mm) in the "
                                f"{len(compiled)}/{len(layers)} compiled layers: {GEMMS}")
                if fp8_note := choice.fp8_note:
                    notes["fp8"] += f"; {fp8_note}"
            if compiled[0].hidden_dropout or compiled[0]._attention_dropout:
                notes["layer"] += (f", dropout in the graph (hidden {compiled[0].hidden_dropout:g}, "
                                   f"attention {compiled[0]._attention_dropout:g})")
            if any(m._static.get("recompute_mlp") for m in compiled):
                notes["layer"] += ", MLP recomputed in backward inside the graph"
            if compiled[0].config.recompute_granularity == "full":
                notes["layer"] += ", under megatron's full recompute"
            _GRAPHS = graphs_wanted(cfg, compiled[0].config)
            if _GRAPHS:
                from torch._dynamo import mark_static_address

                # parameters are static graph inputs: the recorded graphs read them in place
                # (no copy per call); unguarded, so one compiled function serves all layers
                for layer in compiled:
                    for param in layer.parameters():
                        mark_static_address(param, guard=False)
                why = kernel_rule.step_graph_blocker(cfg) or "train-step hooks handed to the Trainer in Python"
                notes["cuda_graphs"] = ("compiled layers' forward+backward replayed as CUDA graphs (training steps; "
                                        f"not the whole step: {why})")
            elif choice.cuda_graphs_impl == "step":
                notes["cuda_graphs"] = kernel_rule.STEP_GRAPH_NOTE
            elif compiled[0].config.cuda_graph_impl == "local":
                notes["cuda_graphs"] = ("compiled layers' forward+backward replayed as megatron's CUDA graphs, one per "
                                        "layer and micro-batch in the pipeline schedule's order (recorded in the first step)")
            elif getattr(cfg.train, "cuda_graphs", False) and (why_off := choice.cuda_graphs_reason):
                notes["cuda_graphs_off"] = why_off
        else:
            why = next((m.fast_path_blocker for m in layers if isinstance(m, CompiledTransformerLayer)), "stock spec")
            notes["layer"] = f"stock megatron layer ({why})"
            if any(getattr(m, "config", None) is not None and m.config.cuda_graph_impl == "local" for m in layers):
                notes["cuda_graphs"] = ("layers' forward+backward replayed as megatron CUDA graphs (cuda_graph_impl local, "
                                        "TE's RNG tracker), recorded after the first steps")
            elif getattr(cfg.train, "cuda_graphs", False) and (why_off := choice.cuda_graphs_reason):
                notes["cuda_graphs_off"] = why_off
    _STATE.update(notes)
    return notes
