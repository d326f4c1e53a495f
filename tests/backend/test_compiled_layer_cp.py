"""The compiled dense layer under context parallelism (#53): self-attention leaves the graph for the ring
(``compiled_layer._ring_context``, ``torch.compiler.disable``) and the layer's pieces around it stay compiled.

Under ``torch.compile`` (the ``aot_eager`` backend: dynamo's graph break and AOTAutograd's split backward, without
inductor's code generation) a layer with ``cp=True`` on a CP group of one gives the outputs and gradients of the same
layer on SDPA (``cp=False``): causal with GQA and a rotary embedding (Llama), and bidirectional under a key-padding
mask (BERT).  The ring is reached outside the graph (dynamo counts the break).  CP=2 against one process, through
the Trainer, is in tests/backend/test_context_parallel_training.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import init_single_process, teardown_single_process
from workbench.config import preset


@pytest.fixture(scope="module")
def cp_world():
    was = init_single_process(preset("tiny"))
    yield
    teardown_single_process(was)


def _weights(h: int, heads: int, groups: int, ffn: int, gated: bool):
    g = torch.Generator().manual_seed(0)
    d = h // heads
    qkv = (heads + 2 * groups) * d

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).requires_grad_()

    return [torch.ones(h, requires_grad=True), None, w(qkv, h), None, w(h, h), None,
            torch.ones(h, requires_grad=True), None, w(ffn * (2 if gated else 1), h), None, w(h, ffn), None]


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_the_compiled_layer_runs_the_ring_outside_its_graph(cp_world, kind):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from workbench.backend import compiled_layer
    from workbench.backend.compiled_layer import dense_layer_forward

    s, b, h, heads, groups, ffn = 16, 2, 32, 4, 2 if kind == "llama" else 4, 64
    weights = _weights(h, heads, groups, ffn, gated=kind == "llama")
    x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(1))
    mask = rope = None
    if kind == "bert":  # True = a padded key: the second sample's last 5 tokens
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool)
        mask[1, ..., -5:] = True
    else:
        inv = 1.0 / (10000 ** (torch.arange(0, h // heads, 2).float() / (h // heads)))
        freqs = torch.outer(torch.arange(s).float(), inv)
        rope = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
    static = dict(norm="rmsnorm" if kind == "llama" else "layernorm", eps1=1e-5, eps2=1e-5, heads=heads, groups=groups,
                  head_dim=h // heads, scale=(h // heads) ** -0.5, activation="swiglu" if kind == "llama" else "gelu",
                  causal=kind == "llama")
    if kind == "bert":  # LayerNorm takes a bias
        weights[1], weights[7] = torch.zeros(h, requires_grad=True), torch.zeros(h, requires_grad=True)
    params = [w for w in weights if w is not None]

    def run(fn, cp: bool):
        xi = x.clone().requires_grad_()
        out = fn(xi, *weights, mask, None, rope, **static, cp=cp)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = [xi.grad.clone()] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out.detach(), grads

    ref_out, ref_grads = run(dense_layer_forward, cp=False)
    compiled_layer._eager_in_graphs()  # what compiled_layer._compiled does before it compiles its first piece
    torch._dynamo.reset()
    counters.clear()
    got_out, got_grads = run(torch.compile(dense_layer_forward, backend="aot_eager", dynamic=False), cp=True)
    breaks = dict(counters["graph_break"])  # the ring left the graph where the layer says so, and nowhere else
    assert breaks and all("_ring_context" in why and "torch.compiler.disable" in why for why in breaks), breaks
    torch.testing.assert_close(got_out, ref_out, rtol=1e-5, atol=1e-5)
    for i, (g, r) in enumerate(zip(got_grads, ref_grads)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"gradient {i}: {m}")
    if kind == "bert":  # the padding took effect: a ring that ignored it would not match (checked, not assumed)
        free = dense_layer_forward(x, *weights, None, None, rope, **static, cp=True)
        assert not torch.allclose(free[:, 1], ref_out[:, 1], atol=1e-3)
        torch.testing.assert_close(free[:, 0], ref_out[:, 0], rtol=1e-5, atol=1e-5)


def test_a_bias_under_cp_is_refused(cp_world):
    from workbench.backend.compiled_layer import dense_layer_forward

    s, b, h, heads = 8, 1, 16, 2
    weights = _weights(h, heads, heads, 32, gated=False)
    weights[1], weights[7] = torch.zeros(h), torch.zeros(h)
    bias = torch.zeros(b, heads, s, s)
    with pytest.raises(NotImplementedError, match="no additive bias"):
        dense_layer_forward(torch.randn(s, b, h), *weights, None, bias, None, norm="layernorm", eps1=1e-5, eps2=1e-5,
                            heads=heads, groups=heads, head_dim=h // heads, scale=0.5, activation="gelu", causal=False,
                            cp=True)
