"""Context parallelism wired into GPT training (#53): CP=2 trains as one process does.

A tiny Llama-shaped GPT (RoPE, RMSNorm, SwiGLU, GQA 4 heads / 2 KV groups, seq 64) and a GPT-2-shaped one (learned
positions, LayerNorm, GELU) train 4 steps through the backend's real ``Trainer`` (gloo, CPU) at context parallel 2
(two ranks, one CP group, DP = 1) and in one process, from the same seed on the same synthetic data and global batch
(4 sequences, 2 micro-batches of 2).  The loss mask of each sample hides a sample-dependent head of the sequence (8 to
24 tokens), so the two CP ranks hold different numbers of loss tokens: a loss divided per rank (not by the CP group's
token count) or a contiguous (not load-balanced) split of the sequence gives different losses and gradients.  Every
step's loss and gradient norm, and the weights and gradients after the last step, must match the one-process run.
The CP=2 run's step-2 checkpoint resumes at CP=2 and at CP=1 and repeats its steps 3-4.  On four ranks, DP=2 x CP=2
matches DP=2, TP=2 + SP x CP=2 matches TP=2 + SP and PP=2 x CP=2 matches PP=2 (each step's loss and gradient norm).
A mixture-of-experts GPT (``moe-tiny``: 8 experts, top-2, load-balancing and z-losses, the workbench's token dispatch
and grouped experts) trains at CP=2 as in one process, and DP=2 x EP=2 x CP=2 on four ranks as DP=2 from the same
initial checkpoint (expert parallelism initialises the experts from other random streams): losses, gradient norms, the
tokens each expert received (the router records, summed over every rank) and the per-layer balancing losses.
BERT (``bert-tiny`` without dropout: bidirectional attention under its key-padding mask, learned positions, the
masked-LM head on the masked positions and the sentence-order head on the pooled first token, which only CP rank 0
holds) trains at CP=2 as in one process, at TP=2 + SP x CP=2 as at TP=2 + SP and at PP=2 x CP=2 as at PP=2 (positions
on the first stage, the heads on the last): every step's loss, sentence-order loss and gradient norm, the evaluations,
and rank 0's weights and gradients.

One launch per world size (``tests.support.trainer_runs``); a prelude in every rank masks the synthetic samples'
heads and dumps rank 0's weights and DDP main gradients after each run.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.trainer_runs import run_trainers
from workbench.config import preset, validate
from workbench.run.reader import read_events

PRELUDE = r'''
import torch
from workbench.models.gpt import data as _gpt_data
_item = _gpt_data.SyntheticGPTDataset.__getitem__
def _masked(self, idx):
    out = _item(self, idx)
    out["loss_mask"][: 8 + 8 * (int(idx) % 3)] = 0.0  # uneven loss tokens across the CP ranks' halves
    return out
_gpt_data.SyntheticGPTDataset.__getitem__ = _masked
from workbench import kernel_rule
from workbench.backend import compiled_layer
kernel_rule.allow_fast_paths_on_cpu(True)  # for the MoE runs (train.compile_kernels): the workbench's MoE path, eager
compiled_layer.set_compile(False)
_run = Trainer.run
def _dump(self):
    code = _run(self)
    if torch.distributed.get_rank() == 0:
        m = self.model[0].module
        torch.save({"weights": {n: p.detach().clone() for n, p in m.named_parameters()},
                    "grads": {n: p.main_grad.detach().clone() for n, p in m.named_parameters()},
                    "fast_calls": sum(getattr(x, "fast_calls", 0) for x in m.modules())},
                   os.path.join(str(self.run_dir), "state.pt"))
    return code
Trainer.run = _dump
'''

STEPS = 4
LLAMA = {"model.position_embedding": "rope", "model.normalization": "rmsnorm", "model.activation": "swiglu",
         "model.attention_type": "grouped", "model.num_query_groups": 2, "model.add_bias_linear": False,
         "model.tie_embeddings": False}
GPT2 = {"model.position_embedding": "learned"}


#: the MoE runs: the preset's shape with the balancing loss on, router records every step, the fast paths (eager)
MOE = {"model.moe.aux_loss_coeff": 1e-2, "model.moe.router_stats_interval": 1, "train.compile_kernels": True}
#: the BERT runs: no dropout (each CP rank would draw its own masks), an evaluation every 2 steps
BERT = {"model.attention_dropout": 0.0, "model.hidden_dropout": 0.0, "train.eval_interval": 2, "train.eval_iters": 1}


def _cfg(shape: dict, **over):
    base = {"data.source": "synthetic", "train.train_iters": STEPS, "train.lr_decay_iters": STEPS, "train.lr_warmup_iters": 0,
            "train.global_batch_size": 4, "train.micro_batch_size": 2, "train.lr": 3e-3, "train.eval_interval": 0,
            "train.eval_iters": 0, "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0,
            "checkpoint.save_on_exit": False, "model.num_layers": 2, "model.seq_length": 64}
    base.update(shape)
    base.update(over)
    return preset({id(MOE): "moe-tiny", id(BERT): "bert-tiny"}.get(id(shape), "tiny"), **base)


CP2 = {"parallel.context_parallel": 2}
#: DP=2 (micro-batches of 1 sequence: the per-micro-batch token divisor makes micro-batch composition count, so its
#: reference is DP=2 without CP, same micro-batches); TP=2 with sequence parallelism (seq 64: a multiple of 2*cp*tp)
DP2 = {"train.micro_batch_size": 1}
TP2SP = {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}
#: PP=2 (1F1B over 2 micro-batches; its second stage is seeded apart, so its reference is PP=2 without CP)
PP2 = {"parallel.pipeline_parallel": 2}
#: the compiled dense layer (eager here: set_compile(False)), its self-attention the ring between its pieces
FAST = {"train.compile_kernels": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    save2 = {"checkpoint.save_interval": 2}
    at2 = str(root / "llama_cp2" / "checkpoints" / "iter_0000002")
    moe_init = {"train.train_iters": 1, "train.lr_decay_iters": 1, "checkpoint.save_on_exit": True}
    from_init = {"checkpoint.load_dir": str(root / "moe_init" / "checkpoints"), "checkpoint.finetune": True}
    run_trainers({root / "llama_cp2": _cfg(LLAMA, **CP2, **save2), root / "gpt2_cp2": _cfg(GPT2, **CP2),
                  root / "llama_cp2_resumed": _cfg(LLAMA, **CP2, **{"checkpoint.load_dir": at2}),
                  root / "llama_dp2": _cfg(LLAMA, **DP2), root / "llama_tp2sp": _cfg(LLAMA, **TP2SP),
                  root / "llama_pp2": _cfg(LLAMA, **PP2), root / "moe_cp2": _cfg(MOE, **CP2),
                  root / "moe_init": _cfg(MOE, **moe_init), root / "moe_dp2": _cfg(MOE, **DP2, **from_init),
                  root / "bert_cp2": _cfg(BERT, **CP2), root / "bert_tp2sp": _cfg(BERT, **TP2SP),
                  root / "bert_pp2": _cfg(BERT, **PP2), root / "llama_cp2_fast": _cfg(LLAMA, **CP2, **FAST),
                  root / "bert_cp2_fast": _cfg(BERT, **CP2, **FAST)},
                 nproc=2, prelude=PRELUDE, timeout=480)
    run_trainers({root / "llama_dp2_cp2": _cfg(LLAMA, **CP2, **DP2), root / "llama_tp2sp_cp2": _cfg(LLAMA, **CP2, **TP2SP),
                  root / "llama_pp2_cp2": _cfg(LLAMA, **CP2, **PP2),
                  root / "moe_dp2_ep2_cp2": _cfg(MOE, **CP2, **DP2, **from_init, **{"parallel.expert_parallel": 2}),
                  root / "bert_tp2sp_cp2": _cfg(BERT, **CP2, **TP2SP), root / "bert_pp2_cp2": _cfg(BERT, **CP2, **PP2)},
                 nproc=4, prelude=PRELUDE, timeout=600)
    run_trainers({root / "llama_cp1": _cfg(LLAMA), root / "gpt2_cp1": _cfg(GPT2), root / "moe_cp1": _cfg(MOE),
                  root / "bert_cp1": _cfg(BERT), root / "llama_cp1_fast": _cfg(LLAMA, **FAST),
                  root / "bert_cp1_fast": _cfg(BERT, **FAST),
                  root / "llama_cp1_from_cp2": _cfg(LLAMA, **{"checkpoint.load_dir": at2})}, nproc=1, prelude=PRELUDE)
    out = {p.name: (read_events(p), torch.load(p / "state.pt")) for p in root.iterdir() if (p / "state.pt").exists()}
    out["_root"] = root
    return out


def _steps(events):
    return {e["iteration"]: e for e in events if e["event"] == "step" and e.get("loss") is not None}


#: relative tolerance of each per-step record against its reference run
STEP_RTOL = {"loss": 2e-6, "sop loss": 2e-6, "grad_norm": 1e-4}


def _same_steps(ref_ev, got_ev, name, keys=("loss", "grad_norm"), steps=range(1, STEPS + 1)):
    """The ``steps`` (each one of a full reference run) of ``got_ev``'s run match ``ref_ev``'s: each of ``keys``
    within its :data:`STEP_RTOL`."""
    r, g = _steps(ref_ev), _steps(got_ev)
    assert sorted(g) == list(steps) and sorted(r) == list(range(1, STEPS + 1)), (name, sorted(g), sorted(r))
    for it in steps:
        print(f"{name} step {it}: " + "; ".join(f"{k} ref {r[it][k]:.7f} got {g[it][k]:.7f}" for k in keys))
        for k in keys:
            assert g[it][k] == pytest.approx(r[it][k], rel=STEP_RTOL[k]), (name, it, k)


def _same_evals(ref_ev, got_ev, name):
    """BERT's evaluations (steps 2 and 4): loss, sentence-order loss and masked-LM accuracy as the reference's."""
    evals = lambda ev: {e["iteration"]: e for e in ev if e["event"] == "eval" and e.get("loss") is not None}  # noqa: E731
    want, got = evals(ref_ev), evals(got_ev)
    assert sorted(got) == sorted(want) == [2, 4], (name, sorted(got), sorted(want))
    for it, e in want.items():
        for key in ("loss", "sop loss", "mlm accuracy"):
            assert got[it][key] == pytest.approx(e[key], rel=2e-6, abs=1e-7), (name, it, key)


def _same_state(ref, got, name, atol=1e-4, grad_rtol=1e-3):
    """Rank 0's weights and gradients after the last step (``state.pt``) match the reference's: the same parameters,
    each weight within ``atol``, each gradient within ``grad_rtol`` of the reference gradient's largest entry."""
    assert set(got["weights"]) == set(ref["weights"]) and set(got["grads"]) == set(ref["grads"]), name
    for n, rg in ref["grads"].items():
        w, rw, gr = got["weights"][n], ref["weights"][n], got["grads"][n]
        assert torch.allclose(w, rw, rtol=0, atol=atol), (name, n, (w - rw).abs().max().item())
        scale = rg.abs().max().item() + 1e-12
        assert (gr - rg).abs().max().item() <= grad_rtol * scale, (name, n, (gr - rg).abs().max().item(), scale)


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
def test_cp2_trains_as_one_process(runs, shape):
    (ref_ev, ref), (got_ev, got) = runs[f"{shape}_cp1"], runs[f"{shape}_cp2"]
    _same_steps(ref_ev, got_ev, shape)
    start = next(e for e in got_ev if e["event"] == "run_start")
    assert start["config"]["parallel"]["context_parallel"] == 2 and start["coords"]["cp"] in (0, 1)
    assert "ring attention" in start["kernel_path"]["attention"] and start["kernels"]["layer"] == "stock"
    _same_state(ref, got, shape)


