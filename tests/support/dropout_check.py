"""Subprocess helper for tests/backend/test_compiled_dropout.py: the compiled layer under dropout against
megatron's stock layer with the same dropout masks (own process: megatron's parallel state is global).

    python tests/support/dropout_check.py layer     -> JSON: GPT layers stock vs compiled, train mode, same seed
    python tests/support/dropout_check.py stats     -> JSON: where and how the compiled layer drops (fractions, scales)
    python tests/support/dropout_check.py families  -> JSON: BERT / T5 (padded) Trainer steps under dropout, stock vs fast
    python tests/support/dropout_check.py recompute -> JSON: compiled layer under dropout, full recompute vs none (compiled)
    torchrun --nproc_per_node 2 tests/support/dropout_check.py tp2 -> JSON: TP=2 (+SP) under dropout, stock vs compiled
    python tests/support/dropout_check.py one-process -> JSON: layer, stats, stats compiled, recompute and families
                                                         in one process

The same masks: both layers run eagerly (``compiled_layer.set_compile(False)``; ``CHECK_COMPILE=1`` compiles where
the result does not depend on it) and draw their masks from torch's CPU generator, seeded alike before each
forward, in megatron's order (attention probabilities, then each sublayer's bias-dropout-add) and shapes, so
equal losses and gradients mean the compiled layer drops exactly what megatron's drops, scaled alike.  Under
TP the random streams are megatron's: the CPU mode's no-op tracker fork is replaced here by a real one (a CPU
generator state per TP rank, ``seed + 2718 + tp_rank`` as megatron seeds it), so attention dropout differs per
TP rank while the replicated activations' hidden dropout stays the same on both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/support
import compiled_layer_check as fc  # noqa: E402

import torch  # noqa: E402

from workbench.config import preset  # noqa: E402

DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
LLAMA_LIKE = {**fc.VARIANTS["llama-like"], **fc.VARIANTS["rope"]}


def _stock_vs_fast_train(cfg, seed: int = 5, reseed=None):
    """Stock and compiled GPTs with the same weights, one forward/backward each in train mode, the RNG seeded
    alike before each (``reseed()`` too: the TP stream's): ([loss_stock, loss_fast], max relative grad
    difference, loss of the compiled model in eval mode (no dropout), compiled calls, blockers)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from workbench.backend import compiled_layer

    stock = fc._build(cfg, TransformerLayer)
    fast = fc._build(cfg, compiled_layer.CompiledTransformerLayer)
    fast.load_state_dict(stock.state_dict())
    g = torch.Generator().manual_seed(1)
    b, s = 2, cfg.model.seq_length
    tok = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    lab = torch.randint(0, cfg.model.vocab_size, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, s)
    losses = []
    for m in (stock, fast):
        m.train()
        torch.manual_seed(seed)
        if reseed is not None:
            reseed()
        loss = m(tok, pos, None, labels=lab).mean()
        loss.backward()
        losses.append(loss.item())
    grad_rel = max(((p.grad - q.grad).norm() / (p.grad.norm() + 1e-12)).item()
                   for p, q in zip(stock.parameters(), fast.parameters()))
    fast.eval()
    with torch.no_grad():
        eval_loss = fast(tok, pos, None, labels=lab).mean().item()
    return losses, grad_rel, eval_loss, sum(l.fast_calls for l in fast.decoder.layers), [
        l.fast_path_blocker for l in fast.decoder.layers]


def check_layer() -> dict:
    from workbench.backend import compiled_layer, distributed

    compiled_layer.set_compile(False)
    out = {}
    cases = {"gpt": DROPOUT, "llama-like": {**LLAMA_LIKE, **DROPOUT}, "hidden-only": {"model.hidden_dropout": 0.2},
             "attention-only": {"model.attention_dropout": 0.2},
             "selective": {**DROPOUT, "parallel.recompute": "selective"},
             # megatron's checkpoint restores the RNG states before recomputing: the same masks twice
             "full": {**DROPOUT, "parallel.recompute": "full"}, "no-dropout": {}}
    for i, (name, over) in enumerate(cases.items()):
        cfg = preset("tiny", **over)
        if i == 0:
            distributed.initialize_for_tests(cfg, port=int(os.environ.get("CHECK_PORT", "29631")))
        losses, rel, eval_loss, calls, blockers = _stock_vs_fast_train(cfg)
        out[name] = {"loss_stock": losses[0], "loss_fast": losses[1], "grad_rel_max": rel, "eval_loss_fast": eval_loss,
                     "fast_calls": calls, "blockers": blockers}
    return out


