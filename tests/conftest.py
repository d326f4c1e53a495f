"""Fixtures that test folders share.  A fixture one folder alone needs lives in that folder's
``conftest.py`` (``backend/``: megatron-core's process groups on one CPU rank; ``checkpoints/``: a private
copy of a checkpoint to damage; ``browser/``: JupyterLab and Chromium; ``slurm/``: a SLURM cluster).

Plain helpers (no fixtures) live in ``tests/support``; test files import those from there and
never from each other.

In parallel (``launch/test.sh`` runs pytest-xdist's workers with ``--dist loadfile``) a test file runs whole on
one worker, so its module fixtures are built once; each worker that runs browser tests starts its own JupyterLab
(``browser/conftest.py``: a folder per worker).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import free_port as _free_port
from tests.support import hf_gpt2, write_rank_script


@pytest.fixture()
def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 (for a rendezvous / master port)."""
    return _free_port()


@pytest.fixture()
def rank_script(tmp_path: Path) -> Path:
    """The launch's fake rank (``tests.support.RANK_SCRIPT``) as a script in this test's tmp dir."""
    return write_rank_script(tmp_path)


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> Path:
    """Root of a real workbench checkpoint with a tokenizer, written by the product path: a random HF GPT-2
    (``tests.support.hf_gpt2``) and a small trained tokenizer in ``<root>/../hf``, converted by
    ``workbench.conversion.hf_to_megatron`` (fp32, 1 CPU process).  One per test module; tests never modify
    it (they damage a copy)."""
    from workbench.conversion import hf_to_megatron
    from workbench.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gpt2-checkpoint")
    hf_gpt2(seed=3).save_pretrained(root / "hf")
    train_tokenizer(["the cat sat on the mat", "a dog ran in the park"] * 20, vocab_size=300, out_dir=root / "hf")
    return hf_to_megatron(root / "hf", root / "ckpt", dtype="fp32", device="cpu", progress=False).output
