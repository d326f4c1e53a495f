"""How ring attention picks its block kernel (workbench.backend.context_parallel._block_kernel): ``auto`` takes cuDNN's
fused attention only where its one-time probe finds it equal to flash's, and records what ran and why.

The kernels themselves need a Hopper GPU (tests/backend/test_context_parallel.py's two-GPU test runs them); here the
two CUDA kernels are replaced by the math kernel (a true boundary: the aten ops exist only on CUDA), planted to agree,
to differ or to refuse, so the probe's verdicts, its per-process cache, the record and the kernel's way through the
autograd function are what is tested.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from workbench.backend import context_parallel as cpm  # noqa: E402


def _kernel(calls: list, name: str, scale: float = 1.0, refuse: bool = False, gqa_scale: float | None = None,
            gqa_refuse: bool | None = None):
    """A (forward, backward) pair with the CUDA kernels' signature, computed by the math kernel; ``scale`` skews its
    output, ``refuse`` makes the forward raise as an op without an execution plan would; ``gqa_scale`` /
    ``gqa_refuse``: the same for the cuDNN kernel reading the K/V heads itself (``gqa=True``), default as without."""

    def fwd(q, k, v, s, diag, kmask, aux, gqa: bool = False):
        calls.append(f"{name}-gqa" if gqa else name)
        if (gqa_refuse if gqa and gqa_refuse is not None else refuse):
            raise RuntimeError("cuDNN Frontend error: no execution plan")
        out, lse = cpm._block_forward(q, k, v, s, diag, kmask)
        return out * (gqa_scale if gqa and gqa_scale is not None else scale), lse

    def bwd(do, q, k, v, out, lse, s, diag, kmask, aux, gqa: bool = False):
        return cpm._block_backward(do, q, k, v, out, lse, s, diag, kmask)

    return fwd, bwd


@pytest.fixture
def planted(monkeypatch):
    """Fresh records, both CUDA kernels eligible; returns a function planting the cuDNN kernel's behaviour."""
    calls: list = []
    monkeypatch.setattr(cpm, "_PROBED", {})
    monkeypatch.setattr(cpm, "_DECIDED", {})
    monkeypatch.setattr(cpm, "_flash_ok", lambda q, pad: pad is None)
    monkeypatch.setattr(cpm, "_cudnn_ok", lambda q, pad: pad is None)
    fwd, bwd = _kernel(calls, "flash")
    monkeypatch.setattr(cpm, "_flash_block_forward", fwd)
    monkeypatch.setattr(cpm, "_flash_block_backward", bwd)

    def plant(**kw):
        f, b = _kernel(calls, "cudnn", **kw)
        monkeypatch.setattr(cpm, "_cudnn_block_forward", f)
        monkeypatch.setattr(cpm, "_cudnn_block_backward", b)
        return calls

    return plant


def test_auto_takes_cudnn_only_where_the_probe_finds_it_equal_to_flash(planted):
    q = torch.zeros(1, 4, 64, 32)
    planted()
    assert cpm._block_kernel("auto", q, None) == "cudnn-gqa"
    planted(scale=1.1)  # a kernel that is 10% off: the probe's verdict is cached, so a new dtype probes again
    assert cpm._block_kernel("auto", q.double(), None) == "flash"
    planted(refuse=True)
    assert cpm._block_kernel("auto", q.half().float()[..., :16], None) == "flash"
    record = cpm.ring_block_kernels()
    assert record["cpu/torch.float32/32/auto"].startswith("cudnn-gqa: matches flash")
    assert record["cpu/torch.float64/32/auto"].startswith(
        "flash: cudnn-gqa: cuDNN attention differs from flash by")
    assert "; cudnn: cuDNN attention differs from flash by" in record["cpu/torch.float64/32/auto"]
    assert record["cpu/torch.float32/16/auto"].startswith("flash: cudnn-gqa: cuDNN attention refused: RuntimeError")


@pytest.mark.parametrize("plant", [{"gqa_refuse": True}, {"gqa_scale": 1.1}])
def test_cudnn_on_expanded_heads_where_it_cannot_read_the_grouped_ones(planted, plant):
    """A cuDNN that refuses K/V with fewer heads than queries, or gets them wrong: the probe falls back to cuDNN on
    K/V expanded per group (not to flash), and says why."""
    calls = planted(**plant)
    assert cpm._block_kernel("auto", torch.zeros(1, 4, 64, 32), None) == "cudnn"
    why = cpm.ring_block_kernels()["cpu/torch.float32/32/auto"]
    assert why.startswith("cudnn: matches flash") and "cudnn-gqa: cuDNN attention" in why, why
    assert calls.count("cudnn") == 2  # the expanded kernel's two probe blocks


