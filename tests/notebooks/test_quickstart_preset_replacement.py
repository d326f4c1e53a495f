"""A preset the machine cannot train (demo-small on CPU) is replaced by tiny, never silently."""

from __future__ import annotations

import pytest

from workbench import notebook
from workbench.notebook import quickstart_config


@pytest.mark.parametrize("kwargs, why", [({"device": "cpu"}, "device cpu"), ({"ci": True}, "CI mode")])
def test_replaced_preset_is_named_in_the_note(kwargs, why):
    cfg, note = quickstart_config("demo-small", **kwargs)
    assert cfg.name == "tiny" and cfg.parallel.device == "cpu"
    assert f"preset 'demo-small' was replaced by 'tiny' ({why}" in note


def test_no_gpu_visible_names_the_replacement(monkeypatch):
    monkeypatch.setattr(notebook, "detect_gpus", lambda: 0)  # the machine boundary: nvidia-smi
    cfg, note = quickstart_config("demo-small")
    assert cfg.name == "tiny" and "preset 'demo-small' was replaced by 'tiny' (no GPU visible" in note
    _, plain = quickstart_config("tiny")
    assert "replaced" not in plain
