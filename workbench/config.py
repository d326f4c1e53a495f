"""The run config: one typed source of truth for widgets, CLI, planner and backend.

A :class:`RunConfig` groups five dataclasses (model / parallel / train / data /
checkpoint).  It round-trips through JSON and YAML, read strictly (:mod:`workbench.config_text`:
duplicate keys, YAML alias bombs, empty or non-UTF-8 files are refused), refuses unknown keys (a
typo must never be silently ignored), and :meth:`RunConfig.validate` reports *every* problem at
once, each naming the field, the rule and a fix, before any GPU process starts: first each field
alone (type, finite, range: :mod:`workbench.config_fields`), then the rules between fields, of
which one that reads an invalid field is skipped (only the root problem is reported).  Quantities derived from a config (padded vocab, data-parallel
size, micro-batches, parameter counts, Megatron FLOPs) live in :func:`derive` (:mod:`workbench.config_derived`)
so no two parts of the workbench ever compute them differently; the rules between fields in
:mod:`workbench.config_rules`.

This module imports neither torch nor megatron-core: it must stay light enough
for a notebook kernel and for a 50 ms planner loop.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from workbench.config_derived import (Derived, ParamCounts, allocator_reason, apply_rank_environment, derive,
                                      layer_and_head_flops, megatron_flops_per_step, pad_vocab_size,
                                      pipeline_stage_layers, rank_environment)
from workbench.config_fields import ConfigError, Problem, field_problems
from workbench.config_rules import validate
from workbench.config_text import ConfigTextError, parse_json, parse_yaml, read_config_file
from workbench.families import FAMILIES, all_presets

__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
    "DataConfig",
    "CheckpointConfig",
    "GenerationConfig",
    "RunConfig",
    "Problem",
    "ConfigError",
    "Derived",
    "ParamCounts",
    "derive",
    "pad_vocab_size",
    "megatron_flops_per_step",
    "layer_and_head_flops",
    "pipeline_stage_layers",
    "rank_environment",
    "allocator_reason",
    "apply_rank_environment",
    "validate",
    "PRESETS",
    "preset",
    "load_config",
]


# --------------------------------------------------------------------------- sections


#: ``model.arch``: the name of a family of the registry (:data:`workbench.families.FAMILIES`)
ArchName = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]


@dataclass
class CommonModelConfig:
    """The architecture fields every family reads; :class:`ModelConfig` adds each family's own."""

    #: the model family (``workbench/families/<arch>/``), one of :data:`workbench.families.FAMILIES`
    arch: ArchName = "gpt"
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    #: multihead: one KV head per query head; multiquery: one KV head; grouped: `num_query_groups` KV heads.
    attention_type: Literal["multihead", "multiquery", "grouped"] = "multihead"
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None  # None -> 4*hidden (gelu) or Llama's 8/3*hidden rounded (swiglu)
    kv_channels: int | None = None  # None -> hidden / heads
    vocab_size: int = 50257  # the tokenizer's; padded by `make_vocab_size_divisible_by * tp`
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 1024
    seq_length: int = 256
    #: relative: T5's bucketed relative position bias (one table per stack; encoder-decoder families)
    position_embedding: Literal["learned", "rope", "alibi", "relative"] = "learned"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_epsilon: float = 1e-5
    #: the MLP: gelu / relu (one fc1), swiglu / geglu (gated: fc1 holds gate and up projections); which a family takes: its `Supports.activations`
    activation: Literal["gelu", "swiglu", "relu", "geglu"] = "gelu"
    #: GELU flavour (torch's F.gelu ``approximate``): HF GPT-2's ``gelu_new`` is "tanh"; Megatron's default is exact ("none").
    gelu_approximate: Literal["none", "tanh"] = "none"
    add_bias_linear: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tie_embeddings: bool = True
    init_method_std: float = 0.02
    #: auto: Transformer Engine when importable, else the workbench SDPA module; local: stock mcore (unfused).
    attention_backend: Literal["auto", "sdpa", "te", "local"] = "auto"

    # -- derived helpers (kept here because every consumer needs them)
    @property
    def query_groups(self) -> int:
        if self.attention_type == "multihead":
            return self.num_attention_heads
        if self.attention_type == "multiquery":
            return 1
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // max(self.num_attention_heads, 1)

    @property
    def gated_mlp(self) -> bool:
        """Whether fc1 holds a gate and an up projection (swiglu, geglu)."""
        return self.activation in ("swiglu", "geglu")

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.activation in ("swiglu", "geglu"):
            # Llama's rule: 2/3 of 4h, rounded up to a multiple of 64.
            return int(math.ceil(8 * self.hidden_size / 3 / 64) * 64)
        return 4 * self.hidden_size



