"""The rank side of the family registry: each family's parts (:class:`workbench.models.family.FamilyParts`).

:data:`workbench.models.FAMILIES` holds the torch-free declarations that config validation, the planner
and the widgets read; this table holds the parts that build, train, convert and generate, each imported
where it is first asked for.  The two stand apart because the parts import the backend's building
blocks and the config, which read the declarations: one table under them, one above.  A family is one
line in each (:func:`check_registry` and the unit tests hold them equal).
"""

from __future__ import annotations

from typing import Any

from workbench.models import FAMILIES, Family, family_of
from workbench.models.bert.parts import PARTS as BERT
from workbench.models.family import FamilyParts
from workbench.models.gpt.parts import PARTS as GPT
from workbench.models.t5.parts import PARTS as T5

__all__ = ["PARTS", "parts_of", "check_registry"]

#: ``model.arch`` -> the family's parts
PARTS: dict[str, FamilyParts] = {p.family.name: p for p in (GPT, BERT, T5)}


def check_registry() -> list[str]:
    """Each family that one table names and the other does not (empty: they agree)."""
    return ([f"{name}: declared in workbench.models.FAMILIES, no parts in workbench.models.parts.PARTS"
             for name in FAMILIES if name not in PARTS] +
            [f"{name}: parts in workbench.models.parts.PARTS, not declared in workbench.models.FAMILIES"
             for name in PARTS if name not in FAMILIES])


def parts_of(cfg_or_family: Any) -> FamilyParts:
    """The parts of a RunConfig's family (or of a :class:`Family`, or an ``arch`` name). KeyError names the known ones."""
    family = cfg_or_family if isinstance(cfg_or_family, Family) else family_of(cfg_or_family)
    try:
        return PARTS[family.name]
    except KeyError:
        raise KeyError(f"model family {family.name!r} has no parts (known: {', '.join(PARTS)}): "
                       f"add its parts.py's PARTS to workbench.models.parts.PARTS") from None
