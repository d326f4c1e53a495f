"""Full TP=1 state dicts <-> workbench checkpoints, through megatron-core's own save and load.

The state dict is loaded into (or read from) the TP=1/PP=1 CPU model of
:func:`workbench.models.common.one_process.build_full_model`, so the checkpoint's storage keys (stacked layers,
TE-style norm names, the SwiGLU factory, tied output weights on the last stage) are megatron's own
``sharded_state_dict``'s.  Call inside :func:`workbench.models.common.one_process.single_process_group`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.checkpoint import checkpoint_config, load_checkpoint, read_metadata, save_checkpoint
from workbench.config import RunConfig
from workbench.models.common.one_process import build_full_model

__all__ = ["save_full_state_dict", "load_full_state_dict"]


def _model_state(model: Any) -> dict[str, Any]:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and hasattr(v, "shape")}


def save_full_state_dict(root: str | Path, iteration: int, full_sd: dict[str, Any], cfg: RunConfig,
                         dtype: str | None = None, tokenizer: Any = None, extra: dict | None = None) -> Path:
    """Write a full TP=1 state dict as a workbench checkpoint (any TP/PP can load it). Needs a process group."""
    import torch

    model = build_full_model(cfg, dtype)
    own = _model_state(model)
    missing = sorted(set(own) - set(full_sd))
    unexpected = sorted(set(full_sd) - set(own))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, p in own.items():
            t = full_sd[k]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{k}: shape {tuple(t.shape)} but the model wants {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
    return save_checkpoint(root, iteration, [model], cfg, extra=extra, tokenizer=tokenizer)


def load_full_state_dict(path: str | Path, cfg: RunConfig | None = None, dtype: str | None = None) -> tuple[dict[str, Any], dict]:
    """(full TP=1 state dict, metadata) of a workbench checkpoint. Needs a process group."""
    cfg = cfg or checkpoint_config(read_metadata(path))
    model = build_full_model(cfg, dtype)
    meta = load_checkpoint(path, [model], load_optimizer=False)
    return {k: v.detach().clone() for k, v in _model_state(model).items()}, meta