def _mount_family_fields() -> type:
    """:class:`ModelConfig`: one flat ``model`` section of the common fields and then each family's own
    (:attr:`workbench.families.Family.model_fields`, in registry order), so a family's fields keep their keys
    ``model.<field>`` and a new family adds its fields in its own folder."""
    own = [f.model_fields for f in FAMILIES.values() if f.model_fields is not None]
    # dataclass fields are collected along the reversed MRO: the common ones first, then the registry's order
    cls = type("ModelConfig", (*reversed(own), CommonModelConfig), {
        "__module__": __name__, "__qualname__": "ModelConfig",
        "__doc__": "Architecture: the common fields (:class:`CommonModelConfig`) and every family's own "
                   "(``Family.model_fields``); ``arch`` names the family that reads them."})
    return dataclass(cls)


#: the ``model`` section (see :func:`_mount_family_fields`)
ModelConfig = _mount_family_fields()

@dataclass
class ParallelConfig:
    """Layout. Data parallel size is derived: world_size / (tp * cp * pp) (:class:`workbench.layout.Layout`)."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    #: context parallelism: each sequence split over this many ranks (megatron's ``context_parallel_size``) in the
    #: load-balanced order, attention by a K/V ring (the workbench's over SDPA, or TE's under attention_backend te); its
    #: rules: :mod:`workbench.config_cp`
    context_parallel: int = 1
    #: model chunks per pipeline rank (interleaved 1F1B); None or 1 = plain 1F1B.
    virtual_pipeline_parallel: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    #: the share (0 to 1) of the distributed optimizer's fp32 master weights and Adam moments kept in host memory and
    #: stepped by the CPU (megatron's ``optimizer_cpu_offload`` / ``optimizer_offload_fraction``: its
    #: HybridDeviceOptimizer, on the precision-aware optimizer path, host <-> device copies overlapped).  0: off.
    #: Frees up to 12 bytes per sharded parameter on the GPU for a host-side step each iteration (the planner counts
    #: both; the advisor offers it where a layout does not fit without it).
    optimizer_cpu_offload: float = 0.0
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 1  # full recompute: layers per checkpointed block
    #: layers per pipeline stage. "balanced": the output layer and loss count as the layers
    #: they cost in FLOPs, so the last stage gets fewer transformer layers and no stage waits
    #: on it (GPT-2 medium on 2 stages: 14 + 10, not 12 + 12). "even": num_layers /
    #: pipeline_parallel each. Interleaved 1F1B (virtual_pipeline_parallel > 1) is always even.
    pipeline_split: Literal["balanced", "even"] = "balanced"
    #: launch context: world size = nnodes * nproc_per_node
    nnodes: int = 1
    nproc_per_node: int = 1
    #: cuda: NCCL on GPUs (the product path). cpu: CPU mode, gloo, for tiny models (tests, laptops).
    device: Literal["cuda", "cpu"] = "cuda"
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    #: TP > 1 on the compiled layer: each layer's backward launches the input-gradient
    #: all-reduce (reduce-scatter under SP) and computes the weight gradients while it is in
    #: flight, as megatron's async TP all-reduce does (same maths, same order of sums).
    tp_comm_overlap: bool = True
    #: TP > 1 on Transformer Engine's layer with sequence parallelism: megatron's ``tp_comm_overlap`` through TE's
    #: userbuffers (``initialize_ub``), each all-gather / reduce-scatter split and pipelined with its GEMM.  Off by
    #: default: measured slower than the compiled layer's TP + SP (Llama-3.2-3B, 2 H200s: 0.94x; docs/performance.md).
    te_userbuffers: bool = False
    #: TP = 2 with sequence parallelism on the compiled layer: each self-attention and MLP GEMM split in two row
    #: chunks, its all-gather / reduce-scatter an exchange with the peer that runs under the other chunk's GEMM, in
    #: forward and backward (:mod:`workbench.backend.tp_chunked`; NCCL, CUDA-graph capturable).  Same maths.  Off by
    #: default: measured 0.98x plain TP=2 + SP (Llama-3.2-3B, 2x H200, bench variant ``tp2-sp-chunked``).  Not with FP8, async TP or selective
    #: recompute's MLP (that MLP keeps the plain collectives).
    tp_chunked: bool = False
    #: TP > 1 with sequence parallelism on the compiled layer: torch's micro-pipelined ("async") TP, inductor's
    #: ``_micro_pipeline_tp`` pass over symmetric memory: each all-gather + GEMM and GEMM + reduce-scatter of the
    #: layer's graph split per rank and pipelined (``symm_mem.fused_all_gather_matmul`` /
    #: ``fused_matmul_reduce_scatter``, copy engines; no NVLink multicast).  CUDA only, no CUDA graphs (their capture
    #: of the symmetric-memory kernels is unproven here).  Off by default: measured slower without NVLink multicast
    #: (Llama-3.2-3B, 2 H200s: 0.53-0.58x TP + SP without graphs; docs/performance.md).
    async_tp: bool = False
    #: expert parallelism (MoE): experts split over this many ranks; expert TP: None -> tensor_parallel
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_parallel or 1

    @property
    def offload_fraction(self) -> float:
        """``optimizer_cpu_offload`` as a number (0.0 when unset): what the optimizer, planner and advisor read."""
        return float(self.optimizer_cpu_offload or 0.0)


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    train_iters: int = 50
    lr: float = 3e-4
    min_lr: float = 3e-5
    lr_warmup_iters: int = 5
    lr_decay_style: Literal["linear", "cosine", "constant"] = "cosine"
    lr_decay_iters: int | None = None  # None -> train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    #: fp16 only: None = dynamic loss scaling, a number = static scale.
    loss_scale: float | None = None
    grad_reduce_in_fp32: bool = True
    seed: int = 1234
    eval_interval: int = 25  # 0 disables eval
    eval_iters: int = 4
    log_interval: int = 1
    microbatch_timing_interval: int = 5  # per-micro-batch forward/backward CUDA-event timings every K steps (0 = never)
    tensorboard: bool = False  # the logged steps' and evals' metrics as TensorBoard scalars too (workbench.run.tensorboard)
    #: torch.compile the fused element-wise pieces of each layer (GPU only).
    compile_kernels: bool = True
    #: with compile_kernels: replay CUDA graphs, so the host no longer launches ~70 kernels per layer and
    #: micro-batch: one process captures its whole training step as one graph (workbench.backend.step_graph),
    #: otherwise each compiled layer's forward and backward (torch.compile "reduce-overhead").  GPU only;
    #: training steps only (eval and generation stay uncaptured).
    cuda_graphs: bool = True
    #: FP8 GEMMs (off = the precision above).  On the compiled layer through torch (workbench.backend.fp8):
    #: tensorwise | rowwise current scaling, delayed (the last step's maxima: a history of 1).  On Transformer Engine's layer:
    #: tensorwise (current scaling) | delayed (TE's amax history, 1024 steps).  workbench.kernel_rule.fp8_problems says which fit.
    fp8: Literal["off", "tensorwise", "rowwise", "delayed"] = "off"
    #: custom train step (see workbench.hooks): dotted paths "pkg.module:function" (or "pkg.module.function").
    forward_step: str | None = None
    loss_func: str | None = None
    #: keyword arguments passed to the custom forward_step / loss_func.
    hook_kwargs: dict[str, Any] = field(default_factory=dict)
    #: compute the loss from the last stage's logits and keep them for the loss hook / Python API.
    return_logits: bool = False
    #: peak dense TFLOP/s per GPU for MFU; None = look the device up in workbench.rank.metrics.
    peak_tflops: float | None = None


@dataclass
class DatasetEntry:
    prefix: str  # path prefix of PREFIX.bin / PREFIX.idx
    weight: float = 1.0


@dataclass
class DataConfig:
    #: demo: the embedded corpus (no download); indexed: Megatron .bin/.idx prefixes; synthetic: tests only.
    source: Literal["demo", "indexed", "synthetic"] = "demo"
    datasets: list[DatasetEntry] = field(default_factory=list)
    split: str = "949,50,1"
    #: 'demo' (the embedded corpus's byte-level BPE), a local HF tokenizer dir / tokenizer.json, or 'gpt2' from a local dir
    tokenizer: str = "demo"
    cache_dir: str | None = None  # None -> <run_dir>/data_cache
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    #: processes that build training micro-batches ahead of the step on a GPU (megatron-LM's ``--num-workers``
    #: default); 0 builds them in the rank between launches.  CPU mode always builds them inline.
    num_workers: int = 2
    #: span corruption (encoder-decoder pretraining, T5): fraction of tokens masked, and the mean length of a masked span
    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0


@dataclass
class CheckpointConfig:
    save_dir: str | None = None  # None -> <run_dir>/checkpoints
    save_interval: int = 0  # 0: only at the end / on clean exit
    save_on_exit: bool = True
    load_dir: str | None = None
    #: load weights only (fresh optimizer, iteration 0): fine-tuning a converted model.
    finetune: bool = False


@dataclass
class GenerationConfig:
    """Decoding options; validated like the rest so CLI, notebook and backend agree."""

    max_new_tokens: int = 32
    greedy: bool = False
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    temperature: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    add_bos: bool = False
    stop_token: int | None = None
    seed: int = 1234
    return_log_probs: bool = False

    def validate(self, prefix: str = "generation") -> list["Problem"]:
        p: list[Problem] = field_problems(self, prefix)
        if p:  # a wrong type or a non-finite number: the rules below compare numbers
            return p
        if self.max_new_tokens < 1:
            p.append(Problem(f"{prefix}.max_new_tokens", "must be >= 1", "set max_new_tokens to a positive number"))
        if self.top_k < 0:
            p.append(Problem(f"{prefix}.top_k", "must be >= 0", "use 0 to disable top-k"))
        if not 0.0 <= self.top_p <= 1.0:
            p.append(Problem(f"{prefix}.top_p", "must be in [0, 1]", "use 0 to disable top-p"))
        if self.top_k > 0 and self.top_p > 0:
            p.append(Problem(f"{prefix}.top_k", "top-k and top-p are mutually exclusive", "set one of top_k / top_p to 0"))
        if self.temperature <= 0:
            p.append(Problem(f"{prefix}.temperature", "must be > 0", "use greedy=True for deterministic decoding"))
        if self.top_p_decay and not self.top_p:
            p.append(Problem(f"{prefix}.top_p_decay", "needs top_p > 0", "set top_p or drop top_p_decay"))
        if not 0.0 <= self.top_p_decay <= 1.0 or not 0.0 <= self.top_p_bound <= 1.0:
            p.append(Problem(f"{prefix}.top_p_decay", "top_p_decay and top_p_bound must be in [0, 1]", "e.g. top_p_decay=0.5"))
        if self.num_beams < 1:
            p.append(Problem(f"{prefix}.num_beams", "must be >= 1", "use 1 to disable beam search"))
        if self.num_beams > 1 and (self.top_k > 0 or self.top_p > 0):
            p.append(Problem(f"{prefix}.num_beams", "beam search is deterministic: it cannot be combined with top-k/top-p sampling", "set top_k=0 and top_p=0, or num_beams=1"))
        if self.greedy and (self.top_k > 0 or self.top_p > 0):
            p.append(Problem(f"{prefix}.greedy", "greedy excludes top-k/top-p sampling", "drop greedy or the sampling options"))
        return p


# --------------------------------------------------------------------------- run config


@dataclass
class RunConfig:
    name: str = "run"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    # ---- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | None = None) -> "RunConfig":
        """Build from nested dicts; unknown keys and wrong types are problems, not silence."""
        problems: list[Problem] = []
        cfg = _build(cls, data, "", problems)
        if problems:
            # the rules too, on what could be read (each bad value at its default), so a config with
            # four problems shows four; a rule that reads a field already reported is left out
            try:
                problems += validate(cfg, bad={q.field for q in problems})
            except Exception:  # a combination a rule cannot take: the first problems stand
                pass
            raise ConfigError(problems, source)
        return cfg

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> "RunConfig":
        """From JSON text (duplicate keys refused: :func:`workbench.config_text.parse_json`)."""
        return cls._from_text(parse_json, text, source)

    @classmethod
    def from_yaml(cls, text: str, source: str | None = None) -> "RunConfig":
        """From YAML text (duplicate keys and alias bombs refused: :func:`workbench.config_text.parse_yaml`)."""
        return cls._from_text(parse_yaml, text, source)

    @classmethod
    def _from_text(cls, parse: Any, text: str, source: str | None) -> "RunConfig":
        import yaml

        try:
            data = parse(text) if text.strip() else None
        except (ConfigTextError, yaml.YAMLError) as e:
            raise ConfigError([Problem(source or "<text>", getattr(e, "rule", f"not valid YAML: {e}"), getattr(e, "fix", "fix the syntax"))]) from None
        if data is None:
            raise ConfigError([Problem(source or "<text>", "holds no config (empty, or only comments)", "write the config, e.g. `workbench config preset tiny --yaml`")])
        return cls.from_dict(data, source)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = self.to_yaml() if path.suffix in (".yaml", ".yml") else self.to_json()
        path.write_text(text)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RunConfig":
        return load_config(path)

    def replace(self, **overrides: Any) -> "RunConfig":
        """Copy with dotted overrides: ``cfg.replace(**{"parallel.tensor_parallel": 2})``."""
        d = self.to_dict()
        for key, value in overrides.items():
            _set_dotted(d, key, value)
        return RunConfig.from_dict(d)

    # ---- validation
    def validate(self) -> list[Problem]:
        return validate(self)

    def check(self) -> "RunConfig":
        problems = self.validate()
        if problems:
            raise ConfigError(problems)
        return self

    def derived(self) -> "Derived":
        return derive(self)


def _set_dotted(d: dict, key: str, value: Any) -> None:
    parts = key.replace("__", ".").split(".")
    cur = d
    for part in parts[:-1]:
        if part not in cur or not isinstance(cur[part], dict):
            raise ConfigError([Problem(key, f"unknown section '{part}'", _suggest_key(key, d))])
        cur = cur[part]
    if parts[-1] not in cur:
        raise ConfigError([Problem(key, "unknown field", _suggest_key(key, d))])
    cur[parts[-1]] = value


def _suggest_key(key: str, d: dict) -> str:
    """The fix for an unknown dotted key: the field of that name in another section (``tensor_parallel`` ->
    ``parallel.tensor_parallel``), else the closest dotted key, else the sections' names."""
    import difflib

    known = [f"{sec}.{f}" for sec, fields in d.items() if isinstance(fields, dict) for f in fields
             if not isinstance(fields[f], dict)]
    known += [f"{sec}.{sub}.{f}" for sec, fields in d.items() if isinstance(fields, dict) for sub, inner in fields.items()
              if isinstance(inner, dict) for f in inner]
    dotted = key.replace("__", ".")
    last = dotted.split(".")[-1]
    same = [k for k in known if k.split(".")[-1] == last]
    close = same or difflib.get_close_matches(dotted, known, n=1, cutoff=0.75) or [
        k for k in known if k.split(".")[-1] in difflib.get_close_matches(last, [k.split(".")[-1] for k in known], n=1)]
    if close:
        return f"did you mean '{close[0]}'? (fields are dotted: section.field)"
    return f"fields are dotted, section.field; sections: {', '.join(sorted(k for k, v in d.items() if isinstance(v, dict)))}"


