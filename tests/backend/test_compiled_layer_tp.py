"""The compiled layer at TP=2 (two gloo ranks under torchrun): the one-graph layer with functional collectives matches
megatron's stock layer with and without SP and recompute, ``parallel.tp_comm_overlap`` moves the input-gradient
collectives under the weight-gradient GEMMs (inductor's generated code for one rank of TP=2, read in one process under
torch's fake process group of two ranks: the ranks' code is the same and does not depend on the backend), and under
``torch.compile`` the collectives stay in one graph."""

from __future__ import annotations

import pytest

from tests.support import free_port
from tests.support.compiled_layer_run import assert_tp2_matches_stock, gemms_in_flight, run_check, tp2_check


COMPILED_CASES = ("gpt+sp", "llama-like+sp", "gpt+sp+selective", "gpt+full", "gpt+sp+chunked", "rope+sp+chunked")


@pytest.fixture(scope="module")
def tp2() -> dict:
    """One torchrun of two gloo ranks: every case eagerly, then :data:`COMPILED_CASES` under torch.compile in the same
    ranks (``"compile:<case>"``; their graph breaks counted from the start of that phase).  At ``tp2_order``'s sequence
    length (``TP2_SEQ``): built first, its compiled kernels are most of those ``tp2_order`` then needs."""
    return tp2_check(CHECK_THEN_COMPILE=",".join(COMPILED_CASES))


def test_tensor_parallel_fast_layer_matches_stock_across_two_ranks(tp2):
    """TP=2 (two gloo processes): the one-graph layer with functional collectives, with and
    without sequence parallelism, against the stock megatron layer with the same weights."""
    r = {name: v for name, v in tp2.items() if not name.startswith("compile:")}
    for name, heads_per_rank, groups_per_rank in (("gpt", 2, 2), ("llama-like", 2, 1)):
        v = r[name]
        assert_tp2_matches_stock(v, rel=1e-5)
        head_dim = 16  # tiny: hidden 64 / 4 heads; each rank holds only its shard of the fused QKV
        assert v["local_qkv_rows"] == (heads_per_rank + 2 * groups_per_rank) * head_dim
    for name in ("gpt+sp", "llama-like+sp", "rope+sp", "gpt+sp+selective", "gpt+full"):
        assert_tp2_matches_stock(r[name], rel=1e-5, passes=2 if name == "gpt+full" else 1)
        assert r[name]["chunked"] == [False] * 4, r[name]


def test_chunked_tensor_parallel_matches_stock_across_two_ranks(tp2):
    """parallel.tp_chunked (TP=2 + SP): each GEMM in two row chunks and each collective an exchange with the peer, on
    every layer, with and without biases (GPT-2, Llama with RoPE), eagerly and under torch.compile (one graph), and
    beside selective recompute (the recomputed MLP keeps the plain collectives): the stock layer's losses and
    gradients."""
    for name in ("gpt+sp+chunked", "rope+sp+chunked", "gpt+sp+selective+chunked", "compile:gpt+sp+chunked",
                 "compile:rope+sp+chunked"):
        v = tp2[name]
        assert v["chunked"] == [True] * 4, v
        assert_tp2_matches_stock(v, rel=1e-5)
        assert v["graph_breaks"] == 0, v


@pytest.fixture(scope="module")
def tp2_order() -> dict:
    """Inductor's generated code of one rank of the TP=2 layer, per case (one process, a fake group of two ranks: the
    module docstring)."""
    return run_check("tp2-order", port=free_port())