def test_the_probe_runs_once_a_process_per_device_dtype_and_head_dim(planted):
    calls = planted()
    q = torch.zeros(1, 4, 64, 32)
    cpm._block_kernel("auto", q, None)
    probed = len(calls)
    assert probed == 4  # a diagonal and a rectangular block through each kernel
    for _ in range(3):
        assert cpm._block_kernel("auto", q, None) == "cudnn-gqa"
    assert len(calls) == probed


def test_a_padding_mask_or_an_explicit_impl_skips_the_probe_and_says_so(planted):
    calls = planted()
    q = torch.zeros(2, 4, 64, 32)
    pad = torch.zeros(2, 64, dtype=torch.bool)
    assert cpm._block_kernel("auto", q, pad) == "math"
    assert cpm._block_kernel("flash", q, None) == "flash"
    assert calls == []
    record = cpm.ring_block_kernels()
    assert record["cpu/torch.float32/32/auto"].startswith("math: flash not eligible")
    assert record["cpu/torch.float32/32/flash"] == "flash: asked for"


def test_the_chosen_kernel_is_the_one_the_ring_runs_forward_and_backward(planted):
    """One process (no group): ring_attention under ``auto`` runs the planted cuDNN kernel (after its probe) and
    still equals whole-sequence SDPA, gradients included (the ring merges and accumulates in fp32)."""
    calls = planted()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 64, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = cpm.ring_attention(q, k, v, None, causal=True)
    assert calls[-1] == "cudnn-gqa" and calls.count("cudnn-gqa") == 3  # two probe blocks, then the ring's one
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    assert torch.allclose(out, ref, atol=1e-5)
    for got, t in zip(grads, (q, k, v)):
        assert torch.allclose(got, t.grad, atol=1e-5)


def test_the_fused_kernels_layout_round_trips_the_ring_s_grouped_heads():
    """The fused kernels see ``[b, h, s, d]`` with each K/V head repeated for its query group (SDPA's enable_gqa
    order: query head j reads K/V head j // g); their dK/dV come back summed over the group."""
    b, hk, g, s, d = 2, 2, 3, 8, 4
    q = torch.randn(b, hk, g, s, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    lse = torch.randn(b, hk, g, s)
    do4, q4, k4, v4, out4, lse4 = cpm._kernel_inputs(q + 1, q, k, v, q - 1, lse, (1,))
    assert q4.shape == (b, hk * g, s, d) and torch.equal(q4.view(b, hk, g, s, d), q)
    assert torch.equal(do4, (q + 1).reshape(q4.shape)) and torch.equal(out4, (q - 1).reshape(q4.shape))
    assert lse4.shape == (b, hk * g, s, 1) and torch.equal(lse4.view(b, hk, g, s), lse)
    for j in range(hk * g):
        assert torch.equal(k4[:, j], k[:, j // g]) and torch.equal(v4[:, j], v[:, j // g])
    dq, dk, dv = cpm._grouped_grads(q, k, q4, k4, 2 * v4, expand=True)
    assert torch.equal(dq, q) and torch.allclose(dk, g * k) and torch.allclose(dv, 2 * g * v)


def test_cudnn_reading_the_grouped_heads_gets_kv_as_they_are_and_gives_their_gradients_back_as_they_come():
    """``cudnn-gqa``: the kernel sees the queries ``[b, h, s, d]`` in the same order and K/V with their own ``h_kv``
    heads (no copies); its dK/dV, already one per K/V head, come back unsummed."""
    b, hk, g, s, d = 2, 2, 3, 8, 4
    q = torch.randn(b, hk, g, s, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    do4, q4, k4, v4, out4, lse4 = cpm._kernel_inputs(q + 1, q, k, v, q - 1, torch.randn(b, hk, g, s), (1,), expand=False)
    assert torch.equal(q4.view(b, hk, g, s, d), q) and torch.equal(k4, k) and torch.equal(v4, v)
    dq, dk, dv = cpm._grouped_grads(q, k, q4, 2 * k4, 3 * v4, expand=False)
    assert torch.equal(dq, q) and torch.equal(dk, 2 * k) and torch.equal(dv, 3 * v)
