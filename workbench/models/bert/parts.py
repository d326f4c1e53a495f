"""BERT's rank-side parts (:class:`workbench.models.family.FamilyParts`), each imported on first call."""

from __future__ import annotations

from workbench.models.bert import FAMILY
from workbench.models.family import DataPart, FamilyParts, HfPart, ModelPart, StepPart

__all__ = ["BertParts", "PARTS"]


class BertParts(FamilyParts):
    family = FAMILY

    def model(self) -> ModelPart:
        from workbench.models.bert import model

        return model

    def step(self) -> StepPart:
        from workbench.models.bert import step

        return step

    def data(self) -> DataPart:
        """Pretraining sets, or the labelled sets of ``model.num_labels`` > 0 (:mod:`workbench.models.bert.finetune`)."""
        from workbench.models.bert import data

        return data

    def hf(self) -> HfPart:
        from workbench.models.bert import hf

        return hf


PARTS = BertParts()
