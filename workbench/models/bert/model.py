"""BERT's megatron spec and builder: RunConfig -> layer spec -> megatron-core ``BertModel`` chunk.

The layer is Megatron's pre-LN BERT layer on the workbench's kernel slots (the one kernel rule,
:func:`workbench.kernel_rule.choose`): self-attention with ``AttnMaskType.padding`` on the workbench
SDPA module (bidirectional, the padding mask passed by megatron) or on megatron's unfused
``DotProductAttention`` (``attention_backend: local``), the workbench's SP-capable norms, column /
row parallel linears, and Transformer Engine's BERT spec when the rule picks TE.  The layer class is
the rule's: the compiled layer (bidirectional SDPA under the same ``[b, 1, 1, s]`` mask) unless dropout
or another blocker keeps megatron's TransformerLayer.

:class:`WorkbenchBertModel` is mcore's ``BertModel`` with three changes, none to its maths or
parameter names:

- the masked-LM head's LayerNorm is the workbench norm (mcore's falls back to torch's
  ``LayerNorm``, which refuses sequence parallelism without apex), so TP+SP works without apex/TE;
- with the workbench SDPA module the padding mask is ``[b, 1, 1, s]`` (keys only, as Hugging
  Face's BERT masks): padded queries still see the real keys, so no softmax row is empty (an
  all-masked row gives NaN in SDPA, which would reach the real tokens through the next layer);
- ``model.add_pooler`` adds the pooler without the binary head, and :meth:`WorkbenchBertModel.encode`
  returns hidden states and the pooled output; ``model.num_labels`` adds a classification head on the
  pooled output, whose logits the last stage returns (:mod:`.finetune`);
- given the batch's ``loss_mask`` in training, the masked-LM head (dense, GELU, norm, output layer and
  cross-entropy) runs only on the masked positions (:meth:`WorkbenchBertModel.masked_lm_losses`, as NVIDIA's
  MLPerf BERT does): the per-token losses there are the full head's, the other positions carry no loss in
  either, so loss and gradients are the same for ~15% of the head's work (the vocabulary GEMM is ~20% of
  BERT-base's FLOPs).

Megatron-LM's ``pretrain_bert.py`` imports the TE spec at module level and fails without TE even
with ``--spec local``; nothing here imports TE unless the rule chose it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional

import torch
from megatron.core.models.bert import bert_model as _bert_model
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.bert.pooler import Pooler
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer

from workbench import kernel_rule
from workbench.backend.attention import SDPAttention
from workbench.backend.model import layer_class, norm_module, self_attention_layer_spec, transformer_config
from workbench.config import RunConfig, derive

__all__ = ["layer_spec", "block_spec", "build", "WorkbenchBertModel", "WorkbenchBertLMHead"]


def layer_spec(cfg: RunConfig, choice: Optional[kernel_rule.KernelChoice] = None) -> ModuleSpec:
    """The BERT layer: TE's BERT spec when the rule picks TE, else megatron linears + workbench attention / norms
    (``choice``: the kernel rule's decision the model is built with; default :func:`workbench.kernel_rule.choose`)."""
    choice = choice or kernel_rule.choose(cfg)
    if choice.attention == "te":
        from megatron.core.models.bert.bert_layer_specs import get_bert_layer_with_transformer_engine_spec

        return dataclasses.replace(get_bert_layer_with_transformer_engine_spec(), module=layer_class(choice))  # graphed for training where the rule says
    return self_attention_layer_spec(cfg, choice, AttnMaskType.padding)


def block_spec(cfg: RunConfig, config: TransformerConfig, vp_stage: Optional[int] = None) -> TransformerBlockSubmodules:
    """Layer specs for this pipeline stage plus the final norm (the workbench's, so SP works)."""
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    choice = kernel_rule.decided(cfg, config)
    return TransformerBlockSubmodules(layer_specs=[layer_spec(cfg, choice)] * n, layer_norm=norm_module(cfg, choice))


class WorkbenchBertLMHead(MegatronModule):
    """mcore's ``BertLMHead`` (dense -> GELU -> LayerNorm; same parameter names) with a given norm class."""

    def __init__(self, hidden_size: int, config: TransformerConfig, norm: Any):
        super().__init__(config=config)
        self.dense = get_linear_layer(hidden_size, hidden_size, config.init_method, config.perform_initialization)
        setattr(self.dense.weight, "sequence_parallel", config.sequence_parallel)
        setattr(self.dense.bias, "sequence_parallel", config.sequence_parallel)
        self.layer_norm = norm(config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon)
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(self.gelu(self.dense(hidden_states)))


@contextlib.contextmanager
def _lm_head(norm: Any) -> Iterator[None]:
    """While a BertModel is constructed, its ``BertLMHead`` is :class:`WorkbenchBertLMHead` with ``norm``."""
    saved = _bert_model.BertLMHead
    _bert_model.BertLMHead = lambda hidden_size, config: WorkbenchBertLMHead(hidden_size, config, norm)
    try:
        yield
    finally:
        _bert_model.BertLMHead = saved


class WorkbenchBertModel(BertModel):
    """megatron-core's BertModel with the workbench's LM-head norm, key-padding mask and optional pooler."""

    #: what a fine-tuning load (checkpoint.finetune) initialises fresh when the checkpoint lacks it: the task head
    fresh_on_finetune = ("classifier.",)

    def __init__(self, *args: Any, norm: Any = None, add_pooler: bool = False, num_labels: int = 0,
                 masked_per_sequence: int = 0, **kwargs: Any):
        with _lm_head(norm):
            super().__init__(*args, **kwargs)
        self.num_labels = int(num_labels)
        #: most masked positions a sequence of the family's data holds (0: the head runs on every position)
        self.masked_per_sequence = int(masked_per_sequence)
        if self.post_process and (add_pooler or self.num_labels) and not self.add_binary_head:
            self.pooler = Pooler(self.config.hidden_size, self.config.init_method, self.config, self.config.sequence_parallel)
        self.classifier = None
        if self.post_process and self.num_labels:  # sequence classification (.finetune): a fresh head on the pooled output
            self.classifier = get_linear_layer(self.config.hidden_size, self.num_labels, self.config.init_method,
                                               self.config.perform_initialization)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, tokentype_ids: Optional[torch.Tensor] = None,
                lm_labels: Optional[torch.Tensor] = None, *args: Any, loss_mask: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Any:
        """mcore's forward; with a classification head the last stage returns its logits ``[b, num_labels]``; with
        labels and the ``loss_mask`` the masked-LM losses come from :meth:`masked_lm_losses` (same values)."""
        masked = (loss_mask is not None and lm_labels is not None and self.masked_per_sequence > 0
                  and not self.config.sequence_parallel)
        if self.classifier is None and not masked:
            return super().forward(input_ids, attention_mask, tokentype_ids, lm_labels, *args, **kwargs)
        if not self.post_process:
            return super().forward(input_ids, attention_mask, tokentype_ids, None, *args, **kwargs)
        self.post_process = False  # mcore's forward then stops after the encoder (and final norm): the hidden states
        try:
            hidden = super().forward(input_ids, attention_mask, tokentype_ids, None, *args, **kwargs)
        finally:
            self.post_process = True
        if self.classifier is not None:
            return self.classifier(self.pooler(hidden, 0))
        binary = self.binary_head(self.pooler(hidden, 0)) if self.binary_head is not None else None
        return self.masked_lm_losses(hidden, lm_labels, loss_mask), binary

    def bert_position_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """megatron's positions ``0 .. s-1``; under context parallelism the positions of this CP rank's chunks of the
        whole sequence (``r`` and ``2cp-1-r``: :func:`workbench.backend.context_parallel.shard_positions`, as the
        trainer cut the tokens), so each token keeps its own learned position embedding."""
        cp = int(self.config.context_parallel_size or 1)
        if cp <= 1:
            return super().bert_position_ids(token_ids)
        from megatron.core import parallel_state

        from workbench.backend.context_parallel import shard_positions

        pos = shard_positions(token_ids.size(1) * cp, parallel_state.get_context_parallel_rank(), cp, device=token_ids.device)
        return pos.unsqueeze(0).expand_as(token_ids)

    def masked_lm_losses(self, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Per-token masked-LM losses ``[b, s]`` from the final hidden states ``[s, b, h]``, the head run only on
        the masked positions (``loss_mask`` 1), 0 elsewhere (where the loss mask drops them in any case).

        A fixed number of rows, ``b x masked_per_sequence``, keeps the compiled cross-entropy one graph: the
        masked positions first (a stable sort), then unmasked ones, whose losses are discarded.  More masked
        positions than that stops the run (a device-side assert; never a silently partial loss)."""
        s, b, h = hidden.shape
        flat = loss_mask.t().reshape(-1)  # [s * b], hidden's row order
        k = min(s, self.masked_per_sequence) * b
        rows = torch.argsort(flat, descending=True, stable=True)[:k]
        keep = flat[rows]
        torch._assert_async(keep.sum() == flat.sum(), "BERT batch: more masked positions than the masked-LM head's "
                                                      "b x masked_per_sequence rows")
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        head = self.lm_head(hidden_states=hidden.reshape(s * b, h)[rows].unsqueeze(1))  # [k, 1, h]
        logits, _ = self.output_layer(head, weight=weight)
        losses = self.compute_language_model_loss(labels.t().reshape(-1)[rows].unsqueeze(0), logits)  # [1, k]
        out = torch.zeros(s * b, dtype=losses.dtype, device=losses.device)
        return out.scatter(0, rows, losses.reshape(-1) * (keep > 0)).view(s, b).t()

    def _layer_spec(self) -> Any:
        spec = self.transformer_layer_spec
        if isinstance(spec, TransformerBlockSubmodules):
            return spec.layer_specs[0] if spec.layer_specs else None
        return spec

    def _sanity_check_attention_and_get_attn_mask_dimension(self) -> str:
        layer = self._layer_spec()
        core = layer.submodules.self_attention.submodules.core_attention if layer is not None else SDPAttention
        if core is SDPAttention:
            return "b11s"  # keys only: no empty softmax row (see the module docstring)
        if core is DotProductAttention:
            return "b1ss"
        saved = self.transformer_layer_spec  # Transformer Engine: megatron's own rule, on the layer spec
        self.transformer_layer_spec = layer
        try:
            return super()._sanity_check_attention_and_get_attn_mask_dimension()
        finally:
            self.transformer_layer_spec = saved

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               tokentype_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(hidden states ``[s, b, h]``, pooled first token ``[b, h]`` or None) of a whole model (no pipeline)."""
        mask = self.bert_extended_attention_mask(attention_mask)
        x = self.embedding(input_ids=input_ids, position_ids=self.bert_position_ids(input_ids), tokentype_ids=tokentype_ids)
        rotary = None
        if self.position_embedding_type == "rope":
            rotary = self.rotary_pos_emb(self.rotary_pos_emb.get_rotary_seq_len(None, self.encoder, x, self.config))
        hidden = self.encoder(hidden_states=x, attention_mask=mask, rotary_pos_emb=rotary)
        pooled = self.pooler(hidden, 0) if getattr(self, "pooler", None) is not None else None
        return hidden, pooled


def build(
    cfg: RunConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Optional[TransformerConfig] = None,
) -> WorkbenchBertModel:
    """One megatron BertModel chunk for this rank (parallel state must be initialised)."""
    config = config or transformer_config(cfg)
    m = cfg.model
    return WorkbenchBertModel(
        config=config,
        num_tokentypes=m.num_tokentypes,
        transformer_layer_spec=block_spec(cfg, config, vp_stage),
        vocab_size=derive(cfg).padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.tie_embeddings,
        position_embedding_type="rope" if m.position_embedding == "rope" else "learned_absolute",
        rotary_percent=m.rotary_percent,
        add_binary_head=m.add_binary_head,
        vp_stage=vp_stage,
        norm=norm_module(cfg, kernel_rule.decided(cfg, config)),
        add_pooler=m.add_pooler,
        num_labels=m.num_labels,
        masked_per_sequence=masked_per_sequence(cfg),
    )


def masked_per_sequence(cfg: RunConfig) -> int:
    """The most masked positions one sequence of this family's data holds: ``masking_probability`` of the sequence
    (megatron's ``BERTMaskedWordPieceDataset`` masks at most that many; the synthetic set, 15% of its words)."""
    from workbench.families.bert.shapes import masked_per_sequence as per_sequence

    return per_sequence(cfg.model.seq_length)
