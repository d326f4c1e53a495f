"""What a model family is: what the rest of the workbench asks of ``model.arch``, in two folders.

A family has two sides.  Its **declaration** (:class:`Family`, ``workbench/families/<family>/__init__.py``)
is torch-free and stands below the config, so config validation, the planner and the widgets read it
in a notebook kernel: what it supports, its presets, its config rules, its shape terms.  Its **parts**
are the rank-side modules of ``workbench/models/<family>/``, one module a part, each imported where it
is first asked for (:class:`workbench.models.parts.FamilyParts`: the same for every family):

==============  =========================================================================
part (module)   what it holds (the protocol it answers)
==============  =========================================================================
``shapes``      parameter counts, Megatron FLOPs, the planner's per-stage memory terms
                (:class:`ShapesPart`; torch-free, on the declaration)
``model()``     ``build(cfg, pre_process, post_process, vp_stage, config)`` -> one model chunk
                (:class:`ModelPart`; torch + megatron-core)
``step()``      the default train step: ``forward_step``, ``loss``, ``logits_forward`` and the
                name of the main reported loss ``LOSS_NAME`` (:class:`StepPart`)
``data()``      ``build_datasets(cfg, run_dir, log)`` (:class:`DataPart`)
``hf()``        the Hugging Face adapter: configs, per-tensor rules, a logits check's inputs and
                reference (:class:`HfPart`; None: no HF types)
``generation()``  ``make_engine(...)``, this family's generation engine (:class:`GenerationPart`;
                module ``generate``; None: the family does not generate)
``monitor()``   ``step_monitor(cfg, chunks)``, a per-step monitor the trainer runs
                (:class:`MonitorPart`; module ``router_stats``; None: none)
==============  =========================================================================

The generic code asks :func:`workbench.families.family_of` for the declaration and
:func:`workbench.models.parts.parts_of` for the parts; the family's modules import the backend's
building blocks and their family's declaration, never the other way round.  Adding a family: a
folder ``workbench/families/<family>/`` whose ``__init__.py`` defines ``FAMILY``, one line in
:data:`workbench.families.FAMILIES`, and a folder ``workbench/models/<family>/`` with the part modules
(``model``, ``step``, ``data``; ``hf``, ``generate``, ``router_stats`` where it has them).  Nothing
outside the two folders branches on ``model.arch``.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

__all__ = ["Family", "Supports", "ShapesPart", "ModelPart", "StepPart", "DataPart", "HfPart", "GenerationPart",
           "MonitorPart", "PART_PROTOCOLS", "part_problems"]


@dataclass(frozen=True)
class Supports:
    """What a family can do (config validation and the widgets read this)."""

    pipeline: bool = True
    interleaved: bool = True
    sequence_parallel: bool = True
    generation: bool = False
    #: (HF ``model_type``, HF class) pairs its ``hf`` part converts
    hf_classes: tuple[tuple[str, str], ...] = ()
    #: (HF ``model_type``, why it is refused and what to use instead): HF types that look like
    #: this family's but are not converted (e.g. post-LN ``bert`` for the pre-LN BERT family)
    hf_refused: tuple[tuple[str, str], ...] = ()
    #: why the compiled dense layer (:class:`workbench.backend.compiled_layer.CompiledTransformerLayer`) cannot serve this family's
    #: layers, whatever the config (None: it can); read by :func:`workbench.kernel_rule.layer_blocker`
    compiled_layer_blocker: str | None = None
    #: why pipeline parallelism is refused (config validation says it with the field); "" -> a generic sentence
    pipeline_reason: str = ""
    #: whether ``attention_backend: auto`` may take Transformer Engine's layer for this family where the compiled
    #: layer does not apply, and whether that layer replays as megatron's CUDA graphs (T5 has a TE layer for an
    #: explicit ``te``, ungraphed: its cross-attention mask pair)
    transformer_engine: bool = True
    #: why TE's userbuffers (``parallel.te_userbuffers``) cannot serve this family's TE layer ("" -> they can);
    #: read by :func:`workbench.kernel_rule.userbuffer_problems`
    te_userbuffers_blocker: str = ""
    #: ``model.position_embedding`` values the family builds
    positions: tuple[str, ...] = ("learned", "rope", "alibi")
    #: ``model.activation`` values (MLP types) the family builds
    activations: tuple[str, ...] = ("gelu", "swiglu")
    #: whether ``model.num_labels`` > 0 (a sequence-classification head, trained on a labelled set) is built
    classification: bool = False
    #: whether ``model.moe.num_experts`` > 0 (mixture-of-experts layers, :mod:`workbench.families.common.moe`) builds
    moe: bool = False
    #: whether ``model.qk_layernorm`` (a norm of each query and key head) builds
    qk_layernorm: bool = False
    #: whether ``parallel.context_parallel`` > 1 trains (on the workbench attention's K/V ring,
    #: :mod:`workbench.backend.context_parallel`: causal, or bidirectional with a key-padding mask)
    context_parallel: bool = False
    #: whether the family's self-attention takes a key-padding mask (BERT): under context parallelism the ring's
    #: blocks then run the math kernel (the flash block kernel takes no mask; ``context_parallel._flash_ok``)
    key_padding: bool = False

    @property
    def hf_model_types(self) -> tuple[str, ...]:
        return tuple(mt for mt, _ in self.hf_classes)


def positions_rule(cfg: Any, n: int, max_new: int) -> list[tuple[str, str, str]]:
    """A decoder-only model's request: prompt and new tokens share the model's positions."""
    limit = cfg.model.max_position_embeddings
    if n > limit:
        return [("prompt", f"prompt is {n} tokens, longer than the model's {limit} positions", "shorten the prompt")]
    if n + max_new > limit:
        return [("generation.max_new_tokens", f"({n} tokens) + max_new_tokens {max_new} exceeds the model's {limit} positions",
                 f"use max_new_tokens <= {limit - n}")]
    return []


@dataclass(frozen=True)
class Family:
    """A family's torch-free declaration (see the module docstring)."""

    name: str
    title: str
    supports: Supports
    #: the torch-free shape terms (:class:`ShapesPart`)
    shapes: ShapesPart
    #: preset name -> nested dict of RunConfig sections (missing fields take the defaults)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: family-specific config rules: cfg -> [(field, rule, fix)]
    rules: Callable[[Any], list[tuple[str, str, str]]] = lambda cfg: []
    #: family-specific data checks a launcher runs before any process starts (light: tokenizer
    #: files, ``.idx`` headers and sidecars, never torch): cfg -> [(field, rule, fix)]
    data_rules: Callable[[Any], list[tuple[str, str, str]]] = lambda cfg: []
    #: length checks of one generation request: (cfg, prompt tokens, max_new_tokens) -> [(field, rule, fix)],
    #: field "prompt" (the generation front end names which) or "generation.max_new_tokens"
    generation_rules: Callable[[Any, int, int], list[tuple[str, str, str]]] = positions_rule
    #: the model-config fields only this family reads: a dataclass that :class:`workbench.config.ModelConfig`
    #: mounts (keys ``model.<field>``; a field's ``metadata["bound"]`` is its range,
    #: :class:`workbench.config_fields.Bound`); None: none
    model_fields: type | None = None
    #: the rules of this family's own fields that hold whatever the config's family (e.g. BERT's ``num_labels``
    #: where the config's family has no classification head): (cfg, the config's family's Supports) ->
    #: [(field, rule, fix, *fields it reads)]
    field_rules: Callable[[Any, Supports], list[tuple[str, ...]]] = lambda cfg, supports: []
    #: megatron ``TransformerConfig`` fields of this family's layers beyond the generic ones (GPT: the MoE
    #: fields, :func:`workbench.families.common.moe.transformer_fields`): (cfg, the kernel rule's choice) -> dict
    transformer_fields: Callable[[Any, Any], dict] = lambda cfg, choice: {}
    #: what a run's saved ``model`` section makes of the family, in a word or two after its name (GPT: "moe" with
    #: experts; BERT: "classifier" with a classification head); read from plain dicts (a run directory's
    #: ``config.json``, any version): model section -> words, "" for the plain family
    variant: Callable[[Mapping[str, Any]], str] = lambda model: ""

    def label(self, model: Mapping[str, Any]) -> str:
        """The family's name and :attr:`variant` of a saved ``model`` section (the run browser's family column)."""
        extra = self.variant(model)
        return f"{self.name} {extra}" if extra else self.name

    @property
    def fields(self) -> tuple[str, ...]:
        """The dotted config fields only this family reads (its :attr:`model_fields`): the config form shows
        them only while ``model.arch`` names this family."""
        return tuple(f"model.{f.name}" for f in dataclasses.fields(self.model_fields)) if self.model_fields else ()


