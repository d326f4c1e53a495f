"""GPT: decoder-only transformers (GPT-2 and Llama-style, dense or mixture of experts) on megatron-core's ``GPTModel``.

Parts: shapes (the common transformer stack's, :mod:`workbench.models.common.shapes`), :mod:`.model` (specs and
builder), :mod:`.step` (default forward step and LM loss), :mod:`.data` (GPT datasets),
:mod:`.hf` (HF GPT-2 / Llama state-dict adapter).
"""

from __future__ import annotations

from typing import Any

from workbench.models.common import moe
from workbench.models.family import Family, Supports
from workbench.models.common import shapes
from workbench.models.gpt.presets import PRESETS


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
    fields=("model.moe",),
    transformer_fields=transformer_fields,
)