@pytest.mark.parametrize("shape", ["llama", "bert"])
def test_cp2_on_the_compiled_layer_trains_as_one_process(runs, shape):
    """The compiled dense layer at CP=2 (the ring between its pieces: Llama's causal GQA, BERT's key padding) trains
    as the compiled layer in one process: every step, every weight and gradient."""
    (ref_ev, ref), (got_ev, got) = runs[f"{shape}_cp1_fast"], runs[f"{shape}_cp2_fast"]
    keys = ("loss", "sop loss", "grad_norm") if shape == "bert" else ("loss", "grad_norm")
    _same_steps(ref_ev, got_ev, f"{shape} compiled layer", keys=keys)
    for ev in (ref_ev, got_ev):
        start = next(e for e in ev if e["event"] == "run_start")
        assert start["kernels"]["layer"] == "compiled", start["kernels"]
    assert ref["fast_calls"] > 0 and got["fast_calls"] > 0, (ref["fast_calls"], got["fast_calls"])  # calls took it
    start = next(e for e in got_ev if e["event"] == "run_start")
    assert "eagerly between the compiled layer's pieces" in start["kernel_path"]["attention"], start["kernel_path"]
    _same_state(ref, got, f"{shape} compiled layer")
    if shape == "bert":
        _same_evals(ref_ev, got_ev, "bert compiled layer")


