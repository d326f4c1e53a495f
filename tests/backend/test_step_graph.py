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