# --------------------------------------------------------------------------- the parts and their protocols


@runtime_checkable
class ShapesPart(Protocol):
    """Parameter counts, Megatron FLOPs and the planner's per-stage memory terms (torch-free)."""

    def param_counts(self, cfg: Any, padded_vocab: int) -> dict[str, int]: ...
    def layer_and_head_flops(self, cfg: Any, padded_vocab: int) -> tuple[float, float]: ...
    def shape(self, cfg: Any, d: Any, micro_batch: int | None = None) -> Any: ...
    def stage_params(self, cfg: Any, sh: Any, d: Any) -> list[dict[str, int]]: ...
    def layer_activation_terms(self, sh: Any, kp: Any) -> dict[str, float]: ...
    def layer_backward_transient(self, sh: Any, kp: Any, assumptions: Any) -> float: ...
    def logits_bytes(self, sh: Any, kp: Any) -> tuple[float, float]: ...


@runtime_checkable
class ModelPart(Protocol):
    """The family's megatron-core model: one chunk of a (virtual) pipeline stage."""

    def build(self, cfg: Any, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
              config: Any = None) -> Any: ...


@runtime_checkable
class StepPart(Protocol):
    """The family's default train step: the forward of one micro-batch, its loss, one chunk's forward for
    logits (conversion's verify), and the report key of the main loss (the trainer's ``loss``)."""

    LOSS_NAME: str

    def forward_step(self, batch: Any, model: Any, return_logits: bool = False) -> Any: ...
    def loss(self, batch: Any, output: Any) -> tuple[Any, Any, dict]: ...
    def logits_forward(self, chunk: Any, inputs: dict) -> Any: ...


