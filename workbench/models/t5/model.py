"""T5's megatron specs and builder: RunConfig -> encoder / decoder layer specs -> megatron-core ``T5Model``.

The workbench's own specs (megatron-core's ``get_t5_{encoder,decoder}_with_local_block_spec`` set
the final norms to ``TENorm``, which is ``None`` without Transformer Engine, so both stacks would
lose their final norms): the kernel rule's layer class (the compiled layer, whose graph takes the
mask, the relative bias and the cross-attention, or megatron's ``TransformerLayer``) with

- encoder: norm -> self-attention (``AttnMaskType.padding``: bidirectional, keys masked) -> norm -> MLP;
- decoder: norm -> causal self-attention -> norm -> ``CrossAttention`` over the encoder output
  (padding mask on the encoder's keys) -> norm -> MLP;
- core attention: :class:`T5SDPAttention`, the workbench SDPA module with scale 1 (T5 does not scale
  the scores by ``1/sqrt(d)``); the relative position bias arrives as megatron's ``attention_bias``
  (self-attention only, as in T5) and is added to the scores;
- column / row parallel linears, the workbench's SP-capable norms (RMS for T5), ``RecomputedMLP``;
- final norms on both stacks.

:class:`WorkbenchT5Model` is mcore's ``T5Model`` with a bias-free LM head that, with tied
embeddings, scales the decoder output by ``hidden_size ** -0.5`` (T5 v1.0; HF's
``scale_decoder_outputs``); untied heads (v1.1, mT5) are not scaled.  mcore's ``T5LMHead`` adds a
vocab-sized bias whenever the head is tied, which T5 does not have.  :meth:`WorkbenchT5Model.encode`
runs the encoder alone (generation).  Masks are ``[b, 1, 1, s_enc]`` booleans, True = masked out.
"""

from __future__ import annotations

import contextlib
import copy
from functools import lru_cache, partial
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.T5 import t5_model as _t5_model
from megatron.core.models.T5.t5_model import T5Model
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region
from megatron.core.transformer.attention import (CrossAttention, CrossAttentionSubmodules, SelfAttention,
                                                 SelfAttentionSubmodules)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from workbench import kernel_rule
from workbench.backend.attention import SDPAttention
from workbench.backend.model import RecomputedMLP, layer_class, norm_module, transformer_config
from workbench.config import RunConfig, derive

__all__ = ["T5SDPAttention", "encoder_layer_spec", "decoder_layer_spec", "build", "WorkbenchT5Model", "WorkbenchT5LMHead"]


class T5SDPAttention(SDPAttention):
    """The workbench SDPA core attention with T5's softmax scale of 1 (no ``1/sqrt(d)``)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection: Any = None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=1.0, cp_comm_type=cp_comm_type, pg_collection=pg_collection)


def _self_attention(mask_type: AttnMaskType) -> ModuleSpec:
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": mask_type},
                      submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=T5SDPAttention,
                                                         linear_proj=RowParallelLinear, q_layernorm=IdentityOp,
                                                         k_layernorm=IdentityOp))


def _mlp() -> Any:
    return partial(RecomputedMLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


#: TE's fused norm-linear names -> this family's (non-TE) checkpoint names, so checkpoints load across both paths
#: (megatron's own T5 TE checkpoints keep TE's names, so they are not this family's layout)
TE_KEYS = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.", "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}


@lru_cache(maxsize=None)
def _te() -> SimpleNamespace:
    """Transformer Engine's megatron modules and T5's TE core attention (scale 1), imported when the rule picks TE."""
    from megatron.core.extensions import transformer_engine as te

    class T5TEAttention(te.TEDotProductAttention):
        """TE's fused attention with T5's softmax scale of 1; the relative bias arrives as ``attention_bias``
        (TE's ``post_scale_bias``)."""

        def __init__(self, *args: Any, softmax_scale: Optional[float] = None, **kwargs: Any):
            super().__init__(*args, softmax_scale=1.0, **kwargs)

    return SimpleNamespace(norm_linear=te.TELayerNormColumnParallelLinear, column=te.TEColumnParallelLinear,
                           row=te.TERowParallelLinear, norm=te.TENorm, attention=T5TEAttention)


def _te_self_attention(mask_type: AttnMaskType) -> ModuleSpec:
    te = _te()
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": mask_type},
                      submodules=SelfAttentionSubmodules(linear_qkv=te.norm_linear, core_attention=te.attention,
                                                         linear_proj=te.row, q_layernorm=IdentityOp, k_layernorm=IdentityOp))