@pytest.mark.parametrize("layout, ref", [("moe_cp2", "moe_cp1"), ("moe_dp2_ep2_cp2", "moe_dp2")])
def test_moe_trains_under_cp_as_without(runs, layout, ref):
    """MoE under CP: each CP rank routes its own chunks' tokens; megatron's router reduces the balancing loss's
    token counts over TP x CP, the experts' gradients are reduced over the expert data-parallel group (which holds
    the CP ranks), and the router records sum every rank's counts, so the step, the loss and what the dashboard's
    router view shows are the run without CP's."""
    from workbench.run.reader import RunReader

    (ref_ev, _), (got_ev, _) = runs[ref], runs[layout]
    _same_steps(ref_ev, got_ev, layout)
    start = next(e for e in got_ev if e["event"] == "run_start")
    assert start["config"]["parallel"]["context_parallel"] == 2 and "ring attention" in start["kernel_path"]["attention"]
    assert start["kernels"]["moe_dispatch"] == "workbench" and start["kernels"]["experts"] == "torch_grouped", start["kernels"]
    want, got = RunReader(runs["_root"] / ref).router(), RunReader(runs["_root"] / layout).router()
    assert [x.iteration for x in got] == [x.iteration for x in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got):
        assert b.tokens_per_expert == a.tokens_per_expert and b.assignments == a.assignments, (layout, a.iteration)
        assert all(sum(c) == 4 * 64 * 2 for c in b.tokens_per_expert), b  # every token of the step, top-2 (dropless)
        assert b.load_balancing_loss == pytest.approx(a.load_balancing_loss, rel=1e-5), (layout, a.iteration)
        assert b.z_loss == pytest.approx(a.z_loss, rel=1e-5), (layout, a.iteration)


