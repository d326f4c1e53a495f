"""GPT: decoder-only transformers (GPT-2 and Llama-style) on megatron-core's ``GPTModel``.

Parts: :mod:`.shapes` (counts, FLOPs, planner terms; torch-free), :mod:`.model` (specs and
builder), :mod:`.step` (default forward step and LM loss), :mod:`.data` (GPT datasets),
:mod:`.hf` (HF GPT-2 / Llama state-dict adapter).
"""

from __future__ import annotations

from workbench.models.family import Family, Supports
from workbench.models.gpt import shapes
from workbench.models.gpt.presets import PRESETS

FAMILY = Family(
    name="gpt",
    title="GPT (decoder-only: GPT-2, Llama-style)",
    package="workbench.models.gpt",
    supports=Supports(pipeline=True, interleaved=True, sequence_parallel=True, generation=True,
                      hf_classes=(("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"))),
    shapes=shapes,
    presets=PRESETS,
)