def did_you_mean(name: str, options: list[str]) -> str:
    import difflib

    m = difflib.get_close_matches(name, options, n=1)
    return f"did you mean '{m[0]}'?" if m else f"known keys: {', '.join(options)}"


#: keys earlier versions wrote (saved run configs, checkpoints) that no longer mean anything:
#: skipped with a warning, so old runs still load
RETIRED_KEYS = {
    "train.tp_collectives_in_graph": "TP layers are now always one compiled graph with their collectives inside",
    "train.tp_overlap_batch_halves": "TP layers in two interleaved batch halves measured slower (1.20x vs 1.28x on 2 H200s) and were removed",
}


#: what _coerce returns for a value of the wrong type (reported): the field keeps its default
_BAD = object()


def _build(cls: type, data: Any, path: str, problems: list[Problem]) -> Any:
    if not isinstance(data, dict):
        problems.append(Problem(path or "<root>", f"expected a mapping, got {type(data).__name__}", "check the file's nesting"))
        return _build(cls, {}, path, [])
    hints = get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        fpath = f"{path}.{key}" if path else str(key)
        if key not in names and fpath in RETIRED_KEYS:
            warnings.warn(f"config key {fpath} is ignored: {RETIRED_KEYS[fpath]}", stacklevel=2)
            continue
        if key not in names:
            problems.append(Problem(fpath, "unknown key", did_you_mean(str(key), names)))
            continue
        value = _coerce(hints[key], value, fpath, problems)
        if value is not _BAD:
            kwargs[key] = value
    for f in fields(cls):  # a required field (a dataset's prefix) that is missing or bad
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if not any(q.field == f"{path}.{f.name}" for q in problems):
                problems.append(Problem(f"{path}.{f.name}", "missing", f"add {f.name}"))
            kwargs[f.name] = hints[f.name]() if hints[f.name] in (str, int, float, bool) else None
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    """``value`` read as type ``tp``; a wrong type is a problem and :data:`_BAD` (ranges: :mod:`workbench.config_fields`)."""
    origin = get_origin(tp)
    args = get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is Literal:
        if value not in args:
            problems.append(Problem(path, f"must be one of {', '.join(map(repr, args))}, got {value!r}", f"pick one of {list(args)}"))
            return _BAD
        return value
    if origin is list:
        if not isinstance(value, list):
            problems.append(Problem(path, "expected a list", "write it as a list"))
            return _BAD
        return [_coerce(args[0], v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(Problem(path, f"expected a mapping, got {value!r}", "write it as a mapping of names to values"))
            return _BAD
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path, problems)
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(Problem(path, f"expected true/false, got {value!r}", "use true or false"))
            return _BAD
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            problems.append(Problem(path, f"expected an integer, got {value!r}", "use a whole number"))
            return _BAD
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                pass
        try:
            if not isinstance(value, bool) and isinstance(value, (int, float)):
                return float(value)
        except OverflowError:
            problems.append(Problem(path, f"{str(value)[:20]}... ({len(str(value))} digits) is too large for a number", "use a number such as 3e-4"))
            return _BAD
        problems.append(Problem(path, f"expected a number, got {value!r}", "use a number such as 3e-4"))
        return _BAD
    if tp is str:
        if not isinstance(value, str):
            problems.append(Problem(path, f"expected a string, got {value!r}", "quote the value"))
            return _BAD
        return value
    return value


def load_config(path: str | Path) -> RunConfig:
    """Read a JSON or YAML run config; every problem in it is reported at once.  The file itself
    (size, encoding, duplicate keys, YAML aliases) is checked by :func:`workbench.config_text.read_config_file`."""
    try:
        data = read_config_file(path)
    except ConfigTextError as e:
        raise ConfigError([Problem(str(path), e.rule, e.fix)]) from None
    return RunConfig.from_dict(data, str(path))


# --------------------------------------------------------------------------- presets


#: every family's presets, by name (the families define them: ``workbench/families/<family>/``)
PRESETS: dict[str, Any] = {name: family for name, (family, _) in all_presets().items()}


def preset(name: str, **overrides: Any) -> RunConfig:
    """A fresh copy of a named preset, with optional dotted overrides."""
    if name not in PRESETS:
        raise ConfigError([Problem("preset", f"unknown preset '{name}'", did_you_mean(name, list(PRESETS)))])
    cfg = RunConfig.from_dict(copy.deepcopy(all_presets()[name][1]), source=f"preset {name}")
    return cfg.replace(**overrides) if overrides else cfg
