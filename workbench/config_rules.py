"""Validation of a run config: every problem at once, each naming the field, the rule and a fix (:func:`validate`).

First each field alone (:func:`workbench.config_fields.field_problems`: type, finite, range), then the rules between
fields (:func:`between_fields`), by concern: the model (and the family's own rules), the parallel layout (and context
parallelism's, :mod:`workbench.config_cp`), training, data, checkpoint.  Torch-free; nothing a config names is
imported or run (hooks are looked for on disk).  ``cfg`` is a :class:`workbench.config.RunConfig` (typed ``Any`` here:
that module imports this one).  :mod:`workbench.config` re-exports :func:`validate`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from workbench import kernel_rule
from workbench.config_cp import context_parallel_problems
from workbench.config_derived import derive, pipeline_stage_layers
from workbench.config_fields import LARGEST_ACCELERATOR_BYTES, Problem, at_defaults, field_problems, module_exists, reads_bad
from workbench.families import FAMILIES, Supports, family_of
from workbench.layout import Layout

__all__ = ["validate", "between_fields"]

#: ``add(field, rule, fix, *reads)``: a rule's report, with the fields (or sections) it reads; ``None`` for a
#: family's or the kernel rule's, whose reads are not listed
Add = Callable[..., None]
_WORLD_FIELDS = ("parallel.nnodes", "parallel.nproc_per_node", "parallel.tensor_parallel", "parallel.pipeline_parallel")


def validate(cfg: Any, bad: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Every rule, every problem at once. Each names the field, the rule and a fix.

    First each field alone (:func:`workbench.config_fields.field_problems`: type, finite, range), then
    the rules between fields, on a copy with every invalid field at its default.  A rule that reads an
    invalid field (or one in ``bad``: what the caller reported already, e.g. a wrong type in a file) is
    skipped: its premise is wrong already, so only the root problem is reported.
    """
    P = field_problems(cfg)
    bad = set(bad) | {q.field for q in P}

    def run(c: Any) -> list[tuple[Problem, tuple[str, ...] | None]]:
        found: list[tuple[Problem, tuple[str, ...] | None]] = []
        between_fields(c, lambda f, r, x, *reads: found.append((Problem(f, r, x), None if reads == (None,) else reads)))
        return found

    found = run(at_defaults(cfg, bad) if bad else cfg)
    if bad and any(reads is None for _, reads in found):  # rules whose reads are not listed: kept when the same
        try:                                                 # with other stand-ins for the invalid fields
            again = {q for q, reads in run(at_defaults(cfg, bad, probe=True)) if reads is None}
            found = [(q, reads) for q, reads in found if reads is not None or q in again]
        except Exception:  # a stand-in a rule cannot take: the text check of reads_bad stays
            pass
    return P + [q for q, reads in found if not reads_bad(q, reads, bad)]


def between_fields(cfg: Any, add: Add) -> None:
    """The rules between fields, by concern: ``add(field, rule, fix, *reads)`` (:data:`Add`)."""
    _model_rules(cfg, add)
    _parallel_rules(cfg, add)
    _train_rules(cfg, add)
    _data_rules(cfg, add)


def _family(cfg: Any) -> tuple[bool, Supports]:
    """Whether the config's family exists, and what it supports (nothing, when it does not)."""
    known = cfg.model.arch in FAMILIES
    return known, (family_of(cfg).supports if known else Supports())


