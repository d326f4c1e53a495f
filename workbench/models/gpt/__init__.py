"""GPT: decoder-only transformers (GPT-2 and Llama-style, dense or mixture of experts) on megatron-core's ``GPTModel``.

Parts: shapes (the common transformer stack's, :mod:`workbench.models.common.shapes`), :mod:`.model` (specs and
builder), :mod:`.step` (default forward step and LM loss), :mod:`.data` (GPT datasets),
:mod:`.hf` (HF GPT-2 / Llama state-dict adapter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from workbench.models.common import moe
from workbench.models.common.moe import MoEConfig
from workbench.models.family import Family, Supports
from workbench.models.common import shapes
from workbench.models.gpt.presets import PRESETS


@dataclass
class GPTFields:
    """The model-config fields GPT reads (``model.<field>``, mounted on :class:`workbench.config.ModelConfig`)."""

    #: mixture of experts (families with ``Supports.moe``): experts, router, capacity; see workbench.models.common.moe
    moe: MoEConfig = field(default_factory=MoEConfig)


def field_rules(cfg: Any, supports: Supports) -> list[tuple[str, ...]]:
    """The ``model.moe`` section and expert parallelism on a config of any family (refused where the family has no
    MoE layers): :func:`workbench.models.common.moe.rules`."""
    return moe.rules(cfg, supports.moe)


def transformer_fields(cfg: Any, choice: Any) -> dict:
    """The MoE layers' megatron fields (none for a dense model), with the kernel rule's expert implementation
    (``choice``: :class:`workbench.kernel_rule.KernelChoice`)."""
    return moe.transformer_fields(cfg, grouped_te=choice.experts == "te_grouped")


FAMILY = Family(
    name="gpt",
    title="GPT (decoder-only: GPT-2, Llama-style)",
    supports=Supports(pipeline=True, interleaved=True, sequence_parallel=True, generation=True, moe=True,
                      hf_classes=(("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"),
                                  ("mixtral", "MixtralForCausalLM")),
                      hf_refused=(("qwen3_moe", "Qwen3-MoE's q/k norms: the workbench model has none yet"),
                                  ("olmoe", "OLMoE's q/k norms: the workbench model has none yet"))),
    shapes=shapes,
    presets=PRESETS,
    model_fields=GPTFields,
    field_rules=field_rules,
    transformer_fields=transformer_fields,
)
