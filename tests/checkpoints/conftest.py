"""Fixtures of the checkpoint-safety tests."""

from __future__ import annotations

import shutil

import pytest

from workbench.checkpoint import find_checkpoint


@pytest.fixture()
def ckpt(gpt2_checkpoint, tmp_path):
    """(checkpoint root, its iteration directory): this test's private copy of ``gpt2_checkpoint`` to damage."""
    root = tmp_path / "ckpt"
    shutil.copytree(gpt2_checkpoint, root)
    return root, find_checkpoint(root)