def _te_layer_spec(decoder: bool) -> ModuleSpec:
    """megatron-core's T5 TE layer (its ``t5_spec``: norms fused into ``linear_qkv`` / ``linear_fc1``) with T5's
    scale-1 attention, saved under this family's non-TE names (:data:`TE_KEYS`)."""
    te = _te()
    extra: dict[str, Any] = {}
    if decoder:
        extra = dict(pre_cross_attn_layernorm=te.norm, cross_attn_bda=get_bias_dropout_add, cross_attention=ModuleSpec(
            module=CrossAttention, params={"attn_mask_type": AttnMaskType.padding},
            submodules=CrossAttentionSubmodules(linear_q=te.column, linear_kv=te.column, core_attention=te.attention,
                                                linear_proj=te.row)))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=_te_self_attention(AttnMaskType.causal if decoder else AttnMaskType.padding),
        self_attn_bda=get_bias_dropout_add,
        mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=te.norm_linear, linear_fc2=te.row)),
        mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=dict(TE_KEYS), **extra))


def encoder_layer_spec(cfg: RunConfig, choice: Optional[kernel_rule.KernelChoice] = None) -> ModuleSpec:
    """Encoder layer: bidirectional self-attention under the padding mask, MLP; pre-norm (``choice``: the kernel
    rule's decision the model is built with; default :func:`workbench.kernel_rule.choose`)."""
    choice = choice or kernel_rule.choose(cfg)
    if choice.attention == "te":
        return _te_layer_spec(decoder=False)
    norm = norm_module(cfg, choice)
    return ModuleSpec(module=layer_class(choice), submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=_self_attention(AttnMaskType.padding), self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=_mlp(), mlp_bda=get_bias_dropout_add))


def decoder_layer_spec(cfg: RunConfig, choice: Optional[kernel_rule.KernelChoice] = None) -> ModuleSpec:
    """Decoder layer: causal self-attention, cross-attention over the encoder output, MLP; pre-norm."""
    choice = choice or kernel_rule.choose(cfg)
    if choice.attention == "te":
        return _te_layer_spec(decoder=True)
    norm = norm_module(cfg, choice)
    cross = ModuleSpec(module=CrossAttention, params={"attn_mask_type": AttnMaskType.padding},
                       submodules=CrossAttentionSubmodules(linear_q=ColumnParallelLinear, linear_kv=ColumnParallelLinear,
                                                           core_attention=T5SDPAttention, linear_proj=RowParallelLinear))
    return ModuleSpec(module=layer_class(choice), submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=_self_attention(AttnMaskType.causal), self_attn_bda=get_bias_dropout_add,
        pre_cross_attn_layernorm=norm, cross_attention=cross, cross_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=_mlp(), mlp_bda=get_bias_dropout_add))


class WorkbenchT5LMHead(MegatronModule):
    """T5's LM head: a bias-free column-parallel output layer; scales its input by ``h ** -0.5`` when tied."""

    def __init__(self, config: TransformerConfig, parallel_output: bool, vocab_size: int, pre_process: bool = True,
                 share_embeddings_and_output_weights: bool = False, tp_group: Any = None):
        super().__init__(config=config)
        self.parallel_output = parallel_output
        self.scale = config.hidden_size ** -0.5 if share_embeddings_and_output_weights else None
        # not a submodule of the head: T5Model registers it once, as ``output_layer`` (one state-dict key)
        self.__dict__["_output_layer"] = tensor_parallel.ColumnParallelLinear(
            config.hidden_size, vocab_size, config=config, init_method=config.init_method, bias=False,
            skip_bias_add=False, gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights, tp_group=tp_group)

    @property
    def output_layer(self) -> Any:
        return self.__dict__["_output_layer"]

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: Optional[torch.Tensor]) -> torch.Tensor:
        if self.scale is not None:
            hidden_states = hidden_states * self.scale
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


@contextlib.contextmanager
def _lm_head() -> Iterator[None]:
    saved = _t5_model.T5LMHead
    _t5_model.T5LMHead = WorkbenchT5LMHead
    try:
        yield
    finally:
        _t5_model.T5LMHead = saved


class _BiasBridge(torch.autograd.Function):
    """Identity on a block's input whose backward hands the relative bias its gradient, collected on a leaf.

    Under ``recompute: full`` megatron's ``checkpointed_forward`` passes ``attention_bias`` into every
    checkpointed chunk by closure, so each chunk's recompute-backward would run backward through the
    one shared bias graph (the bucketed embedding lookup and the TP scatter) again: "Trying to backward
    through the graph a second time".  The block gets a detached leaf instead; its gradient accumulates
    over all chunks, and this function, placed on the block's input (whose backward runs after every
    chunk's), passes it to the real bias once.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, bias: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        ctx.leaf = leaf
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g, ctx.leaf.grad = ctx.leaf.grad, None
        return grad, g, None


def _bridge_bias(block: Any) -> None:
    """Route a block's ``attention_bias`` through :class:`_BiasBridge` when it runs under full recompute."""
    forward = block.forward

    def bridged(*args: Any, hidden_states: Any = None, attention_bias: Any = None, **kwargs: Any) -> Any:
        if (attention_bias is not None and attention_bias.requires_grad and hidden_states is not None and block.training
                and torch.is_grad_enabled() and block.config.recompute_granularity == "full"):
            leaf = attention_bias.detach().requires_grad_(True)
            hidden_states = _BiasBridge.apply(hidden_states, attention_bias, leaf)
            attention_bias = leaf
        return forward(*args, hidden_states=hidden_states, attention_bias=attention_bias, **kwargs)

    block.forward = bridged


