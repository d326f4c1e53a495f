"""parallel.async_tp: torch's micro-pipelined TP on the compiled layer (inductor's ``_micro_pipeline_tp`` over symmetric
memory).  The rule (when a config gets it, and that it turns CUDA graphs off), its refusals (exit 2 with the field and
the fix, before any process starts) and the kernel path's words.  The pass's rewrite of the layer's graph:
``tests/backend/test_compiled_layer_tp.py``; on GPUs: ``bench/train_throughput.py`` rows ``tp2-sp-async``."""

from __future__ import annotations

import pytest

from workbench import kernel_rule
from workbench.cli import main
from workbench.config import preset, rank_environment

#: Llama-3.2-1B at TP=2 + SP on the compiled layer: what async TP needs
ASYNC = preset("llama3.2-1b", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2,
                                 "parallel.sequence_parallel": True, "parallel.async_tp": True})


def test_async_tp_is_chosen_only_where_asked_and_turns_cuda_graphs_off():
    k = kernel_rule.choose(ASYNC, te=False)
    assert k.async_tp and k.layer == "compiled" and not k.cuda_graphs_impl
    assert k.cuda_graphs_reason == kernel_rule.ASYNC_TP_BLOCKER
    # its fused ops leave no plain collective for tp_comm_overlap's pass, and pipeline over side streams themselves
    assert k.tp_overlap == "" and "CUDA_DEVICE_MAX_CONNECTIONS" not in rank_environment(ASYNC)
    plain = kernel_rule.choose(ASYNC.replace(**{"parallel.async_tp": False}), te=False)
    assert not plain.async_tp and plain.cuda_graphs_reason != kernel_rule.ASYNC_TP_BLOCKER
    # the kernel path carries what async TP measured; the plain path does not
    assert kernel_rule.ASYNC_TP_MEASURED in k.describe() and "async TP" not in plain.describe()
    assert plain.tp_overlap == "compiled" and rank_environment(ASYNC.replace(**{"parallel.async_tp": False})) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert ASYNC.validate() == []


@pytest.mark.parametrize("over, words", [
    ({"parallel.sequence_parallel": False}, "sequence_parallel: true"),
    ({"parallel.tensor_parallel": 1, "parallel.sequence_parallel": False, "parallel.nproc_per_node": 1}, "tensor_parallel >= 2"),
    ({"parallel.device": "cpu"}, "device: cpu"),
    ({"train.fp8": "tensorwise"}, "fp8: off"),
    ({"train.compile_kernels": False}, "compile_kernels: true"),
])
def test_async_tp_refusals_name_the_field_and_the_fix(over, words):
    problems = [p for p in ASYNC.replace(**over).validate() if p.field == "parallel.async_tp"]
    assert problems and any(words in p.fix for p in problems), problems
    assert not kernel_rule.choose(ASYNC.replace(**over), te=False).async_tp


def test_async_tp_on_a_stock_layer_exits_2_before_anything_starts(tmp_path, capsys):
    path = ASYNC.replace(**{"model.attention_backend": "local"}).save(tmp_path / "async.yaml")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "parallel.async_tp" in err and "async_tp: false" in err
