"""The workbench's local token dispatch (``workbench.backend.moe_dispatch``) against megatron's own permutation
(``moe_utils.permute`` / ``unpermute``, the functions its all-to-all dispatcher calls): the same permuted rows in the
same order, the same probabilities and counts per expert, and the same combined output and gradients, on random
top-k routing maps (fp32, CPU; the layer-level comparison with SequentialMLP runs in ``test_moe_routing.py``)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from workbench.backend.moe_dispatch import LocalTokenDispatcher, routing_indices


class _Config:
    def __init__(self, k: int) -> None:
        self.moe_router_topk = k


def _routing(tokens: int, experts: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    top, idx = torch.topk(logits, k, dim=-1)
    probs = torch.zeros(tokens, experts).scatter(1, idx, torch.softmax(top, -1))
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


@pytest.mark.parametrize("tokens,experts,k", [(48, 8, 2), (37, 16, 4), (20, 4, 1), (64, 64, 8)])
def test_local_dispatch_equals_megatrons_permutation(tokens, experts, k):
    hidden = 12
    probs, routing_map = _routing(tokens, experts, k, seed=tokens + k)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    w = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(2))
    grad_out = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))

    def run(local: bool):
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        if local:
            d = LocalTokenDispatcher(_Config(k))
            px, pp = d.dispatch_preprocess(xi, routing_map, pi)
            px, pp = d.token_dispatch(px, pp)
            px, counts, pp = d.dispatch_postprocess(px, pp)
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess((px @ w) * pp.unsqueeze(-1))))
        else:
            px, pp, rows, _, _ = permute(xi, routing_map, probs=pi, num_out_tokens=tokens * k)
            counts = routing_map.sum(0)
            y = unpermute((px @ w) * pp.unsqueeze(-1), rows, restore_shape=xi.shape, routing_map=routing_map)
        y.backward(grad_out)
        return px.detach(), pp.detach(), counts, y.detach(), xi.grad, pi.grad

    got, want = run(True), run(False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    for a, b in zip(got[3:], want[3:]):  # sums of k values in another order
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_each_tokens_slots_are_its_rows_and_every_row_is_used_once():
    _, routing_map = _routing(30, 8, 3, seed=5)
    rows, slots, flat = routing_indices(routing_map, 3)
    assert sorted(slots.tolist()) == list(range(90))  # a permutation of the permuted rows
    assert rows[slots].view(30, 3).eq(torch.arange(30).unsqueeze(1)).all()  # token t's slots hold token t
    experts = flat // 30
    assert experts.tolist() == sorted(experts.tolist())  # expert by expert
    assert routing_map[rows, experts].all()


def test_regrouping_orders_received_blocks_by_local_expert_then_source():
    from workbench.backend.moe_dispatch import regroup_index

    counts = torch.tensor([[2, 0, 3], [1, 4, 2]])  # [source rank, local expert]
    labels = [(s, e) for s in range(2) for e in range(3) for _ in range(int(counts[s, e]))]  # arrival order
    index = regroup_index(counts, int(counts.sum()))
    assert sorted(index.tolist()) == list(range(len(labels)))
    assert [labels[i] for i in index.tolist()] == sorted(labels, key=lambda se: (se[1], se[0]))


def test_the_inverse_regrouping_is_the_regroupings_argsort():
    """``_exchange_plan``'s inverse (a scatter of an arange) is the inverse permutation, ``regroup.argsort()``."""
    from workbench.backend.moe_dispatch import regroup_index

    g = torch.Generator().manual_seed(4)
    for ep, local in ((2, 3), (4, 8), (3, 1)):
        counts = torch.randint(0, 5, (ep, local), generator=g)
        counts[0, 0] = 0  # an empty block
        regroup = regroup_index(counts, int(counts.sum()))
        inverse = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(regroup.numel()))
        assert torch.equal(inverse, regroup.argsort()) and torch.equal(regroup[inverse], torch.arange(regroup.numel()))


def test_one_rank_has_no_regrouping_from_the_start():
    d = LocalTokenDispatcher(_Config(2))
    assert d.ep == 1 and d.regroup is None and d.inverse is None  # the EP=1 path tests regroup alone
    probs, routing_map = _routing(12, 4, 2, seed=9)
    px, pp = d.dispatch_preprocess(torch.randn(12, 8), routing_map, probs)
    got, counts, _ = d.dispatch_postprocess(*d.token_dispatch(px, pp))
    assert got is px and torch.equal(counts, routing_map.sum(0))
    assert d.combine_preprocess(got) is got


def test_two_expert_parallel_ranks_equal_the_per_token_reference():
    """``tests/support/moe_ep_dispatch_check.py``: EP=2 over gloo, one rank sending nothing to two experts."""
    import json
    import os
    import subprocess
    import sys

    from tests.support import ROOT, SUPPORT, free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(SUPPORT / "moe_ep_dispatch_check.py"), str(free_port())], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted((json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["counts"][:2] != [0, 0] and sum(rows[0]["counts"]) > 0  # rank 0's experts 0, 1 get rank 0's rows
    for r in rows:
        assert r["y"] <= 1e-5 * r["scale"] and r["x_grad"] <= 1e-5 and r["p_grad"] <= 1e-5, r


def test_the_triton_gather_sum_equals_the_eager_sum_under_the_interpreter():
    """The CUDA path of the un-permutation (:func:`moe_kernels.gather_sum`), under Triton's interpreter (CPU): rows
    of a strided view (row stride wider than the row), a hidden size that is no multiple of the block, top-1 to top-8
    on megatron's permutation, rows whose hidden dimension is strided.  On fp32 rows the sum is bitwise a sequential
    fp32 sum of each token's rows in slot order; on bf16 rows within one bf16 place of it rounded (the interpreter
    truncates where the GPU rounds to nearest: ``bench/moe_permute_probe.py`` counts the GPU's differences from the
    eager sum)."""
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    code = """
import torch
from workbench.backend import moe_kernels
from workbench.backend.moe_dispatch import routing_indices
for tokens, experts, k, hidden, block in ((9, 8, 2, 37, 16), (6, 16, 8, 20, 32), (5, 4, 1, 8, None)):
    g = torch.Generator().manual_seed(tokens)
    idx = torch.randn(tokens, experts, generator=g).topk(k, dim=1).indices
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)
    _, slots, _ = routing_indices(routing, k)
    wide = torch.randn(tokens * k, hidden + 5, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        y = wide.to(dtype)[:, 2:hidden + 2]
        want = torch.stack([sum((y[slots[t * k + r]].float() for r in range(1, k)), y[slots[t * k]].float())
                            for t in range(tokens)])
        got = moe_kernels.gather_sum(y, slots, k, block=block)
        assert got.dtype == dtype and got.shape == (tokens, hidden), (got.dtype, got.shape)
        if dtype == torch.float32:
            assert torch.equal(got, want), (tokens, k)
        else:
            place = (want.abs().clamp_min(1e-30).log2().floor() - 7).exp2()
            assert ((got.float() - want).abs() <= place).all(), (tokens, k)
            assert not torch.equal(got, moe_kernels.gather_sum(y, slots.flip(0), k, block=block))
    columns = wide.t().contiguous().t()[:, :hidden]  # unit stride along the rows, not along the hidden dimension
    assert columns.stride(-1) != 1
    assert torch.equal(moe_kernels.gather_sum(columns, slots, k, block=block), moe_kernels.gather_sum(
        columns.contiguous(), slots, k, block=block))
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
