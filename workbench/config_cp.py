"""The rules of context parallelism (``parallel.context_parallel`` > 1) between a config's fields.

What :mod:`workbench.backend.context_parallel` wires: a model of a family that supports it
(:attr:`workbench.families.Supports.context_parallel`: GPT causal, BERT bidirectional with its key-padding mask), on
the workbench SDPA attention's K/V ring, over sequences split into 2*cp load-balanced chunks; with
``attention_backend: te``, megatron-core's own context parallelism in Transformer Engine's attention (its ``p2p``
ring, the same load-balanced chunks), for families without a key-padding mask.  :func:`workbench.config.validate` reports each problem with its field and
fix (exit 2 before any process starts).  Torch-free.
"""

from __future__ import annotations

from typing import Any

from workbench.layout import Layout, LayoutProblem

__all__ = ["context_parallel_problems"]

CPF = "parallel.context_parallel"


def context_parallel_problems(cfg: Any, lay: Layout, supports: Any) -> list[LayoutProblem]:
    """The problems of ``cfg`` under its layout's context parallelism (none at cp = 1)."""
    cp = lay.cp
    if cp <= 1:
        return []
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    tp = p.tensor_parallel
    out: list[LayoutProblem] = []

    def add(field: str, rule: str, fix: str, *reads: str) -> None:
        out.append(LayoutProblem(field, rule, fix, reads))

    if not supports.context_parallel:
        add(CPF, f"context parallelism is wired for self-attention over one sequence (GPT causal, BERT with its padding "
            f"mask), not the {m.arch} family yet", "set context_parallel: 1", "model.arch")
    if int(getattr(m, "num_labels", 0) or 0) > 0:
        add(CPF, "sequence classification under context parallelism: the pooled first token is on CP rank 0 only and "
            "the per-sample classification loss is not weighted over the CP group (not wired)",
            "fine-tune with context_parallel: 1 (pretraining under CP is wired)", "model.num_labels")
    unit = 2 * cp * (tp if p.sequence_parallel else 1)
    if m.seq_length % unit:
        how = (f"2*context_parallel*tensor_parallel = {unit} (sequence parallelism)" if p.sequence_parallel
               else f"2*context_parallel = {unit}")
        up = -(-m.seq_length // unit) * unit
        add("model.seq_length", f"seq_length {m.seq_length} is not divisible by {how}: each rank holds 2 of 2*cp equal "
            "chunks (megatron's load-balanced order)", f"use a seq_length that is a multiple of {unit} (e.g. {up})", CPF,
            *(("parallel.sequence_parallel", "parallel.tensor_parallel") if p.sequence_parallel else ()))
    if m.attention_dropout > 0:
        add("model.attention_dropout", f"attention dropout {m.attention_dropout} under context parallelism: the ring "
            "attention has no dropout", "set attention_dropout: 0, or context_parallel: 1", CPF)
    if m.attention_backend == "local":
        add("model.attention_backend", "context parallelism runs on the workbench SDPA attention's ring or (attention_backend "
            "te) megatron-core's through Transformer Engine, not megatron's unfused local attention",
            "set attention_backend: auto, sdpa or te", CPF)
    elif m.attention_backend == "te" and supports.key_padding:
        add("model.attention_backend", f"the {m.arch} family's padding mask under Transformer Engine's context "
            "parallelism: TE's CP attention takes padded sequences only packed (THD), which is not wired",
            "set attention_backend: auto or sdpa (the workbench ring takes the padding mask)", CPF)
    if m.position_embedding == "alibi":
        add("model.position_embedding", "ALiBi under context parallelism: the ring attention takes no additive bias",
            "use rope or learned positions, or context_parallel: 1", CPF)
    for flag in ("reset_attention_mask", "reset_position_ids"):
        if getattr(d, flag, False):
            add(f"data.{flag}", "per-document masks / positions (packed documents) under context parallelism: the ring "
                "attention is causal over the whole sequence", f"set {flag}: false, or context_parallel: 1", CPF)
            break
    if t.loss_func:
        add("train.loss_func", "a custom loss under context parallelism sees one rank's slice of each sequence, and the "
            "schedule scales a (loss, report) pair by cp: its token weighting over the CP group is not wired",
            "remove train.loss_func (the family's token-mean loss is wired), or set context_parallel: 1", CPF)
    return out
