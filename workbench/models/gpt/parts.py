"""GPT's rank-side parts (:class:`workbench.models.family.FamilyParts`), each imported on first call."""

from __future__ import annotations

from workbench.models.family import DataPart, FamilyParts, GenerationPart, HfPart, ModelPart, MonitorPart, StepPart
from workbench.models.gpt import FAMILY

__all__ = ["GPTParts", "PARTS"]


class GPTParts(FamilyParts):
    family = FAMILY

    def model(self) -> ModelPart:
        from workbench.models.gpt import model

        return model

    def step(self) -> StepPart:
        from workbench.models.gpt import step

        return step

    def data(self) -> DataPart:
        from workbench.models.gpt import data

        return data

    def hf(self) -> HfPart:
        from workbench.models.gpt import hf

        return hf

    def generation(self) -> GenerationPart:
        from workbench.models.gpt import generate

        return generate

    def monitor(self) -> MonitorPart:
        """The MoE router statistics (its ``step_monitor`` is None for a dense model)."""
        from workbench.models.gpt import router_stats

        return router_stats


PARTS = GPTParts()