class WorkbenchT5Model(T5Model):
    """megatron-core's T5Model with T5's LM head (see the module docstring), an encoder-only entry, and the
    relative bias's gradient routed around megatron's full recompute (:class:`_BiasBridge`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        with _lm_head():
            super().__init__(*args, **kwargs)
        for block in (self.encoder, self.decoder):
            if block is not None:
                _bridge_bias(block)

    #: the layers are Transformer Engine's, whose cross-attention takes its padding mask as (queries, keys)
    te_masks = False

    def forward(self, encoder_input_ids: Any, decoder_input_ids: Any, encoder_attn_mask: Any, decoder_attn_mask: Any,
                encoder_decoder_attn_mask: Any, *args: Any, **kwargs: Any) -> Any:
        """mcore's forward; on TE's layers the cross-attention mask ``[b, 1, 1, s_enc]`` becomes TE's (queries,
        keys) pair: no decoder position masked (megatron's T5 data path masks the decoder's padding there; the loss
        mask drops those positions either way), the encoder's padding.  A tuple cannot pass megatron's recompute
        checkpoint, so the T5 rules refuse recompute on TE's layer."""
        if (self.te_masks and decoder_input_ids is not None and encoder_decoder_attn_mask is not None
                and not isinstance(encoder_decoder_attn_mask, tuple)):
            b, s = decoder_input_ids.shape
            queries = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=encoder_decoder_attn_mask.device)
            encoder_decoder_attn_mask = (queries, encoder_decoder_attn_mask)
        return super().forward(encoder_input_ids, decoder_input_ids, encoder_attn_mask, decoder_attn_mask,
                               encoder_decoder_attn_mask, *args, **kwargs)

    def relative_bias(self, which: str, sq: int, sk: int, offset: int = 0) -> Optional[torch.Tensor]:
        """This TP rank's heads of a stack's relative position bias ``[1, heads/tp, sq, sk]`` (queries at
        positions ``offset .. offset + sq - 1``), or None without relative positions."""
        if self.position_embedding_type != "relative":
            return None
        emb = self.encoder_relative_pos_emb if which == "encoder" else self.decoder_relative_pos_emb
        dev = emb.relative_attention_bias.weight.device
        q = torch.arange(offset, offset + sq, dtype=torch.long, device=dev)[:, None]
        k = torch.arange(sk, dtype=torch.long, device=dev)[None, :]
        buckets = emb._relative_position_bucket(k - q, bidirectional=emb.bidirectional,
                                                num_buckets=emb.relative_attention_num_buckets,
                                                max_distance=emb.relative_attention_max_distance)
        bias = emb.relative_attention_bias(buckets)  # [sq, sk, heads]
        bias = scatter_to_tensor_model_parallel_region(bias[None], self.tp_group)  # this rank's heads
        return bias.permute(0, 3, 1, 2)

    def encode(self, input_ids: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        """Encoder hidden states ``[s, b, h]`` of a whole model (no pipeline); ``enc_mask`` ``[b, 1, 1, s]`` True = pad."""
        return self.forward(input_ids, None, enc_mask, None, None, output_encoder_hidden_only=True)


def build(
    cfg: RunConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Optional[TransformerConfig] = None,
) -> WorkbenchT5Model:
    """One megatron T5Model for this rank (parallel state must be initialised; no pipeline parallelism).

    ``config`` is the model's (the trainer wires gradient scaling and finalize hooks on it); each
    stack's block gets a shallow copy holding its own ``num_layers`` (megatron's dist-checkpoint
    keys stack a block's layers to ``config.num_layers``).
    """
    config = config or transformer_config(cfg)
    m = cfg.model
    choice = kernel_rule.decided(cfg, config)
    norm = norm_module(cfg, choice)
    enc = TransformerBlockSubmodules(layer_specs=[encoder_layer_spec(cfg, choice)] * m.num_layers, layer_norm=norm)
    dec = TransformerBlockSubmodules(layer_specs=[decoder_layer_spec(cfg, choice)] * m.decoder_layers, layer_norm=norm)
    model = WorkbenchT5Model(
        config=config,
        encoder_config=_with_layers(config, m.num_layers),
        transformer_encoder_layer_spec=enc,
        transformer_decoder_layer_spec=dec,
        vocab_size=derive(cfg).padded_vocab_size,
        max_sequence_length=max(m.max_position_embeddings, m.seq_length, m.decoder_seq),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="relative",
        relative_attention_num_buckets=m.relative_attention_num_buckets,
        relative_attention_max_distance=m.relative_attention_max_distance,
    )
    if model.decoder is not None:
        model.decoder.config = _with_layers(config, m.decoder_layers)
    model.te_masks = choice.attention == "te"
    return model


def _with_layers(config: TransformerConfig, n: int) -> TransformerConfig:
    out = copy.copy(config)
    out.num_layers = n
    return out
