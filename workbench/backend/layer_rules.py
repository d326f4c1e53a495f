"""Which built layers the compiled dense layer (:mod:`workbench.backend.compiled_layer`) can serve, and the static facts
it reads off them: :func:`fast_path_blocker` (why a layer cannot take the compiled path; None when it can), the norm
kind and epsilon, the softmax scale, the activation, the attention mask types it implements.  The model-level
counterpart, decided before a model is built, is :func:`workbench.kernel_rule.layer_blocker`."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from workbench.backend.attention import SDPAttention
from workbench.kernel_rule import MOE_TP_BLOCKER

__all__ = ["fast_path_blocker", "MASK_TYPES", "norm_kind", "eps_of", "softmax_scale", "activation_name"]


def norm_kind(module: torch.nn.Module) -> Optional[str]:
    from workbench.backend.norms import WorkbenchLayerNorm, WorkbenchRMSNorm

    if isinstance(module, WorkbenchLayerNorm) or type(module) is torch.nn.LayerNorm:
        return "layernorm"
    if isinstance(module, WorkbenchRMSNorm) or type(module) is getattr(torch.nn, "RMSNorm", None):
        return "rmsnorm"
    return None


def eps_of(module: torch.nn.Module) -> float:
    return float(getattr(module, "eps"))


def _plain_mlp(mlp: torch.nn.Module) -> bool:
    """mcore's dense MLP, or the backend's RecomputedMLP (same maths when recompute is off)."""
    return type(mlp) is MLP or (isinstance(mlp, MLP) and type(mlp).__name__ == "RecomputedMLP")


MASK_TYPES = {AttnMaskType.causal: True, AttnMaskType.padding_causal: True, AttnMaskType.padding: False,
               AttnMaskType.no_mask: False}


def softmax_scale(attn: torch.nn.Module) -> float:
    """An attention module's softmax scale (its core attention's, default ``1/sqrt(d)``)."""
    return float(getattr(attn.core_attention, "softmax_scale", None) or attn.hidden_size_per_attention_head**-0.5)


def _attention_blocker(attn: torch.nn.Module, qkv: str) -> Optional[str]:
    """Why a self- (``qkv="linear_qkv"``) or cross-attention (``"linear_kv"``) module is not the dense path's."""
    kind = "cross-attention" if qkv == "linear_kv" else "QKV"
    if type(getattr(attn, qkv, None)) is not ColumnParallelLinear or (
            qkv == "linear_kv" and type(getattr(attn, "linear_q", None)) is not ColumnParallelLinear):
        return f"{kind} projection is not megatron's ColumnParallelLinear"
    if type(getattr(attn, "linear_proj", None)) is not RowParallelLinear:
        return "output projection is not megatron's RowParallelLinear"
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attn, name, None) is not None and not isinstance(getattr(attn, name), IdentityOp):
            return "QK layernorm"
    if getattr(attn.config, "attention_output_gate", False):
        return "gated attention"
    if not isinstance(attn.core_attention, SDPAttention):  # stock DotProductAttention stays stock ('local')
        return f"core attention {type(attn.core_attention).__name__}"
    if attn.attn_mask_type not in MASK_TYPES:
        return f"attention mask type {attn.attn_mask_type.name}"
    return None


