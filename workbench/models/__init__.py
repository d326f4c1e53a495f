"""Model families: ``workbench/models/<family>/``, one folder each (see :mod:`workbench.models.family`).

``model.arch`` names the family; everything that depends on the architecture is asked of it
instead of branching on it: this registry holds the torch-free declarations (:func:`family_of`:
supports, presets, config fields and rules, shape terms) and :mod:`workbench.models.parts` the
rank-side parts (:func:`workbench.models.parts.parts_of`: builder, train step, datasets, HF
adapter, generation engine).  What families share lives in :mod:`workbench.models.common`.
"""

from __future__ import annotations

from typing import Any

from workbench.models.family import Family, Supports
from workbench.models.bert import FAMILY as BERT
from workbench.models.gpt import FAMILY as GPT
from workbench.models.t5 import FAMILY as T5

__all__ = ["Family", "Supports", "FAMILIES", "family_of", "family_for_hf", "all_presets"]

#: ``model.arch`` -> family
FAMILIES: dict[str, Family] = {f.name: f for f in (GPT, BERT, T5)}


def family_of(cfg_or_arch: Any) -> Family:
    """The family of a RunConfig (or of an ``arch`` name). KeyError names the known ones."""
    arch = cfg_or_arch if isinstance(cfg_or_arch, str) else cfg_or_arch.model.arch
    try:
        return FAMILIES[arch]
    except KeyError:
        raise KeyError(f"model.arch {arch!r} has no model family (known: {', '.join(FAMILIES)})") from None


def family_for_hf(model_type: str) -> Family | None:
    """The family whose HF adapter converts this HF ``model_type`` (None when no family does)."""
    return next((f for f in FAMILIES.values() if model_type in f.supports.hf_model_types), None)


def all_presets() -> dict[str, tuple[Family, dict]]:
    """Every family's presets by name."""
    return {name: (f, dict(p)) for f in FAMILIES.values() for name, p in f.presets.items()}
