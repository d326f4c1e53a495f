"""GPT: decoder-only transformers (GPT-2 and Llama-style, dense or mixture of experts) on megatron-core's ``GPTModel``.

The declaration: shapes (the common transformer stack's, :mod:`workbench.families.common.shapes`), presets
(:mod:`.presets`), the ``model.moe`` section (:mod:`workbench.families.common.moe`), ``qk_layernorm`` and
``qk_norm_scope``.  The rank side, :mod:`workbench.models.gpt`: specs and builder, default forward step and LM loss,
GPT datasets, the HF GPT-2 / Llama / Mixtral / Qwen3-MoE / OLMoE adapter, the generation engine, the MoE router
statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from workbench.families.common import moe
from workbench.families.common.moe import MoEConfig
from workbench.families.family import Family, Supports
from workbench.families.common import shapes
from workbench.families.gpt.presets import PRESETS


@dataclass
class GPTFields:
    """The model-config fields GPT reads (``model.<field>``, mounted on :class:`workbench.config.ModelConfig`)."""

    #: mixture of experts (families with ``Supports.moe``): experts, router, capacity; see workbench.families.common.moe
    moe: MoEConfig = field(default_factory=MoEConfig)
    #: RMSNorm / LayerNorm of each query and key head (head_dim wide, before RoPE): megatron-core's ``qk_layernorm``
    #: (Qwen3's q/k norms)
    qk_layernorm: bool = False
    #: what each q/k norm spans: ``head`` (each head on its own, head_dim wide: megatron-core's, Qwen3's) or
    #: ``all_heads`` (one RMSNorm over all query heads, num_heads x head_dim wide, and one over all KV heads:
    #: OLMoE's; :mod:`workbench.backend.qk_norms`); needs ``qk_layernorm``
    qk_norm_scope: Literal["head", "all_heads"] = "head"


def field_rules(cfg: Any, supports: Supports) -> list[tuple[str, ...]]:
    """The ``model.moe`` section and expert parallelism on a config of any family (refused where the family has no
    MoE layers): :func:`workbench.families.common.moe.rules`; ``model.qk_layernorm`` (refused where the family's
    attention has no q/k norms)."""
    out = moe.rules(cfg, supports.moe)
    if getattr(cfg.model, "qk_layernorm", False) and not supports.qk_layernorm:
        out.append(("model.qk_layernorm", f"the {cfg.model.arch} family's attention has no q/k norms",
                    "set qk_layernorm: false (q/k norms: a gpt model)", "model.arch"))
    return out + _scope_rules(cfg)


def _scope_rules(cfg: Any) -> list[tuple[str, ...]]:
    """``model.qk_norm_scope: all_heads``: q/k RMSNorms over all heads (OLMoE's) need the q/k norms, RMSNorm and at
    least one KV group per TP rank (the key norm's heads split over TP, never replicated)."""
    m, f = cfg.model, "model.qk_norm_scope"
    if getattr(m, "qk_norm_scope", "head") != "all_heads":
        return []
    if not m.qk_layernorm:
        return [(f, "all_heads scopes the q/k norms, and qk_layernorm is false (no q/k norms)",
                 "set qk_layernorm: true, or qk_norm_scope: head", "model.qk_layernorm")]
    out = []
    if m.normalization != "rmsnorm":
        out.append((f, "q/k norms over all heads are RMSNorms (OLMoE's)", "set normalization: rmsnorm, or qk_norm_scope: head",
                    "model.normalization"))
    tp = int(cfg.parallel.tensor_parallel)
    if m.query_groups < tp:
        out.append((f, f"the key norm over all heads needs each of the {tp} TP ranks to hold its own KV heads "
                       f"({m.query_groups} KV groups)", f"use tensor_parallel <= {m.query_groups}, or qk_norm_scope: head",
                    "parallel.tensor_parallel", "model.num_query_groups"))
    return out


def transformer_fields(cfg: Any, choice: Any) -> dict:
    """The MoE layers' megatron fields (none for a dense model) and ``qk_layernorm``, with the kernel rule's expert implementation
    (``choice``: :class:`workbench.kernel_rule.KernelChoice`)."""
    fields = moe.transformer_fields(cfg, grouped_te=choice.experts == "te_grouped")
    if cfg.model.qk_layernorm:
        fields["qk_layernorm"] = True
    return fields


FAMILY = Family(
    name="gpt",
    title="GPT (decoder-only: GPT-2, Llama-style)",
    supports=Supports(pipeline=True, interleaved=True, sequence_parallel=True, generation=True, moe=True, qk_layernorm=True,
                      context_parallel=True,
                      hf_classes=(("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM"),
                                  ("mixtral", "MixtralForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM"),
                                  ("olmoe", "OlmoeForCausalLM"))),
    shapes=shapes,
    presets=PRESETS,
    model_fields=GPTFields,
    field_rules=field_rules,
    transformer_fields=transformer_fields,
    variant=lambda model: "moe" if int((model.get("moe") or {}).get("num_experts") or 0) > 1 else "",
)
