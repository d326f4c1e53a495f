"""Checkpoint metadata (``workbench.json``, :class:`workbench.checkpoint.CheckpointMeta`), read without torch, and
the checkpoint package's torch-free import (what the notebook side and the launch checks read)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import workbench.checkpoint as ck

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_metadata_record(tmp_path):
    d = tmp_path / "ck" / ck.iter_dir_name(3)
    d.mkdir(parents=True)
    (d / ck.METADATA_FILE).write_text(json.dumps({"format": ck.FORMAT, "iteration": 3, "complete": True,
                                                  "config": {"name": "x"}, "has_optimizer": True, "source": "hf"}))
    (tmp_path / "ck" / ck.TRACKER_FILE).write_text("3")
    meta = ck.read_checkpoint(tmp_path / "ck")
    assert isinstance(meta, ck.CheckpointMeta) and meta.path == d and meta.iteration == 3 and meta.has_optimizer
    assert meta.extra == {"source": "hf"}
    # declared fields the file lacks read as their defaults (an older checkpoint: no scheduler, no random states)
    assert not meta.has_rng and not meta.has_scheduler
    assert ck.read_metadata(tmp_path / "ck") == {**json.loads((d / ck.METADATA_FILE).read_text()), "tokenizer": None,
                                                 "has_scheduler": False, "has_rng": False, "path": str(d)}
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.read_checkpoint(tmp_path / "nope")


def test_checkpoint_package_is_torch_free_at_import():
    code = ("import sys, workbench.checkpoint; bad = [m for m in ('torch', 'megatron') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_recorded_config_reads_the_same_without_the_tensorboard_package(monkeypatch):
    """A checkpoint of a run that logged to TensorBoard is read on a machine without the tensorboard package: its
    recorded config clears the log (as it clears the hooks), so it validates and the checks that read it still run."""
    import workbench.config_fields as fields
    from workbench.checkpoint.config_check import recorded_config
    from workbench.config import preset

    data = preset("tiny", **{"train.tensorboard": True}).to_dict()
    real = fields.module_exists
    monkeypatch.setattr(fields, "module_exists", lambda name: False if name == "tensorboard" else real(name))
    assert any(q.field == "train.tensorboard" for q in preset("tiny", **{"train.tensorboard": True}).validate())
    cfg = recorded_config(data)
    assert cfg.train.tensorboard is False and cfg.validate() == []
