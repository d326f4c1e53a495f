"""T5's rank-side parts (:class:`workbench.models.family.FamilyParts`), each imported on first call."""

from __future__ import annotations

from workbench.models.family import DataPart, FamilyParts, GenerationPart, HfPart, ModelPart, StepPart
from workbench.models.t5 import FAMILY

__all__ = ["T5Parts", "PARTS"]


class T5Parts(FamilyParts):
    family = FAMILY

    def model(self) -> ModelPart:
        from workbench.models.t5 import model

        return model

    def step(self) -> StepPart:
        from workbench.models.t5 import step

        return step

    def data(self) -> DataPart:
        from workbench.models.t5 import data

        return data

    def hf(self) -> HfPart:
        from workbench.models.t5 import hf

        return hf

    def generation(self) -> GenerationPart:
        """Encoder once, decoder with self- and cross-attention caches (:class:`workbench.models.t5.generate.T5Engine`)."""
        from workbench.models.t5 import generate

        return generate


PARTS = T5Parts()
