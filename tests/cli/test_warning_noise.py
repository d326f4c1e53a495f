"""The torch / megatron-core warnings every command printed (CUDA_HOME, Transformer Engine /
Apex missing x5, deprecated async save) are shown once as one line, or dropped where they say nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PYTHONPATH": str(ROOT)}


def test_megatron_import_warnings_are_one_line_each():
    code = ("import workbench\n"
            "import megatron.core.optimizer, megatron.core.models.backends, megatron.core.models.gpt.gpt_layer_specs\n"
            "import megatron.core.optimizer.clip_grads, megatron.core.hyper_comm_grid\n"
            "import warnings; warnings.warn('an unrelated warning stays', UserWarning)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert err.count("Transformer Engine / Apex not installed") == 1, err
    assert "Falling back" not in err and "warnings.warn(" not in err and "CUDA_HOME" not in err, err
    assert "an unrelated warning stays" in err


def test_a_cli_command_prints_no_third_party_noise(tmp_path):
    from tests.support import hf_gpt2

    hf_gpt2().save_pretrained(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "mc"), "--device", "cpu", "--quiet"],
                          env=ENV, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA_HOME" not in proc.stderr and "async save is deprecated" not in proc.stderr, proc.stderr
    assert proc.stderr.count("Transformer Engine / Apex") <= 1


def test_the_note_does_not_say_not_installed_where_transformer_engine_is_usable(monkeypatch):
    """megatron also warns about apex-only pieces (and TE entry points a TE version lacks) with TE installed and
    imported; the one line must not tell a user of NVIDIA's containers that TE is missing."""
    from workbench import kernel_rule, noise

    monkeypatch.setattr(kernel_rule, "te_status", lambda: ("ok", "transformer-engine 2.20.2"))
    assert noise._te_apex_note() == noise.TE_PRESENT_NOTE and "not installed" not in noise.TE_PRESENT_NOTE.split("(")[0]
    monkeypatch.setattr(kernel_rule, "te_status", lambda: ("absent", "transformer_engine is not installed"))
    assert noise._te_apex_note() == noise.TE_APEX_NOTE