@pytest.mark.parametrize("layout, ref", [("bert_cp2", "bert_cp1"), ("bert_tp2sp_cp2", "bert_tp2sp"),
                                         ("bert_pp2_cp2", "bert_pp2")])
def test_bert_trains_under_cp_as_without(runs, layout, ref):
    """BERT under CP: the ring attends in both directions under the key-padding mask (padded tails fall on either CP
    rank), each token keeps its learned position, and the sentence-order loss counts once (CP rank 0 holds the pooled
    first token), weighted by the whole sequence's masked tokens: every weight and gradient after the last step (rank
    0's, the same TP shard on both sides), the sentence-order head's among them, is the run without CP's."""
    (ref_ev, ref_state), (got_ev, got_state) = runs[ref], runs[layout]
    _same_steps(ref_ev, got_ev, layout, keys=("loss", "sop loss", "grad_norm"))
    start = next(e for e in got_ev if e["event"] == "run_start")
    assert start["config"]["parallel"]["context_parallel"] == 2 and "ring attention" in start["kernel_path"]["attention"]
    _same_evals(ref_ev, got_ev, layout)
    # rank 0 holds the heads but at PP = 2 (its first stage: the embeddings and positions)
    assert any("binary_head" in n for n in ref_state["grads"]) == ("pp2" not in layout)
    _same_state(ref_state, got_state, layout)


def _problems(**over):
    return {(q.field, q.rule, q.fix) for q in validate(preset("tiny", **{"parallel.nproc_per_node": 2, **over}))}