def _model_rules(cfg: Any, add: Add) -> None:
    """The family's own rules and fields, the head / query-group / FFN split over TP, positions and activations."""
    m, p = cfg.model, cfg.parallel
    tp, pp, vpp = p.tensor_parallel, p.pipeline_parallel, p.vpp
    heads, groups = m.num_attention_heads, m.query_groups
    arch = "model.arch"
    if m.arch not in FAMILIES:
        add("model.arch", f"'{m.arch}' has no model family yet (families: {', '.join(FAMILIES)})", f"set arch to one of: {', '.join(FAMILIES)}")
    known = m.arch in FAMILIES
    for field_name, rule, fix in family_of(cfg).rules(cfg) if known else ():
        add(field_name, rule, fix, None)
    sup = family_of(cfg).supports if known else Supports()
    if pp > 1 and not sup.pipeline:
        add("parallel.pipeline_parallel", sup.pipeline_reason or f"the {m.arch} family has no pipeline parallelism", "set pipeline_parallel: 1", arch)
    if vpp > 1 and not sup.interleaved:
        add("parallel.virtual_pipeline_parallel", f"the {m.arch} family has no interleaved schedule", "leave virtual_pipeline_parallel unset", arch)
    for fam in FAMILIES.values():  # each family's own fields, whatever the config's family (e.g. model.moe, model.num_labels)
        for field_name, rule, fix, *reads in fam.field_rules(cfg, sup):
            add(field_name, rule, fix, *reads)
    if p.sequence_parallel and not sup.sequence_parallel:
        add("parallel.sequence_parallel", f"the {m.arch} family has no sequence parallelism", "set sequence_parallel: false", arch)
    if m.kv_channels is None and m.hidden_size % heads:
        add("model.hidden_size", f"hidden_size {m.hidden_size} is not divisible by num_attention_heads {heads}", f"use a hidden size that is a multiple of {heads}, or set kv_channels",
            "model.num_attention_heads", "model.kv_channels")
    head_fields = ("model.num_attention_heads", "model.attention_type", "model.num_query_groups")
    if m.attention_type == "grouped":
        if not m.num_query_groups:
            add("model.num_query_groups", "grouped attention needs num_query_groups", f"set num_query_groups to a divisor of {heads}", *head_fields)
        elif heads % m.num_query_groups:
            add("model.num_query_groups", f"num_attention_heads {heads} is not divisible by num_query_groups {m.num_query_groups}", "choose a divisor of the head count", *head_fields)
    elif m.num_query_groups not in (None, groups):
        add("model.num_query_groups", f"num_query_groups={m.num_query_groups} conflicts with attention_type '{m.attention_type}'", "set attention_type: grouped, or remove num_query_groups", *head_fields)
    if heads % tp:  # one problem: the query groups and ffn rules would repeat it about fields the user may never have set
        common = math.gcd(math.gcd(heads, groups), m.ffn_size)
        ok = [str(x) for x in range(1, common + 1) if common % x == 0]
        add("parallel.tensor_parallel", f"num_attention_heads {heads} is not divisible by tensor_parallel {tp}",
            f"use a tensor_parallel that divides the heads{' and query groups' if groups != heads else ''}: one of {', '.join(ok)}", *head_fields)
    elif groups % tp:
        add("model.num_query_groups", f"query groups ({groups}) are not divisible by tensor_parallel {tp}: every TP rank needs whole KV heads",
            f"use tensor_parallel dividing {groups}, or more query groups", "parallel.tensor_parallel", *head_fields)
    if m.ffn_size % tp and not heads % tp:
        add("model.ffn_hidden_size", f"ffn size {m.ffn_size} is not divisible by tensor_parallel {tp}", "pick an ffn_hidden_size that is a multiple of tensor_parallel",
            "parallel.tensor_parallel", "model.num_attention_heads", "model.hidden_size", "model.activation")
    if m.seq_length > m.max_position_embeddings and m.position_embedding == "learned":
        add("model.seq_length", f"seq_length {m.seq_length} > max_position_embeddings {m.max_position_embeddings} (learned positions)",
            f"lower seq_length or raise max_position_embeddings to >= {m.seq_length}", "model.max_position_embeddings", "model.position_embedding")
    if m.gelu_approximate != "none" and m.activation not in ("gelu", "geglu"):
        add("model.gelu_approximate", f"gelu_approximate applies to activations 'gelu' / 'geglu' only (activation is '{m.activation}')", "set gelu_approximate: none", "model.activation")
    if known and m.position_embedding not in sup.positions:
        add("model.position_embedding", f"the {m.arch} family has no '{m.position_embedding}' positions", f"use one of: {', '.join(sup.positions)}", arch)
    if known and m.activation not in sup.activations:
        add("model.activation", f"the {m.arch} family has no '{m.activation}' MLP", f"use one of: {', '.join(sup.activations)}", arch)
    if m.position_embedding == "alibi" and m.attention_backend in ("te", "local"):
        add("model.attention_backend", f"ALiBi is implemented only in the workbench SDPA attention, not '{m.attention_backend}'", "set attention_backend: sdpa (or auto)", "model.position_embedding")


