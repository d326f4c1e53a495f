"""Model families, torch-free: ``workbench/families/<family>/``, one declaration each (see :mod:`workbench.families.family`).

``model.arch`` names the family; everything that depends on the architecture is asked of it
instead of branching on it.  This package stands below the config: the registry holds the
declarations (:func:`family_of`: supports, presets, config fields and rules, shape terms) that
config validation, the planner, the advisor and the widgets read, and :mod:`workbench.models.parts`
finds the rank-side parts in ``workbench/models/<family>/`` (:func:`workbench.models.parts.parts_of`:
builder, train step, datasets, HF adapter, generation engine), above the backend's building blocks.
What the declarations share lives in :mod:`workbench.families.common`.
"""

from __future__ import annotations

from typing import Any

from workbench.families.family import Family, Supports
from workbench.families.bert import FAMILY as BERT
from workbench.families.gpt import FAMILY as GPT
from workbench.families.t5 import FAMILY as T5

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