def test_cp_config_rules():
    assert _problems(**CP2) == set()
    bad = _problems(**CP2, **{"model.seq_length": 66})
    assert any(f == "model.seq_length" and "2*context_parallel = 4" in r and "multiple of 4" in fix for f, r, fix in bad)
    sp = _problems(**{"parallel.context_parallel": 2, "parallel.nproc_per_node": 4, "parallel.tensor_parallel": 2,
                      "parallel.sequence_parallel": True, "model.seq_length": 68})
    assert any(f == "model.seq_length" and "= 8 (sequence parallelism)" in r for f, r, _ in sp)
    fields = {f for f, _, _ in _problems(**CP2, **{"model.attention_dropout": 0.1, "model.attention_backend": "local",
                                                   "data.reset_attention_mask": True})}
    assert {"model.attention_dropout", "model.attention_backend", "data.reset_attention_mask"} <= fields
    (local,) = [(r, fix) for f, r, fix in _problems(**CP2, **{"model.attention_backend": "local"})
                if f == "model.attention_backend"]
    assert "unfused local attention" in local[0] and "sdpa" in local[1]  # te: tests/backend/test_context_parallel_te.py
    hook = _problems(**CP2, **{"train.loss_func": "tests.support.hooks:loss"})
    assert any(f == "train.loss_func" and "context_parallel: 1" in fix for f, _, fix in hook)
    world = _problems(**{"parallel.context_parallel": 2, "parallel.nproc_per_node": 3})
    assert any(f == "parallel.nproc_per_node" and "tp*cp*pp = 2" in r for f, r, _ in world)
    t5 = {(q.field, q.rule) for q in validate(preset("t5-tiny", **{"parallel.nproc_per_node": 2, **CP2}))}
    assert any(f == "parallel.context_parallel" and "not the t5 family" in r for f, r in t5)
    bert = {(q.field, q.rule, q.fix) for q in validate(preset("bert-tiny", **{"parallel.nproc_per_node": 2, **CP2, **BERT}))}
    assert bert == set(), bert
    cls = {(q.field, q.rule, q.fix) for q in validate(preset("bert-tiny", **{"parallel.nproc_per_node": 2, **CP2, **BERT,
                                                                             "model.num_labels": 2}))}
    assert any(f == "parallel.context_parallel" and "sequence classification" in r and "context_parallel: 1" in fix
               for f, r, fix in cls), cls


def test_cp_kernel_rule_takes_the_compiled_layer_without_graphs():
    from workbench import kernel_rule

    kernel_rule.allow_fast_paths_on_cpu(True)
    try:
        cfg = preset("tiny", **{"parallel.nproc_per_node": 2, **CP2, "train.compile_kernels": True, "train.cuda_graphs": True})
        choice = kernel_rule.choose(cfg, te=True, cuda_available=True)
    finally:
        kernel_rule.allow_fast_paths_on_cpu(False)
    assert choice.attention == "sdpa" and choice.layer == "compiled" and choice.layer_reason == ""
    assert not choice.cuda_graphs and choice.cuda_graphs_reason == kernel_rule.CP_BLOCKER
    assert "point-to-point" in choice.cuda_graphs_reason


@pytest.mark.parametrize("resumed", ["llama_cp2_resumed", "llama_cp1_from_cp2"])
def test_a_cp2_checkpoint_resumes_at_cp2_and_cp1(runs, resumed):
    """CP=2's step-2 checkpoint (every CP rank holds the whole model) resumes at CP=2 and at CP=1: steps 3-4 as the
    straight CP=2 run's."""
    _same_steps(runs["llama_cp2"][0], runs[resumed][0], resumed, steps=[3, 4])


@pytest.mark.parametrize("layout, ref", [("llama_dp2_cp2", "llama_dp2"), ("llama_tp2sp_cp2", "llama_tp2sp"),
                                         ("llama_pp2_cp2", "llama_pp2")])
def test_cp2_with_dp2_tp2_or_pp2_trains_as_without_cp(runs, layout, ref):
    """Four ranks: DP=2 x CP=2 (the CP group reads one DP rank's samples; DDP averages over DP x CP) against DP=2,
    TP=2 + SP x CP=2 (the ring on each TP rank's heads) against TP=2 + SP, and PP=2 x CP=2 (the stages exchange
    seq_length / cp tokens) against PP=2."""
    _same_steps(runs[ref][0], runs[layout][0], layout)


def test_generation_loads_a_cp2_checkpoint_without_cp(runs):
    """Decoding runs without context parallelism: a CP=2 checkpoint loads into one process (cp forced to 1)."""
    from tests.support import init_single_process, teardown_single_process
    from workbench.rank.inference import _checkpoint_config, load_engine
    from workbench.config import GenerationConfig

    ckpt = runs["_root"] / "llama_cp2" / "checkpoints" / "iter_0000004"
    cfg = _checkpoint_config(ckpt)
    assert cfg.parallel.context_parallel == 2
    was = init_single_process(cfg.replace(**{"parallel.nproc_per_node": 1, "parallel.context_parallel": 1}))
    try:
        engine = load_engine(ckpt, device="cpu")
        (out,) = engine.generate([[5, 6, 7, 8]], GenerationConfig(max_new_tokens=5))
        assert len(out.token_ids) == 5
    finally:
        teardown_single_process(was)