def _parallel_rules(cfg: Any, add: Add) -> None:
    """The world's split (:mod:`workbench.layout`), the pipeline split, SP, CP, CPU mode, overlap, and the weights of one
    model-parallel rank against the largest accelerator."""
    m, p = cfg.model, cfg.parallel
    tp, pp, vpp = p.tensor_parallel, p.pipeline_parallel, p.vpp
    known, _ = _family(cfg)
    world, lay = p.world_size, Layout.of(cfg)
    for q in lay.problems():  # the world splits into tp x cp x pp blocks (workbench.layout)
        add(q.field, q.rule, q.fix, *q.reads)
    split_fields = ("model.num_layers", "parallel.virtual_pipeline_parallel", "parallel.pipeline_split")
    if m.num_layers < pp:
        add("parallel.pipeline_parallel", f"num_layers {m.num_layers} is fewer than pipeline_parallel {pp} stages", f"use pipeline_parallel <= {m.num_layers}", "model.num_layers")
    elif known and sum(pipeline_stage_layers(cfg)) != m.num_layers:
        how = ("interleaving splits layers evenly" if vpp > 1 else
               "pipeline_split is even" if p.pipeline_split == "even" else "no balanced split exists")
        add("parallel.pipeline_parallel", f"num_layers {m.num_layers} is not divisible by pipeline_parallel {pp} ({how})",
            f"use a pipeline_parallel that divides {m.num_layers}" + ("" if vpp > 1 or p.pipeline_split == "balanced" else ", or pipeline_split: balanced"), *split_fields)
    if p.virtual_pipeline_parallel not in (None, 1):
        if pp < 2:
            add("parallel.virtual_pipeline_parallel", "interleaving needs pipeline_parallel >= 2", "raise pipeline_parallel or set virtual_pipeline_parallel: null", "parallel.pipeline_parallel")
        elif m.num_layers % (pp * vpp):
            add("parallel.virtual_pipeline_parallel", f"num_layers {m.num_layers} is not divisible by pp*vpp = {pp * vpp}", f"choose vpp so that pp*vpp divides {m.num_layers}",
                "parallel.pipeline_parallel", "model.num_layers")
    if p.sequence_parallel and tp < 2:
        add("parallel.sequence_parallel", "sequence parallelism needs tensor_parallel > 1", "set tensor_parallel >= 2 or sequence_parallel: false", "parallel.tensor_parallel")
    if p.sequence_parallel and m.seq_length % tp:
        add("model.seq_length", f"with sequence parallelism seq_length {m.seq_length} must be divisible by tensor_parallel {tp}", "round seq_length to a multiple of tensor_parallel",
            "parallel.sequence_parallel", "parallel.tensor_parallel")
    for q in context_parallel_problems(cfg, lay, family_of(cfg).supports if known else Supports()):
        add(q.field, q.rule, q.fix, *q.reads)
    if p.device == "cpu":
        if world > 8:
            add("parallel.device", f"CPU mode is for tiny models on 1-8 processes, not {world}", "use device: cuda on GPUs", "parallel.nnodes", "parallel.nproc_per_node")
        if p.overlap_grad_reduce or p.overlap_param_gather:
            add("parallel.overlap_grad_reduce", "communication overlap needs CUDA streams", "turn overlap off on device: cpu", "parallel.device", "parallel.overlap_param_gather")
    _offload_rules(p, cfg.train, add)
    if p.overlap_param_gather and not p.distributed_optimizer:
        add("parallel.overlap_param_gather", "param-gather overlap needs the distributed optimizer", "set distributed_optimizer: true or overlap_param_gather: false", "parallel.distributed_optimizer")
    if known:  # the weights alone of one model-parallel rank: beyond any accelerator, the model is not trainable anywhere
        dv = derive(cfg)
        per_rank = max(dv.params_per_stage) / tp
        if 2 * per_rank > LARGEST_ACCELERATOR_BYTES:
            add("model", f"{dv.params.total / 1e9:.4g}B parameters: each of the tp x pp = {tp} x {pp} model-parallel ranks would hold "
                f"{per_rank / 1e9:.4g}B of them, {2 * per_rank / 1e9:.4g} GB of weights alone at 2 bytes each, more than any accelerator "
                f"holds ({LARGEST_ACCELERATOR_BYTES / 1e9:.0f} GB)", "use fewer or smaller layers, or more tensor_parallel / pipeline_parallel "
                "(`workbench plan` gives each rank's memory)", "parallel")


def _offload_rules(p: Any, t: Any, add: Add) -> None:
    """``parallel.optimizer_cpu_offload``: a fraction; megatron offloads the distributed optimizer's state, from GPUs, of
    bf16 / fp16 training."""
    f = p.optimizer_cpu_offload
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        add("parallel.optimizer_cpu_offload", f"must be a fraction from 0 to 1 (got {f!r})", "e.g. 1.0 (all of the optimizer state in host memory) or 0 (off)")
        return
    if f == 0:
        return
    if not p.distributed_optimizer:
        add("parallel.optimizer_cpu_offload", "offload moves the distributed optimizer's state (megatron's HybridDeviceOptimizer runs under it)",
            "set distributed_optimizer: true, or optimizer_cpu_offload: 0", "parallel.distributed_optimizer")
    if p.device == "cpu":
        add("parallel.optimizer_cpu_offload", "CPU mode already keeps the optimizer in host memory (offload copies between GPU and host)",
            "set optimizer_cpu_offload: 0 on device: cpu", "parallel.device")
    if t.precision == "fp32":
        add("parallel.optimizer_cpu_offload", "megatron-core 0.19's offload keeps fp32 copies of bf16 / fp16 weights: with fp32 weights "
            "there are none, and restoring its state on a resume fails (HybridDeviceOptimizer._update_fp32_params_by_new_state)",
            "train in bf16 (train.precision: bf16), or set optimizer_cpu_offload: 0", "train.precision")