def test_tp_backward_collectives_run_under_the_weight_gradient_gemms(tp2_order):
    """parallel.tp_comm_overlap, on inductor's generated backward of the TP=2 layer: each
    input-gradient all-reduce (reduce-scatter under SP) has two weight-gradient GEMMs between
    its start and its wait; without the overlap every collective is waited on at once."""
    r = tp2_order
    # backward collectives: TP = [all-reduce dgrad fc1, all-reduce dgrad qkv];
    # SP = [all-gather grad, reduce-scatter dgrad fc1, all-gather grad, reduce-scatter dgrad qkv]
    expected_on = {False: [2, 2], True: [0, 2, 0, 2]}
    for sp, want in expected_on.items():
        on, off = r[f"overlap=True,sp={sp}"], r[f"overlap=False,sp={sp}"]
        assert gemms_in_flight(on) == want, on
        assert gemms_in_flight(off) == [0] * len(want), off
        assert on.count("mm") == off.count("mm") == 8, (on, off)  # moved, not added: 4 dgrad + 4 wgrad
    # train.fp8: the weight gradients are FP8 GEMMs (torch._scaled_mm) and the pass moves them too; inductor then
    # fuses the first pair's operand (the FP8 norm output, recomputed in backward) into the norm backward, which
    # waits for the all-reduce, so only part of it runs in flight (the kernel path says so)
    on, off = r["overlap=True,sp=False,fp8=tensorwise"], r["overlap=False,sp=False,fp8=tensorwise"]
    assert sum(gemms_in_flight(on)) >= 1 and gemms_in_flight(off) == [0, 0], (on, off)
    assert on.count("mm") == off.count("mm") == 8, (on, off)


def test_chunked_exchanges_run_under_the_other_chunks_gemms(tp2_order):
    """parallel.tp_chunked, on inductor's generated code of each rank of TP=2 + SP (their halves join in opposite
    orders): the forward's four exchanges (QKV's and fc1's input, the projection's and fc2's partial sums) each have a
    GEMM between their start and their wait, and so do the backward's four (the own rows' input gradient, and for QKV
    the weight gradients too), where the plain TP=2 + SP layer waits at once on its forward collectives and its
    backward all-gathers.  No all-gather or reduce-scatter is left; 8 GEMMs forward (the plain layer's 4 split in
    two), 12 backward (each input gradient in two, each weight gradient one GEMM over the whole sequence, as
    megatron's)."""
    for rank in (0, 1):
        fwd, bwd = (tp2_order[f"chunked,rank={rank}"][k] for k in ("forward", "backward"))
        assert "start" not in fwd + bwd, (rank, fwd, bwd)
        assert gemms_in_flight(fwd) == [1] * 4 and fwd.count("gemm") == 8, (rank, fwd)
        flight = gemms_in_flight(bwd)
        assert len(flight) == 4 and min(flight) >= 1, (rank, bwd)
        assert bwd.count("gemm") == 12, (rank, bwd)


def test_async_tp_fuses_every_sequence_parallel_collective_with_its_gemm(tp2_order):
    """parallel.async_tp: inductor's micro-pipeline TP pass replaces the SP layer's collectives by symmetric-memory ops
    that split each with its GEMM.  Without biases (Llama): all of them, forward (QKV and fc1's all-gather, the
    projection's and fc2's reduce-scatter) and backward (the mirror image); with biases (GPT-2) the forward's
    all-gathers stay (their GEMM is an addmm, which the pass does not match).  Off: the plain collectives."""
    on, biased, off = (tp2_order[f"async_tp={a},bias={b}"] for a, b in ((True, False), (True, True), (False, False)))
    fused = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "fused_all_gather_matmul": 2,
             "fused_matmul_reduce_scatter": 2}
    plain = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "fused_all_gather_matmul": 0,
             "fused_matmul_reduce_scatter": 0}
    assert on == {"forward": fused, "backward": fused}, on
    assert off == {"forward": plain, "backward": plain}, off
    assert biased["backward"] == fused and biased["forward"] == {**fused, "all_gather_into_tensor": 2,
                                                                 "fused_all_gather_matmul": 0}, biased


@pytest.mark.slow
def test_tensor_parallel_one_graph_layer_under_torch_compile(tp2):
    """The same under torch.compile: the collectives stay inside one graph (no graph breaks),
    with the recomputed MLP and under megatron's full recompute too."""
    r = {name[len("compile:"):]: v for name, v in tp2.items() if name.startswith("compile:")}
    assert set(r) == set(COMPILED_CASES)
    for name, v in r.items():
        assert_tp2_matches_stock(v, rel=1e-5, passes=2 if name == "gpt+full" else 1)
        assert v["graph_breaks"] == 0, v
