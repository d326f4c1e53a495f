"""Model construction: RunConfig -> megatron-core ``TransformerConfig`` + layer spec + ``GPTModel``.

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

Kernel paths (recorded in the ``run_start`` event via :func:`kernel_path`):
- attention: Transformer Engine when importable (``auto``/``te``), else the workbench SDPA
  module (:mod:`workbench.backend.attention`); stock mcore ``DotProductAttention`` only on
  ``attention_backend: local``.
- norm: TE norm with the TE spec; otherwise apex ``FusedLayerNorm`` when apex is importable
  (LayerNorm only), else the workbench SP-capable norms (:mod:`workbench.backend.norms`).
- linear layers: TE with the TE spec, else megatron's Column/RowParallelLinear.
- fusions: whatever :mod:`workbench.backend.fusions` (performance helper) selects, if present.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from workbench.backend.attention import SDPAttention
from workbench.backend.norms import WorkbenchNorm
from workbench.config import RunConfig, derive, pipeline_stage_layers

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
HAVE_APEX = importlib.util.find_spec("apex") is not None

__all__ = [
    "WorkbenchTransformerConfig",
    "transformer_config",
    "layer_spec",
    "block_spec",
    "build_model",
    "kernel_path",
    "attention_impl",
    "SELECTIVE_RECOMPUTE",
    "RecomputedMLP",
    "HAVE_TE",
    "HAVE_APEX",
]


#: What ``parallel.recompute: selective`` recomputes on this workbench.  Stock Megatron's
#: default (``core_attn``) saves nothing with SDPA/flash attention, which keeps no s x s
#: scores.  Instead we recompute the dense MLP in backward (inside the compiled dense layer's
#: graph, see ``fusions.dense_layer_forward``; on the stock layer :class:`RecomputedMLP`): its
#: fc1 output and activation output (2 x ffn values per token, e.g. 8h for GELU -- the
#: largest activations of a layer) are dropped and rebuilt from the saved MLP input; the
#: attention block's activations are kept.  mcore's own ``recompute_modules=["mlp"]`` is
#: not used: with linear biases it returns the fc2 bias *parameter* from a checkpointed
#: function, which gives the parameter a grad_fn and recurses without end in backward
#: (measured: unbounded memory growth); and its "layernorm" recompute takes the fp8 path
#: without TE (``CheckpointWithoutOutput``: ``self.fp8 = fp8 is not None``).  With the TE
#: spec selective recompute keeps Megatron's default (core attention).
SELECTIVE_RECOMPUTE = "mlp (fc1 + activation rebuilt in backward)"


class _DropGPTDeprecation(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("GPTModel IS DEPRECATED")


_gpt_logger = logging.getLogger("megatron.core.models.gpt.gpt_model")
if not any(isinstance(f, _DropGPTDeprecation) for f in _gpt_logger.filters):
    _gpt_logger.addFilter(_DropGPTDeprecation())


@dataclass
class WorkbenchTransformerConfig(TransformerConfig):
    """mcore's TransformerConfig plus the switches of workbench-only features."""

    #: ALiBi position bias inside :class:`SDPAttention` (megatron-core has none).
    workbench_alibi: bool = False
    #: selective recompute of the dense MLP (:class:`RecomputedMLP`).
    workbench_recompute_mlp: bool = False
    #: parallel.tp_comm_overlap on the compiled layer (:func:`fusions.sink_weight_gradients`).
    workbench_tp_comm_overlap: bool = False


class RecomputedMLP(MLP):
    """mcore's MLP (same parameters and names) that can recompute itself in backward.

    With ``config.workbench_recompute_mlp`` the forward runs under megatron's
    ``tensor_parallel.checkpoint`` and returns ``(output + bias, None)``: the bias is added
    inside the checkpointed function so no parameter is ever returned from it.
    """

    def forward(self, hidden_states, per_token_scale=None, **kwargs):  # noqa: D102
        if not (self.config.workbench_recompute_mlp and self.training and torch.is_grad_enabled()):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        from megatron.core import tensor_parallel

        def run(x):
            out, bias = MLP.forward(self, x, per_token_scale=per_token_scale, **kwargs)
            return out + bias if bias is not None else out

        return tensor_parallel.checkpoint(run, False, hidden_states), None


def attention_impl(cfg: RunConfig) -> str:
    """Which core attention this config gets: 'te', 'sdpa' or 'local'."""
    backend = cfg.model.attention_backend
    if backend == "auto":
        return "te" if HAVE_TE and cfg.model.position_embedding != "alibi" and cfg.parallel.device == "cuda" else "sdpa"
    if backend == "te" and not HAVE_TE:
        raise ValueError("model.attention_backend is 'te' but transformer_engine is not importable; use 'auto' or 'sdpa'")
    return backend


def _dtype(cfg: RunConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.train.precision]


