"""Megatron's CUDA graphs of TE's layer serve training calls only (workbench.backend.model.GraphedTransformerLayer).

Real mcore on one CPU rank: megatron's layer built from the workbench spec with the graphed class.  The CUDA-graph
manager itself needs a GPU and TE; here it is a stand-in attribute (megatron's own check is ``hasattr``), and the
test checks the gate the workbench adds on top: evaluation and no-grad forwards never reach the manager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from workbench.config import preset

from tests.support import free_port

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def graphed_layer():
    from workbench import kernel_rule
    from workbench.backend import cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests
    from workbench.rank.build import build_model
    from workbench.backend.model import GraphedTransformerLayer, layer_class

    cfg = preset("tiny")
    te_graphs = kernel_rule.choose(preset("gpt2-small", **{"model.attention_backend": "te"}), te=True)
    assert layer_class(te_graphs) is GraphedTransformerLayer  # what the TE specs get where the rule graphs TE's layer
    initialize_for_tests(cfg, port=free_port())
    torch.manual_seed(0)
    try:
        model = build_model(cfg)
        layer = model.decoder.layers[0]
        layer.__class__ = GraphedTransformerLayer  # megatron's layer, the workbench's gate
        yield layer
    finally:
        destroy()
        cpu_mode.disable()


def test_graphs_serve_training_calls_only(graphed_layer):
    layer = graphed_layer
    assert not layer._should_call_local_cudagraph(attention_mask=None)  # no manager: megatron's eager path
    layer.cudagraph_manager = object()  # megatron looks for the attribute
    try:
        layer.train()
        assert layer._should_call_local_cudagraph(attention_mask=None)
        with torch.no_grad():
            assert not layer._should_call_local_cudagraph(attention_mask=None)
        layer.eval()
        assert not layer._should_call_local_cudagraph(attention_mask=None)
    finally:
        del layer.cudagraph_manager
        layer.train()


def test_other_layers_keep_megatrons_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from workbench import kernel_rule
    from workbench.backend.model import layer_class

    plain = kernel_rule.choose(preset("gpt2-small", **{"model.attention_backend": "te", "train.cuda_graphs": False}), te=True)
    assert layer_class(plain) is TransformerLayer
    assert layer_class(dataclasses.replace(plain, cuda_graphs_impl="megatron")).__name__ == "GraphedTransformerLayer"


def test_only_the_training_step_asks_megatron_for_graphs(monkeypatch):
    from workbench import kernel_rule
    from workbench.backend import model

    monkeypatch.setattr(kernel_rule, "te_available", lambda: True)  # the boundary: a machine with TE installed
    te = preset("gpt2-small", **{"model.attention_backend": "te"})
    assert model.training_step_fields(te) == {"cuda_graph_impl": "local", "use_te_rng_tracker": True}
    assert model.training_step_fields(te.replace(**{"parallel.recompute": "selective"})) == {}
    assert model.training_step_fields(preset("gpt2-small")) == {}  # the compiled layer: torch's graphs
    # generation, conversion and verification build from the plain config: no graph managers there
    assert model.transformer_config(te).cuda_graph_impl == "none"
    assert model.transformer_config(te, **model.training_step_fields(te)).cuda_graph_impl == "local"
