"""The checkpoint tree's names and the completeness test, shared by :mod:`workbench.checkpoint.tree` (discovery),
:mod:`workbench.checkpoint.meta` (metadata) and :mod:`workbench.checkpoint.integrity` (verification).  Stdlib only."""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["FORMAT", "TRACKER_FILE", "METADATA_FILE", "ITER_RE", "CheckpointError", "iter_dir_name", "list_checkpoints",
           "is_complete"]

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

