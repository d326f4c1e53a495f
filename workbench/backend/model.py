"""The building blocks every family builds its model from: RunConfig -> megatron-core ``TransformerConfig``,
and the kernel slots of the one kernel rule.

- :func:`transformer_config`: the mcore TransformerConfig (sizes, parallel layout, dtypes,
  recompute, p2p settings) for any family.
- :func:`layer_class` / :func:`norm_module`: the transformer-layer class and the norm module for
  a :class:`workbench.kernel_rule.KernelChoice` (the compiled dense layer or megatron's
  TransformerLayer; TE / apex / the workbench's SP-capable norms).
- :func:`self_attention_layer_spec`: a pre-norm self-attention + MLP layer on the rule's kernels.
- :func:`kernel_path`: what each kernel slot resolves to, for the ``run_start`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from workbench import kernel_rule
from workbench.backend import compiled_layer
from workbench.backend.attention import SDPAttention
from workbench.backend.norms import WorkbenchNorm
from workbench.config import RunConfig, pipeline_stage_layers
from workbench.kernel_rule import SELECTIVE_RECOMPUTE
from workbench.families import family_of

__all__ = [
    "WorkbenchTransformerConfig",
    "transformer_config",
    "transformer_config_overrides",
    "layer_class",
    "norm_module",
    "self_attention_layer_spec",
    "kernel_path",
    "attention_impl",
    "SELECTIVE_RECOMPUTE",
    "RecomputedMLP",
]


#: What ``parallel.recompute: selective`` recomputes on this workbench.  Stock Megatron's
#: default (``core_attn``) saves nothing with SDPA/flash attention, which keeps no s x s
#: scores.  Instead we recompute the dense MLP in backward (inside the compiled dense layer's
#: graph, see ``compiled_layer.dense_layer_forward``; on the stock layer :class:`RecomputedMLP`): its
#: fc1 output and activation output (2 x ffn values per token, e.g. 8h for GELU -- the
#: largest activations of a layer) are dropped and rebuilt from the saved MLP input; the
#: attention block's activations are kept.  mcore's own ``recompute_modules=["mlp"]`` is
#: not used: with linear biases it returns the fc2 bias *parameter* from a checkpointed
#: function, which gives the parameter a grad_fn and recurses without end in backward
#: (measured: unbounded memory growth); and its "layernorm" recompute takes the fp8 path
#: without TE (``CheckpointWithoutOutput``: ``self.fp8 = fp8 is not None``).  With the TE
#: spec selective recompute keeps Megatron's default (core attention).  The name lives in
#: :data:`workbench.kernel_rule.SELECTIVE_RECOMPUTE`.


@dataclass
class WorkbenchTransformerConfig(TransformerConfig):
    """mcore's TransformerConfig plus the switches of workbench-only features."""

    #: ALiBi position bias inside :class:`SDPAttention` (megatron-core has none).
    workbench_alibi: bool = False
    #: selective recompute of the dense MLP (:class:`RecomputedMLP`).
    workbench_recompute_mlp: bool = False
    #: parallel.tp_comm_overlap on the compiled layer (:func:`workbench.backend.tp_overlap.sink_weight_gradients`).
    workbench_tp_comm_overlap: bool = False
    #: parallel.tp_chunked on the compiled layer (:mod:`workbench.backend.tp_chunked`).
    workbench_tp_chunked: bool = False
    #: train.fp8 on the compiled layer: "tensorwise" | "rowwise" | "delayed" (:mod:`workbench.backend.fp8`), None = off.
    workbench_fp8: Optional[str] = None
    #: the kernel rule's decision for this model, made once (:func:`transformer_config`); the spec builders read it
    #: through :func:`workbench.kernel_rule.decided`
    workbench_kernels: Optional[kernel_rule.KernelChoice] = None


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


def attention_impl(cfg: RunConfig, kernels: Optional[kernel_rule.KernelChoice] = None) -> str:
    """Which core attention this config gets: 'te', 'sdpa' or 'local' (:func:`workbench.kernel_rule.choose`)."""
    impl = (kernels or kernel_rule.choose(cfg)).attention
    if impl == "te" and not kernel_rule.te_available():
        raise ValueError(f"model.attention_backend is 'te' but Transformer Engine is not usable here "
                         f"({kernel_rule.te_status()[1]}); use 'auto' or 'sdpa'")
    return impl


def _dtype(cfg: RunConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.train.precision]


def _activation(m: Any) -> Any:
    """The MLP's activation function (of the gate for gated MLPs): silu (swiglu), relu, gelu (geglu) exact or tanh."""
    if m.activation == "swiglu":
        return F.silu
    if m.activation == "relu":
        return F.relu
    return partial(F.gelu, approximate="tanh") if getattr(m, "gelu_approximate", "none") == "tanh" else F.gelu


