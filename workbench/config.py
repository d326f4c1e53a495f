"""The run config: one typed source of truth for widgets, CLI, planner and backend.

A :class:`RunConfig` groups five dataclasses (model / parallel / train / data /
checkpoint).  It round-trips through JSON and YAML, read strictly (:mod:`workbench.config_text`:
duplicate keys, YAML alias bombs, empty or non-UTF-8 files are refused), refuses unknown keys (a
typo must never be silently ignored), and :meth:`RunConfig.validate` reports *every* problem at
once, each naming the field, the rule and a fix, before any GPU process starts: first each field
alone (type, finite, range: :mod:`workbench.config_fields`), then the rules between fields, of
which one that reads an invalid field is skipped (only the root problem is reported).  Quantities derived from a config (padded vocab, data-parallel
size, micro-batches, parameter counts, Megatron FLOPs) live in :func:`derive`
so no two parts of the workbench ever compute them differently.

This module imports neither torch nor megatron-core: it must stay light enough
for a notebook kernel and for a 50 ms planner loop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import types
import typing
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from workbench import kernel_rule
from workbench.config_fields import LARGEST_ACCELERATOR_BYTES, ConfigError, Problem, at_defaults, field_problems, module_exists, reads_bad
from workbench.config_text import ConfigTextError, parse_json, parse_yaml, read_config_file
from workbench.config_cp import context_parallel_problems
from workbench.layout import Layout
from workbench.families import FAMILIES, Supports, all_presets, family_of

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
    "derive",
    "pad_vocab_size",
    "megatron_flops_per_step",
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
    #: load-balanced order, attention by a K/V ring over SDPA; its rules: :mod:`workbench.config_cp`
    context_parallel: int = 1
    #: model chunks per pipeline rank (interleaved 1F1B); None or 1 = plain 1F1B.
    virtual_pipeline_parallel: int | None = None
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
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
    #: default: not measured yet (two GPUs; ``bench/train_throughput.py`` rows ``tp2-te`` / ``tp2-te-ub``).
    te_userbuffers: bool = False
    #: expert parallelism (MoE): experts split over this many ranks; expert TP: None -> tensor_parallel
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_parallel or 1


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
    #: with compile_kernels: replay each compiled layer's forward and backward as CUDA graphs
    #: (torch.compile "reduce-overhead"), so the host no longer launches ~70 kernels per layer
    #: and micro-batch.  GPU only; training steps only (eval and generation stay uncaptured).
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


# --------------------------------------------------------------------------- derived


def pad_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: pad to a multiple of ``divisible_by * tp`` so every TP shard is equal."""
    multiple = max(divisible_by, 1) * max(tp, 1)
    return int(math.ceil(vocab_size / multiple) * multiple)


def layer_and_head_flops(cfg: RunConfig) -> tuple[float, float]:
    """Megatron's FLOP terms of one layer and of the output layer + loss, in units of
    ``12 * tokens * h^2`` (the model family's ``shapes.layer_and_head_flops``)."""
    vocab = pad_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)
    return family_of(cfg).shapes.layer_and_head_flops(cfg, vocab)


def megatron_flops_per_step(cfg: RunConfig, batch_size: int | None = None) -> float:
    """Model FLOPs of one training step (forward + backward), Megatron's formula.

    From ``megatron/training/training.py::num_floating_point_operations``:
    12 * B * s * L * h^2 * ((1 + g/a + s/h) * (d*a/h) + (f/h) * gate + V / (2 L h)).
    Recompute is deliberately not counted (MFU, not hardware FLOPs).
    """
    m = cfg.model
    b = batch_size if batch_size is not None else cfg.train.global_batch_size
    layer, head = layer_and_head_flops(cfg)
    return 12.0 * b * m.seq_length * m.hidden_size**2 * (m.num_layers * layer + head)


