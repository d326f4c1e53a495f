"""One model chunk of a run: its family's builder (:meth:`workbench.models.parts.FamilyParts.model`), on the rank's device.

The family builds from the blocks of :mod:`workbench.backend.model` (``transformer_config``, layer specs,
norms); this module is where the generic rank side asks the family, so the blocks never import one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from workbench.config import RunConfig
from workbench.models.parts import parts_of

__all__ = ["build_model"]


def build_model(
    cfg: RunConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config: Any = None,
) -> Any:
    """One model chunk for this rank, built by the config's family (parallel state must be initialised),
    on this rank's GPU when ``parallel.device`` is cuda."""
    model = parts_of(cfg).model().build(cfg, pre_process=pre_process, post_process=post_process,
                                        vp_stage=vp_stage, config=config)
    if cfg.parallel.device == "cuda" and torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