class GraphedTransformerLayer(TransformerLayer):
    """Megatron's layer replayed as megatron's CUDA graphs (``cuda_graph_impl: local``; the kernel rule's
    ``cuda_graphs_impl == "megatron"``, TE's layer) in training calls only.  Evaluation and every other
    no-grad forward run eagerly: a training graph has train-mode dropout and the training shapes baked in,
    and megatron's manager asserts on a shape it has not recorded once its graphs exist."""

    def _should_call_local_cudagraph(self, *args: Any, **kwargs: Any) -> bool:
        return self.training and torch.is_grad_enabled() and super()._should_call_local_cudagraph(*args, **kwargs)


def layer_class(choice: kernel_rule.KernelChoice) -> type:
    """The TransformerLayer class for a kernel choice: the compiled dense layer, megatron's graphed for
    training (:class:`GraphedTransformerLayer`), or megatron's."""
    if choice.layer == "compiled":
        return compiled_layer.CompiledTransformerLayer
    return GraphedTransformerLayer if choice.cuda_graphs_impl == "megatron" else TransformerLayer


def _fp8_fields(choice: kernel_rule.KernelChoice) -> dict[str, Any]:
    """train.fp8 where the kernel rule runs it: the compiled layer's torch GEMMs (``workbench_fp8``), or
    megatron's fp8 config for Transformer Engine's layer (E4M3 forward / E5M2 gradients; its TransformerBlock
    enters TE's fp8 context per layer).  Delayed scaling keeps TE's default amax history (1024 steps, max)."""
    if choice.fp8_impl == "torch":
        return {"workbench_fp8": choice.fp8}
    if choice.fp8_impl == "te":
        fields: dict[str, Any] = {"fp8": "hybrid", "fp8_recipe": choice.fp8}
        if choice.fp8 == "delayed":
            fields.update(fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
        return fields
    return {}


def training_step_fields(cfg: RunConfig, kernels: Optional[kernel_rule.KernelChoice] = None) -> dict[str, Any]:
    """TransformerConfig fields of the training step alone, where the kernel rule says so: megatron's per-layer
    CUDA graphs (``cuda_graphs_impl == "megatron"``: TE's layer, the compiled layer under pipeline parallelism; a
    graph-safe RNG tracker, TE's where TE is usable, which ``distributed`` seeds) and TE's userbuffers (``tp_overlap == "userbuffers"``; :func:`workbench.backend.tp_overlap.initialize_userbuffers`
    sizes them for the training micro-batch).  Generation, conversion and verification build without them."""
    choice = kernels or kernel_rule.choose(cfg)
    fields: dict[str, Any] = {}
    if choice.cuda_graphs_impl == "megatron":
        fields.update(cuda_graph_impl="local", use_te_rng_tracker=choice.transformer_engine)
    if choice.tp_overlap == "userbuffers":
        fields.update(tp_comm_overlap=True)
    return fields


def transformer_config_overrides(cfg: Any) -> dict[str, Any]:
    """TransformerConfig fields for the stock-forward paths (called by :func:`transformer_config`).

    Only maths-preserving switches: megatron's torch.compile'd bias-dropout-add and its fused
    vocab-parallel cross entropy (fp32 like the unfused one).  Empty unless
    ``train.compile_kernels`` is on and the device is CUDA.
    """
    if not kernel_rule.fast_paths_wanted(cfg):
        return {}
    return {
        "bias_dropout_fusion": True,
        "cross_entropy_loss_fusion": True,
        "cross_entropy_fusion_impl": "native",
    }


def transformer_config(cfg: RunConfig, kernels: Optional[kernel_rule.KernelChoice] = None,
                       **overrides: Any) -> WorkbenchTransformerConfig:
    """The mcore TransformerConfig for a RunConfig (parallel sizes, dtypes, recompute, kernels).  ``kernels``: the
    kernel rule's decision (the trainer's, made once for the run; default :func:`workbench.kernel_rule.choose` now),
    carried as ``workbench_kernels`` for every builder of the model."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    kernels = kernels or kernel_rule.choose(cfg)
    impl = attention_impl(cfg, kernels)  # refuses attention_backend 'te' where TE is not usable
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
        gated_linear_unit=m.gated_mlp,
        activation_func=_activation(m),
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        context_parallel_size=max(int(getattr(p, "context_parallel", 1) or 1), 1),
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
        workbench_tp_comm_overlap=kernels.tp_overlap == "compiled",
        workbench_tp_chunked=kernels.tp_overlap == "chunked",
        workbench_kernels=kernels,
    )
    kwargs.update(_fp8_fields(kernels))
    kwargs.update(family_of(cfg).transformer_fields(cfg, kernels))  # e.g. GPT's MoE layers (workbench.families.common.moe)
    stage_layers = pipeline_stage_layers(cfg)
    if len(set(stage_layers)) > 1:  # parallel.pipeline_split: balanced (middle stages share the rest evenly)
        kwargs.update(num_layers_in_first_pipeline_stage=stage_layers[0], num_layers_in_last_pipeline_stage=stage_layers[-1])
    if p.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=p.recompute_num_layers)
    elif p.recompute == "selective":
        if impl == "te":
            kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
        else:
            kwargs.update(workbench_recompute_mlp=True)
    kwargs.update(transformer_config_overrides(cfg))
    kwargs.update(overrides)
    return WorkbenchTransformerConfig(**kwargs)


_NORM_NAMES = {"te": "Transformer Engine norm", "apex": "apex FusedLayerNorm",
               "torch": "torch norm (megatron local spec)", "workbench": "workbench {} (torch.nn.functional, SP-capable)"}


def norm_module(cfg: RunConfig, choice: kernel_rule.KernelChoice) -> Any:
    """The norm module class for a kernel choice."""
    if choice.norm == "te":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if choice.norm == "apex":
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm
    return WorkbenchNorm


def self_attention_layer_spec(cfg: RunConfig, choice: kernel_rule.KernelChoice, mask_type: Any) -> ModuleSpec:
    """A pre-norm self-attention + dense-MLP layer on the kernels of ``choice``: megatron's
    Column/RowParallelLinear, the workbench's SDPA (or stock) core attention and norms, and the
    layer class the rule picks; ``mask_type`` is megatron's ``AttnMaskType`` (causal, padding).

    The ``sharded_state_dict_keys_map`` is stock megatron's, so checkpoints are interchangeable
    with megatron's local and TE specs.  Families with a TE spec of their own return that
    themselves when ``choice.attention == "te"``.
    """
    norm = norm_module(cfg, choice)
    core = SDPAttention if choice.attention == "sdpa" else DotProductAttention
    return ModuleSpec(
        module=layer_class(choice),
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": mask_type},
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


def kernel_path(cfg: RunConfig, kernels: Optional[kernel_rule.KernelChoice] = None) -> dict[str, str]:
    """What each kernel slot resolves to for this config (goes into the run_start event)."""
    choice = kernels or kernel_rule.choose(cfg)
    impl = choice.attention
    attn = {
        "te": "Transformer Engine DotProductAttention",
        "sdpa": "workbench SDPA (torch scaled_dot_product_attention" + (", ALiBi bias" if cfg.model.position_embedding == "alibi" else "") + ")",
        "local": "megatron-core DotProductAttention (unfused)",
    }[impl]
    cp = int(getattr(cfg.parallel, "context_parallel", 1) or 1)
    if choice.context_parallel == "ring":
        attn += (f"; context parallel {cp}: ring attention over the CP group (K/V blocks by batch_isend_irecv, "
                 "load-balanced sequence shards, workbench.backend.context_parallel)"
                 + (", eagerly between the compiled layer's pieces" if choice.layer == "compiled" else ""))
    elif choice.context_parallel == "te":
        attn += (f"; context parallel {cp}: megatron-core's, in Transformer Engine's attention (its p2p K/V ring, "
                 "load-balanced sequence shards)")
    if choice.sdpa_order:
        attn += f"; SDPA backends {' > '.join(choice.sdpa_order)} on Hopper+ (Transformer Engine's cuDNN would demote cuDNN)"
    norm = _NORM_NAMES[choice.norm].format("RMSNorm" if cfg.model.normalization == "rmsnorm" else "LayerNorm")
    out = {
        "attention": attn,
        "norm": norm,
        "linear": "Transformer Engine" if impl == "te" else "megatron Column/RowParallelLinear",
        "recompute": {"none": "none", "full": f"full (uniform, {cfg.parallel.recompute_num_layers} layer/block)",
                      "selective": "selective: " + ("core_attn (TE)" if choice.selective == "core_attn" else SELECTIVE_RECOMPUTE)}[cfg.parallel.recompute],
    }
    if choice.fp8_impl == "te":  # the torch path reports itself (fast_fp8, from the built layers)
        out["fp8"] = (f"Transformer Engine FP8 ({choice.fp8} scaling, E4M3 forward / E5M2 gradients): every TE linear "
                      "of the transformer layers (embedding and output layer in the training precision)")
    if choice.tp_overlap == "userbuffers":
        out["tp_comm_overlap"] = ("Transformer Engine userbuffers (megatron tp_comm_overlap): the SP all-gather / "
                                  "reduce-scatter of qkv, proj, fc1, fc2 pipelined with their GEMMs")
    elif choice.tp_overlap == "chunked":
        out["tp_comm_overlap"] = ("chunked (parallel.tp_chunked): qkv, proj, fc1, fc2 in two row chunks, each exchange "
                                  "with the TP peer under the other chunk's GEMM")
    notes = transformer_config_overrides(cfg)
    out["fusions"] = ", ".join(f"{k}={v}" for k, v in notes.items() if "fusion" in k and v) or "none"
    return out
