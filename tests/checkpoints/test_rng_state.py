"""The random states a training checkpoint carries (``workbench.checkpoint.dist.rng_state`` / ``set_rng_state``), in process."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture
def tracker():
    from megatron.core.tensor_parallel import random as mrandom

    t = mrandom.get_cuda_rng_tracker()
    before = t.get_states()
    t.set_states({"model-parallel-rng": torch.Generator().manual_seed(7).get_state()})
    yield t
    t.set_states(before)


def test_states_round_trip_through_a_weights_only_load(tracker, tmp_path):
    from workbench.checkpoint import dist as ck

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = ck.rng_state(cuda=False)
    torch.save(saved, tmp_path / "rng.pt")
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), cuda=False)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
    assert torch.equal(tracker.get_states()["model-parallel-rng"], saved["tracker"]["model-parallel-rng"])


def test_a_stream_the_checkpoint_lacks_keeps_this_runs_seeding(tracker):
    """A checkpoint from CPU mode (no tracked streams) or another layout never wipes a stream this run uses."""
    from workbench.checkpoint import dist as ck

    mine = tracker.get_states()["model-parallel-rng"].clone()
    state = ck.rng_state(cuda=False)
    state["tracker"] = {"another-stream": torch.Generator().manual_seed(1).get_state()}
    ck.set_rng_state(state, cuda=False)
    assert set(tracker.get_states()) == {"model-parallel-rng"}
    assert torch.equal(tracker.get_states()["model-parallel-rng"], mine)