@runtime_checkable
class DataPart(Protocol):
    """The family's datasets: ``(train, valid, description)`` for the config's data source."""

    def build_datasets(self, cfg: Any, run_dir: Any, log: Any = print) -> tuple[Any, Any, str]: ...


@runtime_checkable
class HfPart(Protocol):
    """The Hugging Face adapter of the family's ``Supports.hf_classes``."""

    def model_fields(self, hf: dict, m: dict) -> None: ...
    def infer_model_type(self, m: Any) -> str: ...
    def hf_config_dict_from_run(self, cfg: Any, model_type: str, hf_extra: dict | None = None,
                                dtype: str = "float32") -> dict: ...
    def hf_to_mcore_rules(self, infos: Mapping[str, Any], cfg: Any, model_type: str) -> list: ...
    def mcore_to_hf_rules(self, infos: Mapping[str, Any], cfg: Any, model_type: str, read: Any = None) -> list: ...
    def make_random_hf_model(self, out: Any, model_type: str) -> Any: ...
    def verify_inputs(self, vocab: int, batch_size: int, seq_length: int, seed: int = 0) -> dict: ...
    def hf_logits(self, hf_dir: Any, inputs: dict) -> tuple[Any, Any]: ...


@runtime_checkable
class GenerationPart(Protocol):
    """The family's generation engine over one rank's model stage (``generate(prompt_ids, gen, ...)``)."""

    def make_engine(self, model: Any, cfg: Any, tokenizer: Any, ids: dict, cuda_graphs: bool | str = "auto") -> Any: ...


@runtime_checkable
class MonitorPart(Protocol):
    """A per-step monitor of the family's model (``after_step(iteration, num_microbatches)`` -> records), or None."""

    def step_monitor(self, cfg: Any, chunks: list) -> Any: ...


#: each part accessor of :class:`workbench.models.parts.FamilyParts` and the protocol its part answers
PART_PROTOCOLS: dict[str, type] = {"model": ModelPart, "step": StepPart, "data": DataPart, "hf": HfPart,
                                   "generation": GenerationPart, "monitor": MonitorPart}


def part_problems(part: Any, protocol: type) -> list[str]:
    """What ``part`` (a module or object) lacks of ``protocol``: each member missing, a constant of the wrong
    type, a function that is not callable or does not take the protocol's call (its required parameters by
    position, those with a default by name).  Empty: it answers."""
    out: list[str] = []
    for name, tp in getattr(protocol, "__annotations__", {}).items():
        value = getattr(part, name, None)
        if not isinstance(value, {"str": str, "int": int, "bool": bool}.get(tp, object)) or value is None:
            out.append(f"{name}: a {tp} constant is missing")
    for name, member in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        fn = getattr(part, name, None)
        if not callable(fn):
            out.append(f"{name}(): missing")
            continue
        want = list(inspect.signature(member).parameters.values())[1:]  # after self
        positional = [object() for p in want if p.default is p.empty]  # required: passed by position
        named = {p.name: object() for p in want if p.default is not p.empty}  # with a default: passed by name
        try:
            inspect.signature(fn).bind(*positional, **named)
        except TypeError as e:
            out.append(f"{name}(): does not take the call {name}({', '.join(p.name for p in want)}): {e}")
    return out
