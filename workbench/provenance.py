"""Provenance stamps for evidence and benchmark rows: which device, when, which commit.

GPU machines get a copy of the tree without ``.git``; set ``GIT_COMMIT`` there (the lead's
device commands do) so every JSON line still names the commit it measured.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """``$GIT_COMMIT`` if set, else ``git rev-parse HEAD`` of the checkout, else ``"unknown"``."""
    env = os.environ.get("GIT_COMMIT", "").strip()
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        return sha if out.returncode == 0 and len(sha) == 40 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def stamp(device: str | None = None) -> dict:
    """``{"device", "date", "git_commit"}``; device defaults to the CUDA device name (or "cpu")."""
    if device is None:
        try:
            import torch

            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except Exception:  # noqa: BLE001 - a stamp must never fail the run it describes
            device = "unknown"
    return {"device": device, "date": utc_now(), "git_commit": git_commit()}