def _train_rules(cfg: Any, add: Add) -> None:
    """The batch over DP (and interleaving), FP8 and userbuffers (the kernel rule's), the LR schedule, loss scaling,
    the hooks (looked for on disk), precision on CPU."""
    p, t = cfg.parallel, cfg.train
    pp, vpp = p.pipeline_parallel, p.vpp
    known, _ = _family(cfg)
    lay = Layout.of(cfg)
    world_fields = _WORLD_FIELDS
    dp = lay.dp if lay.divisible else None
    batch_fields = ("train.micro_batch_size", *world_fields)
    if dp:
        if t.global_batch_size % (t.micro_batch_size * dp):
            add("train.global_batch_size", f"global_batch_size {t.global_batch_size} is not divisible by micro_batch_size*dp = {t.micro_batch_size}*{dp}", f"use a multiple of {t.micro_batch_size * dp}", *batch_fields)
        else:
            micro = t.global_batch_size // (t.micro_batch_size * dp)
            if vpp > 1 and pp > 1 and micro % pp:
                add("train.global_batch_size", f"interleaved 1F1B needs the number of micro-batches ({micro}) divisible by pipeline_parallel {pp}",
                    f"use a global batch giving a multiple of {pp} micro-batches", "parallel.virtual_pipeline_parallel", *batch_fields)
    for field_name, rule, fix in (kernel_rule.fp8_problems(cfg) + kernel_rule.userbuffer_problems(cfg)
                                    + kernel_rule.async_tp_problems(cfg) + kernel_rule.chunked_problems(cfg)) if known else ():
        add(field_name, rule, fix, None)
    if t.min_lr > t.lr:
        add("train.min_lr", f"must be in [0, lr] (lr={t.lr}, min_lr={t.min_lr})", "lower min_lr", "train.lr")
    decay_iters = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_iters >= decay_iters and t.lr_warmup_iters > 0:
        add("train.lr_warmup_iters", f"must be in [0, decay iters) = [0, {decay_iters}) (megatron's LR scheduler asserts warmup < decay)",
            f"use at most {max(decay_iters - 1, 0)} warmup iterations, or 0", "train.lr_decay_iters", "train.train_iters")
    if t.loss_scale is not None and t.precision != "fp16":
        add("train.loss_scale", f"loss scaling applies to fp16 only (precision is {t.precision})", "remove loss_scale or set precision: fp16", "train.precision")
    for hook in ("forward_step", "loss_func"):
        path = getattr(t, hook)
        if path is not None:
            mod = path.split(":", 1)[0] if ":" in path else path.rpartition(".")[0]
            if not mod or (":" in path and not path.split(":", 1)[1]):
                add(f"train.{hook}", f"'{path}' is not a dotted path to a function", "write it as 'package.module:function'")
            elif not module_exists(mod):  # looked for on disk: nothing a config names runs during validation
                add(f"train.{hook}", f"module '{mod}' is not importable", "put the module on PYTHONPATH (e.g. next to the notebook) or fix the path")
    if p.device == "cpu" and t.precision == "fp16":
        add("train.precision", "fp16 is not supported on CPU", "use bf16 or fp32 on device: cpu", "parallel.device")


def _data_rules(cfg: Any, add: Add) -> None:
    """The indexed datasets, the split, and the checkpoint's fine-tuning source."""
    d, c = cfg.data, cfg.checkpoint
    if d.source == "indexed":
        if not d.datasets:
            add("data.datasets", "source 'indexed' needs at least one dataset prefix", "add {prefix: /path/to/name_text_document, weight: 1}", "data.source")
        for i, e in enumerate(d.datasets):
            if not e.prefix:
                add(f"data.datasets[{i}].prefix", "empty prefix", "give PREFIX of PREFIX.bin/PREFIX.idx", "data.source")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
        if len(parts) != 3 or any(not 0 <= x < math.inf for x in parts) or not 0 < sum(parts) < math.inf:
            raise ValueError
    except ValueError:
        add("data.split", f"'{d.split}' is not three non-negative numbers", "use e.g. '949,50,1'")
    if c.finetune and not c.load_dir:
        add("checkpoint.finetune", "finetune needs load_dir", "set checkpoint.load_dir", "checkpoint.load_dir")