def _fusion_overrides(cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(TransformerConfig overrides, kernel-path notes) from the performance helper's module, if any."""
    try:
        from workbench.backend import fusions  # owned by the performance helper
    except ImportError:
        return {}, {}
    fn = getattr(fusions, "transformer_config_overrides", None)
    if fn is None:
        return {}, {}
    overrides = dict(fn(cfg) or {})
    notes = {k: v for k, v in overrides.items() if "fusion" in k}
    return overrides, notes


def _layer_module(cfg: RunConfig) -> type:
    """[perf hook] The TransformerLayer class: fusions' compiled dense layer when ``train.compile_kernels`` (CUDA)."""
    try:
        from workbench.backend import fusions  # owned by the performance helper
    except ImportError:
        return TransformerLayer
    return getattr(fusions, "layer_module", lambda _cfg: TransformerLayer)(cfg)


def transformer_config(cfg: RunConfig, **overrides: Any) -> WorkbenchTransformerConfig:
    """The mcore TransformerConfig for a RunConfig (parallel sizes, dtypes, recompute, kernels)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dtype = _dtype(cfg)
    cpu = p.device == "cpu"
    kwargs: dict[str, Any] = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        kv_channels=m.head_dim,
        normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else (partial(F.gelu, approximate="tanh") if getattr(m, "gelu_approximate", "none") == "tanh" else F.gelu),
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_parallel if p.vpp > 1 else None,
        sequence_parallel=p.sequence_parallel,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=cpu,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        masked_softmax_fusion=False,  # needs apex; the SDPA path does not use it anyway
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=not cpu,
        # Pipeline p2p: plain isend/irecv, never batch_isend_irecv.  mcore's batched path ends
        # every exchange with torch.cuda.synchronize() (batch_p2p_sync, a workaround for old
        # PyTorch): ~2 device syncs per micro-batch, so the host can never run ahead of a
        # stage and the GPU idles during every launch gap.  Measured on 2 H200s before this:
        # PP=2, m=8 at 1.36x of one GPU against an ideal 1.78x.  Interleaved 1F1B also
        # mixed up activations and gradients with batched p2p at PP=2 (both neighbours are
        # the same rank; grad norm 1e7), so it overlaps its plain p2p as Megatron-LM does.
        # gloo (CPU mode) has no batched isend/irecv either: one code path everywhere.
        overlap_p2p_comm=(not cpu) and p.vpp > 1,
        batch_p2p_comm=False,
        workbench_alibi=m.position_embedding == "alibi",
        workbench_tp_comm_overlap=p.tp_comm_overlap and p.tensor_parallel > 1,
    )
    stage_layers = pipeline_stage_layers(cfg)
    if len(set(stage_layers)) > 1:  # parallel.pipeline_split: balanced (middle stages share the rest evenly)
        kwargs.update(num_layers_in_first_pipeline_stage=stage_layers[0], num_layers_in_last_pipeline_stage=stage_layers[-1])
    if p.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=p.recompute_num_layers)
    elif p.recompute == "selective":
        if attention_impl(cfg) == "te":
            kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        else:
            kwargs.update(workbench_recompute_mlp=True)
    fusion_kwargs, _ = _fusion_overrides(cfg)
    kwargs.update(fusion_kwargs)
    kwargs.update(overrides)
    return WorkbenchTransformerConfig(**kwargs)


def _norm_impl(cfg: RunConfig) -> tuple[Any, str]:
    if HAVE_APEX and cfg.model.normalization == "layernorm" and cfg.parallel.device == "cuda":
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm, "apex FusedLayerNorm"
    name = "RMSNorm" if cfg.model.normalization == "rmsnorm" else "LayerNorm"
    return WorkbenchNorm, f"workbench {name} (torch.nn.functional, SP-capable)"


def layer_spec(cfg: RunConfig) -> ModuleSpec:
    """The transformer-layer spec: TE spec when TE is chosen, else megatron linears + workbench attention/norms.

    The ``sharded_state_dict_keys_map`` is stock megatron's, so checkpoints are interchangeable
    between the local and the TE spec.
    """
    impl = attention_impl(cfg)
    if impl == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    norm, _ = _norm_impl(cfg)
    core = SDPAttention if impl == "sdpa" else DotProductAttention
    if impl == "local" and not cfg.parallel.sequence_parallel and cfg.parallel.device == "cuda" and not HAVE_APEX:
        # the stock spec as-is (torch norms) when the user asked for stock behaviour
        return get_gpt_layer_local_spec(normalization="RMSNorm" if cfg.model.normalization == "rmsnorm" else "LayerNorm")
    return ModuleSpec(
        module=_layer_module(cfg),
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core,
                    linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=partial(RecomputedMLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def block_spec(cfg: RunConfig, config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Layer specs for this pipeline stage plus the final norm (the workbench's, so SP works)."""
    spec = layer_spec(cfg)
    if attention_impl(cfg) == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm: Any = TENorm
    else:
        final_norm, _ = _norm_impl(cfg)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=final_norm)


def build_model(
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
    model = GPTModel(
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
    if cfg.parallel.device == "cuda" and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def kernel_path(cfg: RunConfig) -> dict[str, str]:
    """What each kernel slot resolves to for this config (goes into the run_start event)."""
    impl = attention_impl(cfg)
    attn = {
        "te": "Transformer Engine DotProductAttention",
        "sdpa": "workbench SDPA (torch scaled_dot_product_attention" + (", ALiBi bias" if cfg.model.position_embedding == "alibi" else "") + ")",
        "local": "megatron-core DotProductAttention (unfused)",
    }[impl]
    norm = "Transformer Engine norm" if impl == "te" else _norm_impl(cfg)[1]
    out = {
        "attention": attn,
        "norm": norm,
        "linear": "Transformer Engine" if impl == "te" else "megatron Column/RowParallelLinear",
        "recompute": {"none": "none", "full": f"full (uniform, {cfg.parallel.recompute_num_layers} layer/block)",
                      "selective": "selective: " + ("core_attn (TE)" if impl == "te" else SELECTIVE_RECOMPUTE)}[cfg.parallel.recompute],
    }
    _, fusion_notes = _fusion_overrides(cfg)
    out["fusions"] = ", ".join(f"{k}={v}" for k, v in fusion_notes.items() if v) or "none"
    return out
