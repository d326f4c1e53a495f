"""The checkpoint tree's names and the completeness test, shared by :mod:`workbench.run.checkpoint`
(discovery, metadata) and :mod:`workbench.run.integrity` (verification).  Stdlib only."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "TRACKER_FILE", "METADATA_FILE", "ITER_RE", "CheckpointError", "iter_dir_name", "list_checkpoints",
           "is_complete", "HOOK_FIELDS", "recorded_config"]

FORMAT = "workbench-mcore-v1"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "workbench.json"
ITER_RE = re.compile(r"^iter_(\d{7})$")


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read or matched to a model; the message names the path and the fix."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{int(iteration):07d}"


def is_complete(d: Path) -> bool:
    meta = d / METADATA_FILE
    if not meta.is_file():
        return False
    try:
        data = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and bool(data.get("complete")) and data.get("format") == FORMAT


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete ``iter_XXXXXXX`` directories under ``root``, oldest first (partial saves are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = ITER_RE.match(d.name)
        if m and d.is_dir() and is_complete(d):
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


#: the config fields that name code (``train.<field>``: 'package.module:function'); a checkpoint records them as text
HOOK_FIELDS = ("forward_step", "loss_func")


def recorded_config(config: Any, where: Any = None) -> Any:
    """The ``RunConfig`` of a checkpoint's recorded config dict, as data: its hooks (``train.forward_step``,
    ``train.loss_func`` and their ``hook_kwargs``) cleared, so validating, building or converting from it never
    imports a module the checkpoint names."""
    from workbench.config import RunConfig

    data = dict(config or {})
    if isinstance(data.get("train"), dict):
        data["train"] = {**data["train"], **{k: None for k in HOOK_FIELDS}, "hook_kwargs": {}}
    return RunConfig.from_dict(data, source=None if where is None else str(where))
