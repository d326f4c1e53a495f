"""What a model family is: one folder under ``workbench/models/`` that the rest of the workbench asks.

A family declares (torch-free, so the planner, config validation and widgets can read it in
a notebook kernel) what it supports, its presets, its config rules and its shape terms; and
names the modules of its heavier concerns, imported only where they run:

=============  ==========================================================================
part           what it holds
=============  ==========================================================================
``shapes``     parameter counts, Megatron FLOPs and the planner's per-stage memory terms
               (torch-free; imported with the family)
``model``      the megatron ``ModuleSpec`` s and ``build(cfg, pre_process, post_process,
               vp_stage, config)`` -> one model chunk (rank side: torch + megatron-core)
``step``       the default train step: ``forward_step(batch, model, return_logits)`` and
               ``loss(batch, losses)`` (rank side)
``data``       ``build_datasets(cfg, run_dir, log)`` for the non-synthetic sources (rank side)
``hf``         the Hugging Face state-dict adapter (conversion)
=============  ==========================================================================

Adding a family: a folder with an ``__init__.py`` that defines ``FAMILY`` and the modules it
names, and one line in :data:`workbench.models.FAMILIES`. Nothing outside the folder branches on
``model.arch``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["Family", "Supports"]


@dataclass(frozen=True)
class Supports:
    """What a family can do (config validation and the widgets read this)."""

    pipeline: bool = True
    interleaved: bool = True
    sequence_parallel: bool = True
    generation: bool = False
    #: (HF ``model_type``, HF class) pairs its ``hf`` part converts
    hf_classes: tuple[tuple[str, str], ...] = ()
    #: (HF ``model_type``, why it is refused and what to use instead): HF types that look like
    #: this family's but are not converted (e.g. post-LN ``bert`` for the pre-LN BERT family)
    hf_refused: tuple[tuple[str, str], ...] = ()
    #: why the compiled dense layer (:class:`workbench.backend.compiled_layer.CompiledTransformerLayer`) cannot serve this family's
    #: layers, whatever the config (None: it can); read by :func:`workbench.kernel_rule.layer_blocker`
    compiled_layer_blocker: str | None = None
    #: why pipeline parallelism is refused (config validation says it with the field); "" -> a generic sentence
    pipeline_reason: str = ""
    #: whether ``attention_backend: auto`` may take Transformer Engine's layer for this family where the compiled
    #: layer does not apply, and whether that layer replays as megatron's CUDA graphs (T5 has a TE layer for an
    #: explicit ``te``, ungraphed: its cross-attention mask pair)
    transformer_engine: bool = True
    #: why TE's userbuffers (``parallel.te_userbuffers``) cannot serve this family's TE layer ("" -> they can);
    #: read by :func:`workbench.kernel_rule.userbuffer_problems`
    te_userbuffers_blocker: str = ""
    #: ``model.position_embedding`` values the family builds
    positions: tuple[str, ...] = ("learned", "rope", "alibi")
    #: ``model.activation`` values (MLP types) the family builds
    activations: tuple[str, ...] = ("gelu", "swiglu")
    #: whether ``model.num_labels`` > 0 (a sequence-classification head, trained on a labelled set) is built
    classification: bool = False
    #: whether ``model.moe.num_experts`` > 0 (mixture-of-experts layers, :mod:`workbench.models.common.moe`) builds
    moe: bool = False

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        return tuple(mt for mt, _ in self.hf_classes)


def positions_rule(cfg: Any, n: int, max_new: int) -> list[tuple[str, str, str]]:
    """A decoder-only model's request: prompt and new tokens share the model's positions."""
    limit = cfg.model.max_position_embeddings
    if n > limit:
        return [("prompt", f"prompt is {n} tokens, longer than the model's {limit} positions", "shorten the prompt")]
    if n + max_new > limit:
        return [("generation.max_new_tokens", f"({n} tokens) + max_new_tokens {max_new} exceeds the model's {limit} positions",
                 f"use max_new_tokens <= {limit - n}")]
    return []


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    #: dotted package holding the parts (``workbench.models.gpt``)
    package: str
    supports: Supports
    #: the torch-free ``shapes`` module
    shapes: ModuleType
    #: preset name -> nested dict of RunConfig sections (missing fields take the defaults)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: family-specific config rules: cfg -> [(field, rule, fix)]
    rules: Callable[[Any], list[tuple[str, str, str]]] = lambda cfg: []
    #: family-specific data checks a launcher runs before any process starts (light: tokenizer
    #: files, ``.idx`` headers and sidecars, never torch): cfg -> [(field, rule, fix)]
    data_rules: Callable[[Any], list[tuple[str, str, str]]] = lambda cfg: []
    #: the part whose ``make_engine(model, cfg, tokenizer, special_ids, cuda_graphs)`` generates for this
    #: family (None: the decoder-only engine of :mod:`workbench.backend.inference`)
    generation_engine: str | None = None
    #: length checks of one generation request: (cfg, prompt tokens, max_new_tokens) -> [(field, rule, fix)],
    #: field "prompt" (the generation front end names which) or "generation.max_new_tokens"
    generation_rules: Callable[[Any, int, int], list[tuple[str, str, str]]] = positions_rule
    #: config fields only this family reads (dotted, e.g. ``model.num_labels``): the config form shows them
    #: only while ``model.arch`` names this family
    fields: tuple[str, ...] = ()
    #: megatron ``TransformerConfig`` fields of this family's layers beyond the generic ones (GPT: the MoE
    #: fields, :func:`workbench.models.common.moe.transformer_fields`): (cfg, the kernel rule's choice) -> dict
    transformer_fields: Callable[[Any, Any], dict] = lambda cfg, choice: {}

    def part(self, name: str) -> ModuleType:
        """One of the family's modules (``model``, ``step``, ``data``, ``hf``), imported on first use."""
        return importlib.import_module(f"{self.package}.{name}")