def pipeline_stage_layers(cfg: RunConfig) -> tuple[int, ...]:
    """Transformer layers held by each pipeline rank (all its virtual chunks together).

    ``parallel.pipeline_split: balanced`` (without interleaving) picks the first and last
    stages' counts (megatron's ``num_layers_in_first/last_pipeline_stage``; middle stages
    split the rest evenly) that minimise the slowest stage's FLOPs, the output layer and
    loss counted on the last stage.  In 1F1B every stage runs at the pace of the slowest,
    so this is the split the ideal ``(p-1)/m`` bubble assumes.  Ties go to the even split.
    Falls back to the even split when no other split is valid (e.g. too few layers).
    """
    L, pp = cfg.model.num_layers, max(cfg.parallel.pipeline_parallel, 1)
    even = tuple([max(L // pp, 1)] * pp)
    if pp == 1 or cfg.parallel.pipeline_split != "balanced" or cfg.parallel.vpp > 1 or L < pp:
        return even
    return _balanced_split(L, pp, *layer_and_head_flops(cfg)) or even


@functools.lru_cache(maxsize=256)
def _balanced_split(L: int, pp: int, layer: float, head: float) -> tuple[int, ...] | None:
    """:func:`pipeline_stage_layers`' search: (first, middle stages, last) in the order first, then last,
    ascending; the first split strictly faster than the best so far wins (None: no valid split)."""
    k = pp - 2  # middle stages, each holding `per` layers

    def slowest(first: int, per: int, last: int) -> float:
        return max(first * layer + 0.0, per * layer + 0.0, last * layer + head) if k else max(first * layer + 0.0, last * layer + head)

    best = (L // pp, L // pp, L // pp) if L % pp == 0 else None
    best_time = slowest(*best) if best else math.inf
    for first in range(1, L):
        # pp == 2: the last stage takes the rest; else last = L - first - k * per, ascending as per descends
        for per in ((0,) if k == 0 else range((L - first - 1) // k, 0, -1)):
            t = slowest(first, per, L - first - k * per)
            if best is None or t < best_time - 1e-9:
                best, best_time = (first, per, L - first - k * per), t
    return None if best is None else (best[0], *([best[1]] * k), best[2])


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # word embeddings (padded vocab) + learned positions
    per_layer: int
    final_norm: int
    output_layer: int  # 0 when tied
    total: int


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_parallel: int
    padded_vocab_size: int
    num_microbatches: int
    tokens_per_step: int
    stage_layers: tuple[int, ...]  # transformer layers per pipeline rank (all its virtual chunks together)
    params: ParamCounts
    params_per_stage: tuple[int, ...]  # unsharded (before TP) parameters held by each pipeline stage
    flops_per_step: float


def rank_environment(cfg: RunConfig) -> dict[str, str]:
    """Environment variables a rank process needs before it starts CUDA (read at CUDA's start).

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP comm overlap (megatron's setting): with one
    hardware queue the GPU starts kernels in launch order across streams, so a backward
    all-reduce launched before the weight-gradient GEMMs gets its SMs and runs under them.
    TE's userbuffers (``parallel.te_userbuffers``) need it too, and ``UB_SKIPMC=1`` (CUDA IPC instead of NVLink
    multicast) where the launch keeps multicast off for NCCL (``NCCL_NVLS_ENABLE=0``): hosts that share their GPUs
    disable multicast, and TE's userbuffers would otherwise create multicast objects on their own.
    """
    import os

    p = cfg.parallel
    env: dict[str, str] = {}
    userbuffers = kernel_rule.choose(cfg).tp_overlap == "userbuffers"
    if p.device == "cuda" and p.tensor_parallel > 1 and (p.tp_comm_overlap or userbuffers):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if userbuffers and os.environ.get("NCCL_NVLS_ENABLE") == "0":
        env["UB_SKIPMC"] = "1"
    return env


def apply_rank_environment(cfg: RunConfig) -> dict[str, str]:
    """Set :func:`rank_environment` in this process where the launch did not set a value
    (called first thing by a rank, before anything starts CUDA).  Returns the values in force."""
    import os

    return {k: os.environ.setdefault(k, v) for k, v in rank_environment(cfg).items()}


def derive(cfg: RunConfig) -> Derived:
    """Everything computed from a config, in one place. Tolerant of invalid configs (no division by zero)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    lay = Layout.of(cfg)
    tp, pp, world, dp = lay.tp, lay.pp, lay.world, lay.dp
    vocab = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    micro = max(t.global_batch_size // max(t.micro_batch_size * dp, 1), 1)
    stage_layers = pipeline_stage_layers(cfg)
    params = ParamCounts(**family_of(cfg).shapes.param_counts(cfg, vocab))
    stages = []
    for s in range(pp):
        n = stage_layers[s] * params.per_layer
        if s == 0:
            n += params.embedding
        if s == pp - 1:
            n += params.final_norm + (params.output_layer if not m.tie_embeddings else (vocab * m.hidden_size if pp > 1 else 0))
        stages.append(n)
    return Derived(
        world_size=world,
        data_parallel=dp,
        padded_vocab_size=vocab,
        num_microbatches=micro,
        tokens_per_step=t.global_batch_size * m.seq_length,
        stage_layers=stage_layers,
        params=params,
        params_per_stage=tuple(stages),
        flops_per_step=megatron_flops_per_step(cfg),
    )


# --------------------------------------------------------------------------- validation


def validate(cfg: RunConfig, bad: set[str] | frozenset[str] = frozenset()) -> list[Problem]:
    """Every rule, every problem at once. Each names the field, the rule and a fix.

    First each field alone (:func:`workbench.config_fields.field_problems`: type, finite, range), then
    the rules between fields, on a copy with every invalid field at its default.  A rule that reads an
    invalid field (or one in ``bad``: what the caller reported already, e.g. a wrong type in a file) is
    skipped: its premise is wrong already, so only the root problem is reported.
    """
    P = field_problems(cfg)
    bad = set(bad) | {q.field for q in P}

    def run(c: RunConfig) -> list[tuple[Problem, tuple[str, ...] | None]]:
        found: list[tuple[Problem, tuple[str, ...] | None]] = []
        _rules(c, lambda f, r, x, *reads: found.append((Problem(f, r, x), None if reads == (None,) else reads)))
        return found

    found = run(at_defaults(cfg, bad) if bad else cfg)
    if bad and any(reads is None for _, reads in found):  # rules whose reads are not listed: kept when the same
        try:                                                 # with other stand-ins for the invalid fields
            again = {q for q, reads in run(at_defaults(cfg, bad, probe=True)) if reads is None}
            found = [(q, reads) for q, reads in found if reads is not None or q in again]
        except Exception:  # a stand-in a rule cannot take: the text check of reads_bad stays
            pass
    return P + [q for q, reads in found if not reads_bad(q, reads, bad)]


def _rules(cfg: RunConfig, add: Any) -> None:
    """The rules between fields: ``add(field, rule, fix, *reads)`` with the other fields (or sections)
    each reads; a family's rule or the kernel rule's, whose reads are not listed, passes ``None``."""
    m, p, t, d, c = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.checkpoint
    tp, pp, vpp = p.tensor_parallel, p.pipeline_parallel, p.vpp
    heads, groups = m.num_attention_heads, m.query_groups
    arch = "model.arch"

    # model
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

    # parallel
    world, lay = p.world_size, Layout.of(cfg)
    world_fields = ("parallel.nnodes", "parallel.nproc_per_node", "parallel.tensor_parallel", "parallel.pipeline_parallel")
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

    # train
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
    for field_name, rule, fix in (kernel_rule.fp8_problems(cfg) + kernel_rule.userbuffer_problems(cfg)) if known else ():
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

    # data
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

    # checkpoint
    if c.finetune and not c.load_dir:
        add("checkpoint.finetune", "finetune needs load_dir", "set checkpoint.load_dir", "checkpoint.load_dir")


# --------------------------------------------------------------------------- presets


#: every family's presets, by name (the families define them: ``workbench/families/<family>/``)
PRESETS: dict[str, Any] = {name: family for name, (family, _) in all_presets().items()}


def preset(name: str, **overrides: Any) -> RunConfig:
    """A fresh copy of a named preset, with optional dotted overrides."""
    if name not in PRESETS:
        raise ConfigError([Problem("preset", f"unknown preset '{name}'", did_you_mean(name, list(PRESETS)))])
    cfg = RunConfig.from_dict(copy.deepcopy(all_presets()[name][1]), source=f"preset {name}")
    return cfg.replace(**overrides) if overrides else cfg
