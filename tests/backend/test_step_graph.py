"""The whole-step CUDA graph's host side (workbench.backend.step_graph): what runs eagerly, what it refuses.

The capture and replay need a GPU: tests/gpu_proofs/step_graph_proof.py trains each family with and without the
graph and compares every step's loss.  Here, on CPU, the warm-up steps and the refusals, around a schedule that
records what it was handed.
"""

from __future__ import annotations

import pytest
import torch

from workbench.backend import step_graph


def _stream(n: int, shape=(2, 3)):
    for i in range(n):
        yield {"x": torch.full(shape, float(i)), "y": torch.full(shape, 1.0)}


def _recording_schedule(seen: list):
    def forward_backward(*, data_iterator, num_microbatches, forward_only, **kw):
        got = [next(data_iterator) for _ in range(num_microbatches)]
        seen.append(([float(b["x"][0, 0]) for b in got], forward_only, kw))
        return [{"loss": torch.tensor(float(len(seen)))}]
    return forward_backward


def test_the_warm_up_steps_run_eagerly_on_the_stream_s_micro_batches_in_order():
    seen: list = []
    graph = step_graph.StepGraph(_recording_schedule(seen), warmup=2)
    it = _stream(8)
    for _ in range(2):
        out = graph(data_iterator=it, num_microbatches=3, forward_only=False, model="m", seq_length=3)
    assert [s[0] for s in seen] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert all(not s[1] and s[2] == {"model": "m", "seq_length": 3} for s in seen)
    assert out[0]["loss"].item() == 2.0 and not graph.captured and graph.eager_steps == 0
    assert next(it)["x"][0, 0].item() == 6.0  # the stream advanced by exactly the steps' micro-batches


@pytest.mark.parametrize("call", [
    {"data_iterator": iter([]), "forward_only": True, "model": "m"},
    {"data_iterator": [iter([]), iter([])], "forward_only": False, "model": ["a", "b"]},
    {"data_iterator": iter([]), "forward_only": False, "model": ["a", "b"]},
])
def test_evaluation_and_model_chunks_are_refused(call):
    seen: list = []
    with pytest.raises(ValueError, match="one model chunk"):
        step_graph.StepGraph(_recording_schedule(seen))(num_microbatches=1, **call)
    assert seen == []


def test_a_micro_batch_of_another_shape_or_dtype_has_another_signature():
    a, b = next(_stream(1)), next(_stream(1, shape=(2, 4)))
    assert step_graph._signature(a) == step_graph._signature(next(_stream(1)))
    assert step_graph._signature(a) != step_graph._signature(b)
    assert step_graph._signature(a) != step_graph._signature({**a, "y": a["y"].double()})


class _Chunk(torch.nn.Linear):
    """A model chunk with DDP's gradient-buffer reset (megatron's ``zero_grad_buffer``), counted."""

    def __init__(self):
        super().__init__(2, 2)
        self.zeroed = 0

    def zero_grad_buffer(self):
        self.zeroed += 1


def test_a_capture_that_fails_leaves_the_run_training_eagerly_from_a_clean_step():
    """Here the capture fails for real (no GPU); on a GPU, for anything CUDA refuses to record.  The step the capture
    was for, and every later one, runs eagerly on its own micro-batches; the half-run backward's Python side (.grad,
    DDP's buffer flags) is reset first, the schedule's gradient finalisation is restored, and it is said once."""
    seen, said = [], []
    chunk = _Chunk()
    chunk.weight.grad = torch.ones(2, 2)
    finalize = object()
    config = type("Config", (), {"finalize_model_grads_func": finalize})()
    graph = step_graph.StepGraph(_recording_schedule(seen), config, warmup=1, log=said.append)
    it = _stream(12)
    for _ in range(4):
        graph(data_iterator=it, num_microbatches=3, model=chunk)
    assert [s[0] for s in seen] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
    assert graph.failed and not graph.captured and graph.eager_steps == 3
    assert chunk.weight.grad is None and chunk.zeroed == 1
    assert config.finalize_model_grads_func is finalize
    assert len(said) == 1 and "capture failed" in said[0] and "eagerly" in said[0]


