"""One refusal path: a checkpoint whose ``workbench.json`` config does not describe the tensors it stores (an edited
layer count or vocabulary: its files are intact, so no checksum catches it) is refused by every command that reads
it with exit 2 and the same message, before any process starts: ``inspect``, ``megatron-to-hf``, ``reshape``,
``verify`` (as a real process), ``generate`` and the launch of a run that loads it.  Where it used to pass the
pre-checks, ``verify``, ``generate`` and the resumed run failed in their ranks with exit 1 and a traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support import ROOT
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


def _message(out: str, d) -> str:
    """The refusal as the command printed it: from ``checkpoint <dir>:`` to the end of its line."""
    m = re.search(rf"checkpoint {re.escape(str(d))}: the config in its workbench\.json .*", out)
    assert m, out
    return m.group(0)


@pytest.fixture(params=["num_layers", "vocab_size"])
def altered(ckpt, request):
    """(root, iteration dir, what the message says): the checkpoint with its recorded model changed."""
    root, d = ckpt
    meta = json.loads((d / "workbench.json").read_text())
    model = meta["config"]["model"]
    said = {"num_layers": f"decoder.layers.* hold {model['num_layers']} layers, the config's model.num_layers is "
                          f"{model['num_layers'] + 1}",
            "vocab_size": f"embedding.word_embeddings.weight is stored as"}[request.param]
    model[request.param] = model[request.param] + 1 if request.param == "num_layers" else model[request.param] * 2
    (d / "workbench.json").write_text(json.dumps(meta))
    return root, d, said


def test_every_command_refuses_it_with_exit_2_and_the_same_message(altered, tmp_path, capsys):
    from workbench.config import load_config

    root, d, said = altered
    runs = {
        "inspect": ["convert", "inspect", root],
        "megatron-to-hf": ["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf", "--quiet"],
        "reshape": ["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"],
        "generate": ["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu", "--max-new-tokens", "2"],
    }
    cfg = load_config(root / "workbench_config.json").replace(**{"checkpoint.load_dir": str(root)})
    cfg.save(tmp_path / "resume.json")
    runs["launch"] = ["launch", tmp_path / "resume.json", "--run-dir", tmp_path / "run"]  # the real launch, not a dry run
    messages = {}
    for name, argv in runs.items():
        rc, out = run_cli(argv, capsys)
        assert rc == 2, (name, out)
        assert "Traceback" not in out and "rank" not in out.lower(), (name, out)
        messages[name] = _message(out, d)
    assert said in messages["inspect"] and "copy the checkpoint again from its source" in messages["inspect"]
    assert len(set(messages.values())) == 1, messages
    assert not (tmp_path / "hf").exists() and not (tmp_path / "rs").exists() and not (tmp_path / "run").exists()


def test_verify_refuses_it_before_starting_ranks(altered, gpt2_checkpoint):
    """``workbench convert verify`` as a real process: exit 2 with the message, no torchrun."""
    root, d, said = altered
    p = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "verify", "--ckpt", str(root),
                        "--hf", str(gpt2_checkpoint.parent / "hf"), "--seq-length", "8", "--batch-size", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-3000:]
    msg = _message(p.stderr, d)
    assert said in msg and "torchrun" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_the_checkpoints_of_every_family_pass(tmp_path):
    """The comparison holds for each family's checkpoint as the converter writes it (no false refusal)."""
    from workbench.conversion import hf_to_megatron, make_random_hf_model
    from workbench.checkpoint import find_checkpoint, verify_checkpoint

    for mt in ("llama", "megatron-bert", "t5", "mixtral"):
        make_random_hf_model(tmp_path / mt / "hf", mt)
        out = hf_to_megatron(tmp_path / mt / "hf", tmp_path / mt / "ckpt", dtype="fp32", device="cpu", progress=False).output
        verify_checkpoint(find_checkpoint(out))