def fast_path_blocker(layer: TransformerLayer) -> Optional[str]:
    """Why this layer cannot take the compiled dense path (None when it can).  A mixture-of-experts layer takes it
    for its attention half (:func:`attention_sublayer_forward`); its MLP half is megatron's."""
    c = layer.config
    cross = not isinstance(layer.cross_attention, IdentityOp)
    moe = bool(getattr(layer, "is_moe_layer", False))
    checks = [
        ((c.num_query_groups or c.num_attention_heads) < c.tensor_model_parallel_size, "fewer KV groups than TP ranks"),
        (c.context_parallel_size != 1 and cross, "context parallel with cross-attention"),
        (c.recompute_granularity == "selective", "selective recompute of core attention"),
        (bool(c.fp32_residual_connection), "fp32 residual connection"),
        (getattr(c, "workbench_alibi", False), "ALiBi"),
        (c.softmax_type != "vanilla", "non-vanilla softmax"),
        (bool(getattr(c, "layernorm_zero_centered_gamma", False)), "zero-centred gamma"),
        (getattr(c, "window_size", None) is not None, "sliding window"),
        (bool(getattr(c, "cpu_offloading", False)), "CPU offloading"),
        (bool(getattr(c, "fp8", None)) or bool(getattr(c, "fp4", None)), "fp8/fp4"),
        (float(getattr(c, "glu_linear_offset", 0.0) or 0.0) != 0.0, "GLU offset"),
        (getattr(c, "activation_func_clamp_value", None) is not None, "activation clamp"),
        (bool(c.rotary_interleaved) or bool(c.apply_rope_fusion) or bool(getattr(c, "multi_latent_attention", False)),
         "interleaved / fused / MLA rotary embedding"),
        (float(getattr(layer.self_attention, "_yarn_concentration_factor", 1.0) or 1.0) != 1.0, "YaRN rotary scaling"),
        (bool(getattr(c, "no_rope_freq", None)), "rotary embedding skipped on some layers (no_rope_freq)"),
        (moe and c.tensor_model_parallel_size > 1, MOE_TP_BLOCKER),
        (moe and cross, "mixture of experts with cross-attention"),
        (not moe and not _plain_mlp(layer.mlp), "non-dense MLP"),
    ]
    for bad, why in checks:
        if bad:
            return why
    why = _attention_blocker(layer.self_attention, "linear_qkv")
    if why is None and cross:
        why = _attention_blocker(layer.cross_attention, "linear_kv")
        if why is None and layer.cross_attention.attn_mask_type != AttnMaskType.padding:
            why = "cross-attention mask type other than padding"
        if why is None and softmax_scale(layer.cross_attention) != softmax_scale(layer.self_attention):
            why = "cross-attention softmax scale differs from self-attention's"
        if why is None and layer.cross_attention.core_attention.dropout_p != layer.self_attention.core_attention.dropout_p:
            why = "cross-attention dropout differs from self-attention's"
    if why is not None:
        return why
    if moe:  # the MLP half (pre-MLP norm, router, experts, bias-dropout-add) is megatron's _forward_mlp
        return None if norm_kind(layer.input_layernorm) else "norm is not the workbench / torch LayerNorm or RMSNorm"
    if type(layer.mlp.linear_fc1) is not ColumnParallelLinear or type(layer.mlp.linear_fc2) is not RowParallelLinear:
        return "MLP linears are not megatron's Column/RowParallelLinear"
    norms = [norm_kind(layer.input_layernorm), norm_kind(layer.pre_mlp_layernorm)]
    if cross:
        norms.append(norm_kind(layer.pre_cross_attn_layernorm))
    if None in norms or len(set(norms)) != 1:
        return "norm is not the workbench / torch LayerNorm or RMSNorm"
    if activation_name(c) is None:
        return "activation other than GELU / GEGLU / SwiGLU / ReLU"
    return None


def activation_name(c: Any, kernels: bool = False) -> Optional[str]:
    """'gelu' | 'gelu_tanh' | 'swiglu' | 'geglu' | 'geglu_tanh' | 'relu' for the activations the dense path
    implements, else None; with ``kernels``, 'swiglu_triton' for SwiGLU where the config's kernel rule runs it
    through the Triton ops (``KernelChoice.triton_ops``, :mod:`workbench.backend.glu`)."""
    if kernels and activation_name(c) == "swiglu" and getattr(getattr(c, "workbench_kernels", None), "triton_ops",
                                                               False):
        return "swiglu_triton"
    act = c.activation_func
    gelu = None
    if act is F.gelu:
        gelu = "tanh" if c.bias_activation_fusion else "none"  # megatron's fused bias-GELU is tanh
    elif isinstance(act, functools.partial) and act.func is F.gelu and not act.args:
        gelu = act.keywords.get("approximate", "none")
    if c.gated_linear_unit:
        if act is F.silu:
            return "swiglu"
        return {"none": "geglu", "tanh": "geglu_tanh"}.get(gelu) if gelu else None
    if act is F.relu:
        return "relu"
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(gelu) if gelu else None