def _layer_inputs(s: int, b: int, h: int, ffn: int, heads: int, attention_out: bool):
    """dense_layer_forward's tensors for a layer whose self-attention has q = k = 0 and v = 1 (every context
    element 1 where one key is allowed), whose output projection is the identity (``attention_out``) or zero,
    and whose MLP returns 1 everywhere (zero fc2, bias 1)."""
    z = torch.zeros
    qkv_b = z(3 * h).view(heads, 3, h // heads)
    qkv_b[:, 2] = 1.0  # v = 1 (megatron's per-group layout [q, k, v], one head per group)
    proj = torch.eye(h) if attention_out else z(h, h)
    return [torch.randn(s, b, h), torch.ones(h), z(h), z(3 * h, h), qkv_b.reshape(-1), proj, z(h), torch.ones(h), z(h),
            z(ffn, h), z(ffn), z(h, ffn), torch.ones(h)]


def check_stats(compile_: bool | None = None) -> dict:
    """Where the compiled layer drops and how it scales, on one layer's function (eager, or compiled with
    CHECK_COMPILE=1), output minus input:

    - ``hidden`` (p=0.25, attention output zero): the MLP's output 1 after hidden dropout, 0 or 1/(1-p);
    - ``attention`` (p=0.25, one key allowed per query, identity projection): each head's context 0 or 1/(1-p),
      the same over the head's channels, plus the MLP's 1;
    - ``none`` (p=0): exactly 1 + 1.

    ``compile_``: compiled or eager (default: ``CHECK_COMPILE``)."""
    from workbench.backend import compiled_layer

    compiled_layer.set_compile(os.environ.get("CHECK_COMPILE") == "1" if compile_ is None else compile_)
    fn = compiled_layer._compiled("layer")
    s, b, h, heads, ffn = 64, 16, 64, 4, 128
    kw = dict(norm="layernorm", eps1=1e-5, eps2=1e-5, heads=heads, groups=heads, head_dim=h // heads, scale=1.0,
              activation="gelu", causal=False)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    mask[..., 0] = False  # only key 0 may be attended: its probability is 1
    out = {}
    for name, ph, pa in (("hidden", 0.25, 0.0), ("attention", 0.0, 0.25), ("none", 0.0, 0.0)):
        torch.manual_seed(0)
        args = _layer_inputs(s, b, h, ffn, heads, attention_out=name != "hidden")
        with torch.no_grad():
            y = fn(*args, mask, **kw, hidden_dropout=ph, attention_dropout=pa) - args[0]
        if name == "hidden":
            vals = y.flatten()
        else:
            per_head = (y - 1.0).reshape(s, b, heads, h // heads)
            out[name + "_same_over_head_channels"] = bool(torch.allclose(per_head, per_head[..., :1].expand_as(per_head), atol=1e-5))
            vals = per_head[..., 0].flatten()
        uniq = sorted({round(v, 4) for v in vals.tolist()})
        out[name] = {"values": uniq, "dropped": float((vals.abs() < 1e-6).float().mean()), "n": vals.numel()}
    return out


def check_recompute() -> dict:
    """Under torch.compile (inductor's own random numbers): megatron's full recompute runs each compiled layer
    forward without grad (an inference graph), then again in backward with the RNG states restored (the training
    graph); both graphs must draw the same masks, so loss and gradients equal those of the run without recompute."""
    from workbench.backend import compiled_layer, distributed

    compiled_layer.set_compile(True)
    out = {}
    for i, (name, over) in enumerate({"none": DROPOUT, "full": {**DROPOUT, "parallel.recompute": "full"}}.items()):
        cfg = preset("tiny", **over)
        if i == 0:
            distributed.initialize_for_tests(cfg, port=int(os.environ.get("CHECK_PORT", "29632")))
        model = fc._build(cfg, compiled_layer.CompiledTransformerLayer)
        g = torch.Generator().manual_seed(1)
        tok = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=g)
        pos = torch.arange(cfg.model.seq_length)[None].expand(2, -1)
        torch.manual_seed(5)
        loss = model(tok, pos, None, labels=tok).mean()
        loss.backward()
        out[name] = {"loss": loss.item(), "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
                     "fast_calls": sum(l.fast_calls for l in model.decoder.layers)}
    none, full = out["none"], out["full"]
    rel = max(((none["grads"][k] - full["grads"][k]).norm() / (none["grads"][k].norm() + 1e-12)).item() for k in none["grads"])
    return {"loss_none": none["loss"], "loss_full": full["loss"], "grad_rel_max": rel,
            "fast_calls": [none["fast_calls"], full["fast_calls"]]}


def check_families() -> dict:
    """BERT and T5 (padded encoder inputs: the padding and relative-bias masks) with dropout: three Trainer steps,
    stock vs compiled, same seeds."""
    from megatron.core import parallel_state

    cases = {"bert": ("bert-tiny", DROPOUT, False), "t5-padded": ("t5-tiny", DROPOUT, True),
             "t5-relu-hidden-only": ("t5-tiny", {"model.hidden_dropout": 0.1, "model.activation": "relu",
                                                 "model.gelu_approximate": "none"}, False)}
    out = {}
    for name, (preset_name, over, padded) in cases.items():
        runs = {}
        for fast in (False, True):
            with fc._padded_t5() if padded else contextlib.nullcontext():
                runs["fast" if fast else "stock"] = fc.check_trainer(fast, preset_name, {**over, "data.source": "synthetic"})
            parallel_state.destroy_model_parallel()
        out[name] = runs
    return out


def check_one_process() -> dict:
    """``layer``, ``stats`` (eager), ``stats`` compiled, ``recompute`` and ``families`` in one process, in that order:
    {"layer", "stats", "stats_compiled", "recompute", "families"}.  Each starts from dynamo's empty caches and a
    torn-down megatron parallel state, as in a process of its own (each seeds its own generators before it draws);
    ``CHECK_COMPILE`` must be unset (the families run eagerly, as on their own)."""
    import torch._dynamo
    from megatron.core import parallel_state

    assert os.environ.get("CHECK_COMPILE") != "1", "one-process: the families run eagerly"
    out = {}
    for name, check in (("layer", check_layer), ("stats", lambda: check_stats(False)),
                        ("stats_compiled", lambda: check_stats(True)), ("recompute", check_recompute),
                        ("families", check_families)):
        torch._dynamo.reset()
        out[name] = check()
        parallel_state.destroy_model_parallel()
    return out


@contextlib.contextmanager
def real_tracker_fork(seed: int, tp_rank: int):
    """megatron's tracker fork on the CPU generator (the CPU mode's fork is a no-op): inside it, the TP stream
    (``seed + 2718 + tp_rank``, as ``model_parallel_cuda_manual_seed``), kept across forks.  Yields the function
    that reseeds that stream."""
    from megatron.core.tensor_parallel import random as mrandom

    state = {}

    def reseed():
        state["tp"] = torch.Generator().manual_seed(seed + 2718 + tp_rank).get_state()

    reseed()

    @contextlib.contextmanager
    def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
        saved = torch.get_rng_state()
        torch.set_rng_state(state["tp"])
        try:
            yield
        finally:
            state["tp"] = torch.get_rng_state()
            torch.set_rng_state(saved)

    cls = mrandom.CudaRNGStatesTracker
    old = cls.fork
    cls.fork = fork
    try:
        yield reseed
    finally:
        cls.fork = old


def check_tp2() -> dict:
    """Under torchrun --nproc_per_node 2 (CPU, gloo): TP=2 under dropout, stock vs compiled, with a real per-rank
    tracker fork; also the stock loss with the CPU mode's no-op fork (the fork changes the masks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from workbench.backend import compiled_layer, distributed

    compiled_layer.set_compile(False)
    out = {}
    cases = {"gpt": DROPOUT, "gpt+sp": {**DROPOUT, "parallel.sequence_parallel": True},
             "hidden-only": {"model.hidden_dropout": 0.1}, "llama-like": {**LLAMA_LIKE, **DROPOUT}}
    first = True
    for name, over in cases.items():
        cfg = preset("tiny", **over, **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
        if first:
            distributed.initialize(cfg)
            first = False
        rank = parallel_state.get_tensor_model_parallel_rank()
        with real_tracker_fork(cfg.train.seed, rank) as reseed:
            losses, rel, _, calls, blockers = _stock_vs_fast_train(cfg, reseed=reseed)
        no_fork, _, _, _, _ = _stock_vs_fast_train(cfg)
        worst = torch.tensor([rel, abs(losses[0] - losses[1])])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        both = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(both, torch.tensor([losses[1]]))
        out[name] = {"loss_stock": losses[0], "loss_fast": losses[1], "grad_rel_max": worst[0].item(),
                     "loss_diff_max": worst[1].item(), "fast_calls": calls, "blockers": blockers,
                     "loss_fast_per_rank": [t.item() for t in both], "loss_stock_no_fork": no_fork[0]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["layer", "stats", "families", "tp2", "recompute", "one-process"])
    a = ap.parse_args()
    res = {"layer": check_layer, "stats": check_stats, "families": check_families, "tp2": check_tp2,
           "recompute": check_recompute, "one-process": check_one_process}[a.what]()
    if a.what == "tp2" and int(os.environ.get("RANK", "0")) != 0:
        return 0
    print("RESULT " + json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    fc._exit(main())
