"""The rank side of a model family: its parts, the modules of ``workbench/models/<family>/``, one mechanism for all.

:data:`workbench.families.FAMILIES` holds the torch-free declarations that config validation, the planner and
the widgets read; :class:`FamilyParts` finds the parts that build, train, convert and generate in the
family's rank-side package, by module name (``<package>.model``, ``.step``, ``.data``, ``.hf``, ``.generate``,
``.router_stats``), each imported where it is first asked for: conversion's notebook side loads the ``hf``
adapter without megatron-core, and the rank entry point asks for a family's parts without importing them.  It
stands on the rank side, beside the parts it loads (the declarations below never import it), and it is the one
place that imports a part by name (:data:`PART_MODULES`).  Its callers: the rank entry point
(:mod:`workbench.rank`: its trainer, builder, data path and generation engine), the one-process model of
:mod:`workbench.models.common.one_process` and conversion; the parts stand above the backend's blocks, which
import neither.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from workbench.families import Family, family_of
from workbench.families.family import DataPart, GenerationPart, HfPart, ModelPart, MonitorPart, StepPart

__all__ = ["FamilyParts", "PART_MODULES", "REQUIRED_PARTS", "parts_of"]

#: part accessor -> the module of the family's package that holds the part
PART_MODULES: dict[str, str] = {"model": "model", "step": "step", "data": "data", "hf": "hf",
                                "generation": "generate", "monitor": "router_stats"}
#: the parts every family has; the others are None where the family's package has no such module
REQUIRED_PARTS = ("model", "step", "data")


class FamilyParts:
    """The rank-side parts of ``family``, the modules of ``package`` (see :data:`PART_MODULES`).

    A part the family does not have: None for the optional ones (``hf``, ``generation``, ``monitor``); for a
    required one a LookupError that names the family, the part and the module it looked for."""

    def __init__(self, family: Family, package: str):
        self.family = family
        self.package = package

    def __repr__(self) -> str:
        return f"FamilyParts({self.family.name!r}, {self.package!r})"

    def module(self, part: str) -> str:
        """The dotted name of the module that holds ``part`` (an accessor of :data:`PART_MODULES`)."""
        return f"{self.package}.{PART_MODULES[part]}"

    def part(self, part: str) -> Any:
        """The module of ``part``, imported now; None where the family has no such optional part."""
        name = self.module(part)
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError as e:  # the package itself is missing (not a module it imports)
            if e.name is None or not (self.package == e.name or self.package.startswith(e.name + ".")):
                raise
            spec = None
        if spec is None:
            if part in REQUIRED_PARTS:
                raise LookupError(f"the {self.family.name} family has no {part} part: every family needs a module "
                                  f"{name} (see workbench.families.family)")
            return None
        return importlib.import_module(name)

    def model(self) -> ModelPart:
        return self.part("model")

    def step(self) -> StepPart:
        return self.part("step")

    def data(self) -> DataPart:
        """Its datasets (BERT's: pretraining sets, or the labelled sets of ``model.num_labels`` > 0)."""
        return self.part("data")

    def hf(self) -> HfPart | None:
        return self.part("hf")

    def generation(self) -> GenerationPart | None:
        return self.part("generation")

    def monitor(self) -> MonitorPart | None:
        """A per-step monitor (GPT's MoE router statistics; its ``step_monitor`` is None for a dense model)."""
        return self.part("monitor")


_PARTS: dict[str, FamilyParts] = {}


def parts_of(cfg_or_family: Any) -> FamilyParts:
    """The parts of a RunConfig's family (or of a :class:`Family`, or an ``arch`` name): the modules of
    ``workbench.models.<name>``. KeyError names the known families."""
    family = cfg_or_family if isinstance(cfg_or_family, Family) else family_of(cfg_or_family)
    if family.name not in _PARTS:
        _PARTS[family.name] = FamilyParts(family, f"workbench.models.{family.name}")
    return _PARTS[family.name]
