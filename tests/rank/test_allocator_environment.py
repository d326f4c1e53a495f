"""Expert and context parallelism run their ranks with the CUDA caching allocator's expandable segments (the
dispatched token buffers, the ring's blocks change size; the default allocator fragments:
``workbench.config.rank_environment``): the
backend's entry point sets it before importing torch, a launch's own value is kept and said so in the kernel path,
nothing is set without EP or CP, or on CPU."""

from __future__ import annotations

import os

from workbench.config import preset, rank_environment

EXPANDABLE = "expandable_segments:True"


def _ep2(**over):
    return preset("moe-research", **{"parallel.expert_parallel": 2, "parallel.nproc_per_node": 2, **over})


def test_expert_parallel_runs_ask_for_expandable_segments():
    assert rank_environment(_ep2()) == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_environment(preset("moe-research"))  # EP = 1: one buffer size
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rank_environment(preset("gpt2-small"))
    assert rank_environment(_ep2(**{"parallel.device": "cpu"})) == {}


def test_context_parallel_runs_ask_for_it_too_and_say_why(monkeypatch):
    from workbench.backend import distributed

    def cp2(**over):
        return preset("llama3.2-1b", **{"parallel.context_parallel": 2, "parallel.nproc_per_node": 2,
                                        "model.seq_length": 16384, "train.micro_batch_size": 1,
                                        "train.global_batch_size": 2, **over})

    assert rank_environment(cp2()) == {"PYTORCH_CUDA_ALLOC_CONF": EXPANDABLE}
    assert rank_environment(cp2(**{"parallel.device": "cpu"})) == {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE)
    assert distributed.allocator_note(cp2()) == (f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} (context parallelism: the ring's "
                                                 "blocks come whole and in halves and travel between ranks)")


def test_the_entry_point_sets_it_before_cuda_and_the_kernel_path_says_what_is_in_force(monkeypatch, tmp_path):
    from workbench.backend import distributed
    from workbench.rank import __main__ as entry

    cfg, path = _ep2(), tmp_path / "run.json"
    cfg.save(path)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert distributed.allocator_note(cfg) == "PYTORCH_CUDA_ALLOC_CONF not set before CUDA started (default allocator)"
    entry._rank_environment(["--config", str(path), "--run-dir", str(tmp_path)])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == EXPANDABLE
    assert distributed.allocator_note(cfg).startswith(f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE} (expert parallelism")
    # a launch's own allocator settings win, and the note says whose they are
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    entry._rank_environment(["--config", str(path), "--run-dir", str(tmp_path)])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    assert distributed.allocator_note(cfg) == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (set by the launch; kept)"
    assert distributed.allocator_note(preset("gpt2-small")) == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (set by the launch)"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert distributed.allocator_note(preset("gpt2-small")) is None


def test_once_cuda_has_started_the_allocator_is_set_at_run_time_and_the_note_tells_the_truth(monkeypatch):
    """An in-process caller that started CUDA before ``initialize``: the environment variable is read too late, so the
    settings go through torch's run-time setter (the boundary: no GPU here) and the note says so only if it took
    them; a queue note never sets the allocator's variable behind its back."""
    import torch

    from workbench.backend import distributed

    cfg = _ep2(**{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 4})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert distributed.hardware_queue_note(cfg) == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    taken: list = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", taken.append)
    distributed._apply_environment(cfg)
    assert taken == [EXPANDABLE] and distributed.allocator_note(cfg).startswith(f"PYTORCH_CUDA_ALLOC_CONF={EXPANDABLE}")

    def refuse(conf):
        raise RuntimeError("not supported")

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    distributed._apply_environment(cfg)
    assert distributed.allocator_note(cfg) == "PYTORCH_CUDA_ALLOC_CONF not set before CUDA started (default allocator)"