def test_the_note_on_a_step_unlike_the_captured_ones_names_what_differs():
    a = [step_graph._signature(next(_stream(1)))]
    b = [step_graph._signature(next(_stream(1, shape=(2, 4))))]
    text = step_graph._differs(tuple(a), tuple(b))
    assert text.startswith("micro-batch 0") and "(2, 4)" in text and "(2, 3)" in text
    assert "2 micro-batches against 1" == step_graph._differs(tuple(a), tuple(a + a))


class _Graph:
    """Stands in for the device: ``torch.cuda.CUDAGraph`` (counts replays) and ``torch.cuda.graph`` (runs the body,
    as a capture does on the host; ``refuse``: its end raises, as CUDA's ``capture_end`` does for a refused capture)."""

    replays = 0

    def replay(self):
        type(self).replays += 1


def _device(monkeypatch, refuse: bool) -> list:
    overrides: list = []

    class Capture:
        def __init__(self, graph, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            if refuse and exc[0] is None:
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    _Graph.replays = 0
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.autograd.graph, "set_override_stale_capture_stream", overrides.append, raising=False)
    return overrides


def _schedule(seen: list, finalized: list):
    """megatron's no-pipelining schedule in miniature: the micro-batches, a backward that leaves ``.grad`` (DDP's hooks
    would clear it), then ``config.finalize_model_grads_func([model], None)``."""
    def forward_backward(*, data_iterator, num_microbatches, forward_only, model, config):
        seen.append([float(next(data_iterator)["x"][0, 0]) for _ in range(num_microbatches)])
        model.weight.grad = torch.ones_like(model.weight)
        config.finalize_model_grads_func([model], None)
        return [{"loss": torch.tensor(seen[-1][0])}]
    return forward_backward


def test_replays_take_each_step_s_micro_batches_and_finalise_after_the_graph(monkeypatch):
    overrides = _device(monkeypatch, refuse=False)
    seen, finalized = [], []
    config = type("Config", (), {})()
    config.finalize_model_grads_func = lambda *a, **k: finalized.append(a)
    fb = _schedule(seen, finalized)
    graph = step_graph.StepGraph(lambda **kw: fb(config=config, **kw), config, warmup=1, log=lambda m: None)
    chunk, it = _Chunk(), _stream(12)
    modes = []
    for _ in range(4):
        graph(data_iterator=it, num_microbatches=3, model=chunk)
        modes.append(graph.last)
    assert modes == ["eager", "captured", "replayed", "replayed"] and graph.captured and _Graph.replays == 3
    assert seen == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # the schedule's Python ran for the warm-up and the capture only
    assert [float(b["x"][0, 0]) for b in graph._inputs] == [9.0, 10.0, 11.0]  # the last step's, copied in
    assert len(finalized) == 1 + 3 and finalized[-1] == ([chunk], None)  # after each replay, with the schedule's args
    assert overrides in ([], [True, False])  # on only while capturing (torch >= 2.14)


def test_a_refused_capture_restores_the_schedule_and_reruns_its_step_eagerly(monkeypatch):
    overrides = _device(monkeypatch, refuse=True)
    seen, finalized, said = [], [], []
    config = type("Config", (), {})()
    real = config.finalize_model_grads_func = lambda *a, **k: finalized.append(a)
    fb = _schedule(seen, finalized)
    graph = step_graph.StepGraph(lambda **kw: fb(config=config, **kw), config, warmup=1, log=said.append)
    chunk, it = _Chunk(), _stream(9)
    modes = []
    for _ in range(3):
        graph(data_iterator=it, num_microbatches=3, model=chunk)
        modes.append(graph.last)
    assert modes == ["eager", "eager", "eager"] and not graph.captured and _Graph.replays == 0
    assert "previous error during capture" in graph.failed and len(said) == 1
    # the refused step ran again, eagerly, on its own micro-batches, with the real finalisation restored
    assert seen == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]
    assert config.finalize_model_grads_func is real and len(finalized) == 3
    assert chunk.zeroed == 1 and overrides in ([], [True, False])
