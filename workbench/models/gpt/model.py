"""GPT's megatron specs and builder: RunConfig -> layer spec -> ``GPTModel`` chunk.

Why ``GPTModel`` and not ``HybridModel``: megatron-core 0.19 logs that ``GPTModel`` is
deprecated in favour of ``HybridModel``.  We keep ``GPTModel`` deliberately because
(1) its parameter names (``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...) are the ones every
Megatron<->Hugging Face converter, the conversion helper and existing checkpoints use;
(2) it supports learned absolute positions (GPT-2) and tied embeddings directly, and
megatron's pipeline / VPP / dist-checkpoint paths are exercised most on it;
(3) ``HybridModel`` is built around a layer-pattern string for Mamba/attention hybrids
and renames the decoder layers, which would break (1) for a pure-attention GPT.
The deprecation line is filtered out by a narrowly scoped ``logging.Filter`` on
megatron's ``gpt_model`` logger (only that exact message; every other warning stays).

Every kernel slot (attention, layer class, norm) comes from :func:`workbench.kernel_rule.choose`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from workbench import kernel_rule
from workbench.backend.model import layer_class, norm_module, self_attention_layer_spec, transformer_config
from workbench.backend.moe_experts import moe_mlp
from workbench.backend.qk_norms import AllHeadsKNorm, AllHeadsQNorm
from workbench.config import RunConfig, derive
from workbench.families.common import moe

__all__ = ["layer_spec", "moe_layer_spec", "block_spec", "build"]


class _DropGPTDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("GPTModel IS DEPRECATED")


_gpt_logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
if not any(isinstance(f, _DropGPTDeprecation) for f in _gpt_logger.filters):
    _gpt_logger.addFilter(_DropGPTDeprecation())


def layer_spec(cfg: RunConfig, choice: Optional[kernel_rule.KernelChoice] = None) -> ModuleSpec:
    """The transformer-layer spec: TE's GPT spec when the rule picks TE, megatron's local spec for
    ``attention_backend: local``, else the workbench's causal self-attention layer
    (:func:`workbench.backend.model.self_attention_layer_spec`); q/k norms where ``model.qk_layernorm`` (per head, or
    over all heads at once where ``model.qk_norm_scope`` is ``all_heads``).
    ``choice``: the kernel rule's decision the model is built with (default: :func:`workbench.kernel_rule.choose`)."""
    choice = choice or kernel_rule.choose(cfg)
    qk = bool(cfg.model.qk_layernorm)
    if choice.attention == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = dataclasses.replace(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk), module=layer_class(choice))  # graphed for training where the rule says
        return _all_heads_qk_norms(cfg, spec)
    if choice.norm == "torch":
        # the stock spec as-is (torch norms) when the user asked for stock behaviour
        return _all_heads_qk_norms(cfg, get_gpt_layer_local_spec(
            normalization="RMSNorm" if cfg.model.normalization == "rmsnorm" else "LayerNorm", qk_layernorm=qk))
    spec = self_attention_layer_spec(cfg, choice, AttnMaskType.causal)
    return _all_heads_qk_norms(cfg, _with_qk_norms(spec, norm_module(cfg, choice), norm_module(cfg, choice))) if qk else spec


def _with_qk_norms(spec: ModuleSpec, q_norm: type, k_norm: type) -> ModuleSpec:
    """``spec`` with ``q_norm`` / ``k_norm`` as its attention's q and k norms (``self_attention.q_layernorm`` /
    ``k_layernorm``, megatron's ``qk_layernorm``)."""
    attn = spec.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, q_layernorm=q_norm, k_layernorm=k_norm))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))


def _all_heads_qk_norms(cfg: RunConfig, spec: ModuleSpec) -> ModuleSpec:
    """``spec`` with q/k RMSNorms over all heads at once (:mod:`workbench.backend.qk_norms`, OLMoE's) where
    ``model.qk_norm_scope`` is ``all_heads``; as it is otherwise (megatron's per-head norms)."""
    if not (cfg.model.qk_layernorm and cfg.model.qk_norm_scope == "all_heads"):
        return spec
    return _with_qk_norms(spec, AllHeadsQNorm, AllHeadsKNorm)


def moe_layer_spec(cfg: RunConfig, dense: ModuleSpec, choice: Optional[kernel_rule.KernelChoice] = None) -> ModuleSpec:
    """An MoE layer's spec: TE's GPT spec with experts (TE's grouped MLP where the kernel rule says) on TE's
    layer, else ``dense`` with megatron's ``MoELayer`` as its MLP (:func:`workbench.backend.moe_experts.moe_mlp`:
    the rule's experts).  The pre-MLP norm keeps its own checkpoint name, as on TE's MoE spec."""
    choice = choice or kernel_rule.choose(cfg)
    if choice.attention == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=cfg.model.moe.num_experts,
                                                          moe_grouped_gemm=choice.experts == "te_grouped",
                                                          qk_layernorm=bool(cfg.model.qk_layernorm))
        return _all_heads_qk_norms(cfg, dataclasses.replace(spec, module=layer_class(choice)))
    keys = {k: v for k, v in (dense.submodules.sharded_state_dict_keys_map or {}).items() if not k.startswith("pre_mlp")}
    subs = dataclasses.replace(dense.submodules, mlp=moe_mlp(choice.experts), sharded_state_dict_keys_map=keys)
    return dataclasses.replace(dense, submodules=subs)


def block_spec(cfg: RunConfig, config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Layer specs for this pipeline stage (MoE layers where :func:`workbench.families.common.moe.moe_layers` says) plus the
    final norm (the workbench's, so SP works); every kernel slot from the decision ``config`` carries."""
    choice = kernel_rule.decided(cfg, config)
    spec = layer_spec(cfg, choice)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    specs = [spec] * n
    if moe.is_moe(cfg):
        pattern, offset, expert = moe.moe_layers(cfg), get_transformer_layer_offset(config, vp_stage=vp_stage), moe_layer_spec(cfg, spec, choice)
        specs = [expert if pattern[offset + i] else spec for i in range(n)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm_module(cfg, choice))


def build(
    cfg: RunConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Optional[TransformerConfig] = None,
) -> GPTModel:
    """One megatron GPTModel chunk for this rank (parallel state must be initialised).

    ``pre_process``/``post_process``: whether this chunk holds the embedding / the output
    layer (first / last pipeline stage).  Vocab is padded via :func:`workbench.config.derive`.
    """
    config = config or transformer_config(cfg)
    m = cfg.model
    pos = {"learned": "learned_absolute", "rope": "rope", "alibi": "none"}[m.position_embedding]
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(cfg, config, vp_stage),
        vocab_size=derive(cfg).padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type=pos,
        rotary_percent=m.rotary_percent,
        rotary_base=int(m.rotary_base),
        vp_stage=vp_stage,
    )

