"""parallel.tp_chunked: TP = 2 + SP with each compiled-layer GEMM in two row chunks, each collective an exchange with
the peer under the other chunk's GEMM.  The rule (when a config gets it), its refusals (exit 2 with the field and the
fix, before any process starts) and the kernel path's words.  The maths on two gloo ranks and the generated code's
order: ``tests/backend/test_compiled_layer_tp.py``; on GPUs: ``bench/train_throughput.py`` rows ``tp2-sp-chunked``."""

from __future__ import annotations

import pytest

from workbench import kernel_rule
from workbench.backend.model import kernel_path, transformer_config
from workbench.cli import main
from workbench.config import preset

#: Llama-3.2-1B at TP=2 + SP on the compiled layer: what chunking needs
CHUNKED = preset("llama3.2-1b", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2,
                                   "parallel.sequence_parallel": True, "parallel.tp_chunked": True})


def test_chunking_is_chosen_only_where_asked_and_reaches_the_layer():
    k = kernel_rule.choose(CHUNKED, te=False)
    assert k.tp_overlap == "chunked" and k.layer == "compiled" and not k.async_tp
    plain = kernel_rule.choose(CHUNKED.replace(**{"parallel.tp_chunked": False}), te=False)
    assert plain.tp_overlap == "compiled"
    tc = transformer_config(CHUNKED, k)
    assert tc.workbench_tp_chunked and not tc.workbench_tp_comm_overlap
    assert not transformer_config(CHUNKED.replace(**{"parallel.tp_chunked": False}), plain).workbench_tp_chunked
    assert "chunked" in kernel_path(CHUNKED, k)["tp_comm_overlap"]
    assert CHUNKED.validate() == []


@pytest.mark.parametrize("over, words", [
    ({"parallel.sequence_parallel": False}, "sequence_parallel: true"),
    ({"parallel.tensor_parallel": 1, "parallel.sequence_parallel": False, "parallel.nproc_per_node": 1}, "tensor_parallel >= 2"),
    ({"parallel.tensor_parallel": 4, "parallel.nproc_per_node": 4}, "tensor_parallel: 2"),
    ({"train.fp8": "tensorwise"}, "fp8: off"),
    ({"parallel.async_tp": True}, "set one of them false"),
])
def test_chunking_refusals_name_the_field_and_the_fix(over, words):
    problems = [p for p in CHUNKED.replace(**over).validate() if p.field == "parallel.tp_chunked"]
    assert problems and any(words in p.fix for p in problems), problems
    assert kernel_rule.choose(CHUNKED.replace(**over), te=False).tp_overlap != "chunked"


def test_chunking_on_a_stock_layer_exits_2_before_anything_starts(tmp_path, capsys):
    path = CHUNKED.replace(**{"model.attention_backend": "local"}).save(tmp_path / "chunked.yaml")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "parallel.tp_chunked" in err and "tp_chunked: false" in err
