"""What each config field may hold on its own: its type, a finite number, its range.

:func:`field_problems` walks a config's dataclasses (``workbench.config``) by their type hints and
checks every field alone: the type (a bool is not an integer, a string is not a number), that a
float is finite (``.nan`` and ``.inf`` are refused everywhere), the field's :class:`Bound` from
:data:`BOUNDS`, and that a switch turned on finds the package it needs (:data:`NEEDS_PACKAGE`).  The
upper bounds are beyond any real model or machine, and say so: they stop an absurd value
(``num_layers: 1e9``) before a rule or the planner computes with it.  Rules between
fields (divisibility, one field against another) are ``workbench.config.validate``'s, and a rule
that reads a field found invalid here is skipped there: only the root problem is reported.

:class:`Problem` and :class:`ConfigError` live here so this module needs nothing of the config's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.machinery
import importlib.util
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args, get_origin, get_type_hints

from workbench.config_text import MAX_VALUES

__all__ = ["Problem", "ConfigError", "Bound", "BOUNDS", "NEEDS_PACKAGE", "LAYERS", "ITERS", "SEQ_WHY", "bounded", "field_problems", "plain_data_problem", "LARGEST_ACCELERATOR_BYTES",
           "at_defaults", "reads_bad", "touches", "module_exists"]


@dataclass(frozen=True)
class Problem:
    """One validation failure: which field, which rule, and how to fix it."""

    field: str
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.rule} -> {self.fix}"


class ConfigError(ValueError):
    """Raised with every problem of a config (or file) at once."""

    def __init__(self, problems: list[Problem], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        head = f"invalid config{f' {source}' if source else ''} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


#: the most memory one accelerator has today (NVIDIA B300, AMD MI355X: 288 GB): the weights one
#: model-parallel rank holds must fit in it, whatever else the planner finds
LARGEST_ACCELERATOR_BYTES = 288 * 10**9


@dataclass(frozen=True)
class Bound:
    """A field's range: ``lo`` / ``hi`` (None: unbounded), ``*_open`` excludes the end; ``why``
    says where an upper bound comes from (a bound beyond any real model, reported apart from the
    lower one); ``fix`` replaces the default advice."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""
    fix: str = ""

    def problem(self, path: str, value: float) -> Problem | None:
        short = path.rsplit(".", 1)[-1]
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not (low or high):
            return None
        if high and self.why:
            return Problem(path, f"{value} is beyond any real model or machine: at most {self.hi} ({self.why})",
                           self.fix or f"use a {short} of at most {self.hi}")
        if self.lo is not None and self.hi is not None and not self.why:
            span = f"{'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
            return Problem(path, f"must be in {span} (got {value})", self.fix or f"use a {short} in {span}")
        if high:
            return Problem(path, f"must be {'<' if self.hi_open else '<='} {self.hi} (got {value})", self.fix or f"use at most {self.hi}")
        if self.lo == 1 and not self.lo_open:
            return Problem(path, f"must be >= 1 (got {value})", self.fix or f"set {short} to a positive integer")
        return Problem(path, f"must be {'>' if self.lo_open else '>='} {self.lo} (got {value})",
                       self.fix or f"use a {short} {'above' if self.lo_open else 'of at least'} {self.lo}")


def bounded(default: Any, lo: float | None = None, hi: float | None = None, **kwargs: Any) -> Any:
    """A dataclass field with ``default`` whose range (``metadata["bound"]``) is ``Bound(lo, hi, **kwargs)``: how a
    model family's own fields (:attr:`workbench.families.Family.model_fields`) carry their bounds."""
    return dataclasses.field(default=default, metadata={"bound": Bound(lo, hi, **kwargs)})


LAYERS = Bound(1, 1024, why="the deepest trained transformers have ~100-200 layers")
ITERS = 10**9
SEQ_WHY = "one context-parallel group holds a whole sequence (parallel.context_parallel splits it), and no group of accelerators holds more"

#: every numeric field's range, by dotted path (a list's entries share one: ``data.datasets.weight``); a model
#: family's own fields carry theirs in their dataclass field's ``metadata["bound"]`` (:attr:`workbench.families.Family.model_fields`)
BOUNDS: dict[str, Bound] = {
    "model.num_layers": LAYERS,
    "model.hidden_size": Bound(1, 131072, why="the widest trained transformers have hidden sizes of ~25k"),
    "model.num_attention_heads": Bound(1, 4096, why="trained transformers have at most a few hundred heads"),
    "model.num_query_groups": Bound(1, 4096, why="trained transformers have at most a few hundred heads", fix="use a divisor of num_attention_heads, or null"),
    "model.ffn_hidden_size": Bound(1, 1 << 20, why="the widest trained MLPs are ~100k", fix="use e.g. 4 * hidden_size, or null for the default"),
    "model.kv_channels": Bound(1, 16384, why="trained heads are 64-256 wide", fix="use e.g. hidden_size / num_attention_heads, or null"),
    "model.vocab_size": Bound(1, 1 << 24, why="the largest tokenizers have ~1M tokens"),
    "model.make_vocab_size_divisible_by": Bound(1, 1 << 16, why="megatron pads by 128"),
    "model.max_position_embeddings": Bound(1, 1 << 24, why="the longest trained contexts are ~10M positions"),
    "model.seq_length": Bound(1, 1 << 20, why=SEQ_WHY),
    "model.rotary_base": Bound(0, lo_open=True, fix="use 10000 (GPT-NeoX, Llama 2) or 500000 (Llama 3)"),
    "model.rotary_percent": Bound(0, 1, lo_open=True, fix="use 1.0"),
    "model.norm_epsilon": Bound(0, 1, lo_open=True, fix="use 1e-5"),
    "model.hidden_dropout": Bound(0, 1, hi_open=True, fix="use e.g. 0.1, or 0 to disable"),
    "model.attention_dropout": Bound(0, 1, hi_open=True, fix="use e.g. 0.1, or 0 to disable"),
    "model.init_method_std": Bound(0, fix="use 0.02"),
    "parallel.expert_parallel": Bound(1, 4096, why="experts are split over at most a few hundred ranks"),
    "parallel.expert_tensor_parallel": Bound(1, 1024, why="tensor parallelism spans one node's GPUs, at most a rack's",
                                             fix="use null (= tensor_parallel) or 1"),
    "parallel.tensor_parallel": Bound(1, 1024, why="tensor parallelism spans one node's GPUs, at most a rack's"),
    "parallel.pipeline_parallel": Bound(1, LAYERS.hi, why="a stage holds at least one layer"),
    "parallel.context_parallel": Bound(1, 1024, why="a rank holds at least two chunks of the sequence"),
    "parallel.virtual_pipeline_parallel": Bound(1, LAYERS.hi, why="a chunk holds at least one layer",
                                                fix="use null to disable interleaving"),
    "parallel.recompute_num_layers": Bound(1, LAYERS.hi, why=LAYERS.why, fix="use 1"),
    "parallel.nnodes": Bound(1, 1 << 17, why="the largest clusters have ~100k accelerators"),
    "parallel.nproc_per_node": Bound(1, 256, why="no node has more accelerators"),
    "train.micro_batch_size": Bound(1, 1 << 16, why="no accelerator holds more sequences at once"),
    "train.global_batch_size": Bound(1, 1 << 24, why="the largest trained batches are ~10k sequences"),
    "train.train_iters": Bound(1, ITERS, why="a billion steps"),
    "train.lr": Bound(0, lo_open=True, fix="use e.g. 3e-4"),
    "train.min_lr": Bound(0, fix="use e.g. lr / 10, or 0"),
    "train.lr_warmup_iters": Bound(0, ITERS, why="a billion steps", fix="use 0 or a few percent of train_iters"),
    "train.lr_decay_iters": Bound(1, ITERS, why="a billion steps", fix="use null (decay over train_iters) or a positive number"),
    "train.weight_decay": Bound(0, fix="use 0.1 or 0"),
    "train.adam_beta1": Bound(0, 1, hi_open=True, fix="use 0.9"),
    "train.adam_beta2": Bound(0, 1, hi_open=True, fix="use 0.95"),
    "train.adam_eps": Bound(0, lo_open=True, fix="use 1e-8"),
    "train.clip_grad": Bound(0, fix="use 1.0, or 0 to disable"),
    "train.loss_scale": Bound(0, lo_open=True, fix="use null (dynamic loss scaling) or a power of two such as 65536"),
    "train.seed": Bound(0, 2**32 - 1, fix="use a seed in [0, 4294967295] (numpy's range)"),
    "train.eval_interval": Bound(0, ITERS, why="a billion steps", fix="use 0 to disable evaluation"),
    "train.eval_iters": Bound(0, ITERS, why="a billion steps", fix="use e.g. 10"),
    "train.log_interval": Bound(1, ITERS, why="a billion steps"),
    "train.microbatch_timing_interval": Bound(0, ITERS, why="a billion steps", fix="use 0 to disable"),
    "train.peak_tflops": Bound(0, lo_open=True, fix="use null to look the GPU up"),
    "data.datasets.weight": Bound(0, lo_open=True, fix="use a positive weight"),
    "data.num_workers": Bound(0, 256, why="no node has that many cores to spare", fix="use 0 or a few workers"),
    "checkpoint.save_interval": Bound(0, ITERS, why="a billion steps", fix="use 0 to save only at the end"),
}

#: a switch that, when on, needs a package the workbench does not install by default: path -> (module, fix); the
#: module is looked for on disk (:func:`module_exists`), never imported
NEEDS_PACKAGE: dict[str, tuple[str, str]] = {
    "train.tensorboard": ("tensorboard", "pip install tensorboard (or the workbench's [tensorboard] extra), or set tensorboard: false"),
}


def plain_data_problem(value: Any, path: str, budget: int = MAX_VALUES) -> Problem | None:
    """A problem when ``value`` is not plain JSON data (mappings with string keys, lists, strings,
    booleans, integers, finite floats, null) of at most ``budget`` values; shared references are
    counted each time they appear, so nothing is expanded beyond the budget."""
    count = 0
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        v, where, depth = stack.pop()
        count += 1
        if count > budget or depth > 64:
            return Problem(path, f"holds more than {budget} values or is nested more than 64 deep (a shared or recursive "
                                 "structure expands without bound)", "pass a small mapping of plain values")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    return Problem(f"{where}[{k!r}]", f"key {k!r} is not a string", "use string keys")
                stack.append((x, f"{where}.{k}", depth + 1))
        elif isinstance(v, (list, tuple)):
            stack.extend((x, f"{where}[{i}]", depth + 1) for i, x in enumerate(v))
        elif isinstance(v, float) and not math.isfinite(v):
            return Problem(where, f"must be a finite number (got {v})", "use a finite number")
        elif v is not None and not isinstance(v, (str, bool, int, float)):
            return Problem(where, f"{type(v).__name__} is not plain data", "use strings, numbers, booleans, lists and mappings")
    return None


@functools.lru_cache(maxsize=None)
def _checker(tp: Any) -> Callable[[Any, str], Problem | None]:
    """The check of type hint ``tp``: ``check(value, path)`` is a problem when ``value`` is not of that type."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return lambda v, path: None if v in args else Problem(path, f"must be one of {', '.join(map(repr, args))}, got {v!r}", f"pick one of {list(args)}")
    if len(args) > 1 and type(None) in args:  # X | None
        inner = _checker(next(a for a in args if a is not type(None)))
        return lambda v, path: None if v is None else inner(v, path)
    if origin is dict:
        return lambda v, path: (plain_data_problem(v, path) if isinstance(v, dict) else
                                Problem(path, f"expected a mapping, got {v!r}", "write it as a mapping of names to values"))
    if tp is bool:
        return lambda v, path: None if isinstance(v, bool) else Problem(path, f"expected true/false, got {v!r}", "use true or false")
    if tp is int:
        return lambda v, path: (None if isinstance(v, int) and not isinstance(v, bool) else
                                Problem(path, f"expected an integer, got {v!r}", "use a whole number"))
    if tp is float:
        def number(v: Any, path: str) -> Problem | None:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                return Problem(path, f"expected a number, got {v!r}", "use a number such as 3e-4")
            return None if math.isfinite(v) else Problem(path, f"must be a finite number (got {v})", "use a finite number")
        return number
    if tp is str:
        return lambda v, path: None if isinstance(v, str) else Problem(path, f"expected a string, got {v!r}", "quote the value")
    return lambda v, path: None


@functools.lru_cache(maxsize=None)
def _layout(cls: type, prefix: str) -> tuple[tuple[str, str, Any, str, Bound | None], ...]:
    """Per field of dataclass ``cls`` at ``prefix``: (name, dotted path, type, kind, bound); kind is
    "section" (a nested dataclass), "entries" (a list of dataclasses; type: the entries') or "value"
    (type: its :func:`_checker`)."""
    hints = get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}.{f.name}" if prefix else f.name
        entries = get_origin(tp) is list and bool(get_args(tp)) and dataclasses.is_dataclass(get_args(tp)[0])
        kind = "section" if dataclasses.is_dataclass(tp) else "entries" if entries else "value"
        bound = BOUNDS.get(path) or f.metadata.get("bound")
        out.append((f.name, path, get_args(tp)[0] if entries else tp if kind == "section" else _checker(tp), kind, bound))
    return tuple(out)


def field_problems(obj: Any, prefix: str = "", bounds_path: str | None = None) -> list[Problem]:
    """Every field of the dataclass ``obj`` (and its nested sections and list entries) checked alone:
    type, finite, :data:`BOUNDS`.  ``prefix``: the dotted path of ``obj`` ("" for a run config);
    ``bounds_path``: where its bounds are in :data:`BOUNDS` when that differs (a list entry's index left out)."""
    out: list[Problem] = []
    for name, path, tp, kind, bound in _layout(type(obj), prefix if bounds_path is None else bounds_path):
        value = getattr(obj, name)
        where = path if bounds_path is None else f"{prefix}.{name}"
        if kind == "section":
            out += field_problems(value, where) if isinstance(value, tp) else [Problem(where, f"expected a mapping, got {value!r}", "check the nesting")]
        elif kind == "entries":
            if not isinstance(value, list):
                out.append(Problem(where, f"expected a list, got {value!r}", "write it as a list"))
                continue
            for i, entry in enumerate(value):
                ok = isinstance(entry, tp)
                out += field_problems(entry, f"{where}[{i}]", path) if ok else [Problem(f"{where}[{i}]", f"expected a mapping, got {entry!r}", "check the nesting")]
        else:
            problem = tp(value, where)
            if problem is None and bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                problem = bound.problem(where, value)
            if problem is None and value is True and path in NEEDS_PACKAGE and not module_exists(NEEDS_PACKAGE[path][0]):
                problem = Problem(where, f"needs the {NEEDS_PACKAGE[path][0]} package, which is not importable here", NEEDS_PACKAGE[path][1])
            if problem is None and where == "name" and (not value or len(value) > 200 or not value.isprintable()):
                problem = Problem(where, f"{value!r} is not a name: 1-200 printable characters", "use a short name such as 'gpt2-small'")
            if problem is not None:
                out.append(problem)
    return out


# --------------------------------------------------------------------------- rules that read an invalid field


def touches(name: str, bad: set[str]) -> bool:
    """Whether field (or section) ``name`` is, holds or lies inside a field of ``bad``."""
    return any(b == name or b.startswith((name + ".", name + "[")) or name.startswith((b + ".", b + "[")) for b in bad)


def reads_bad(q: Problem, reads: tuple[str, ...] | None, bad: set[str]) -> bool:
    """Whether a rule's problem depends on an invalid field: its field or what it reads (``reads``;
    None for a family's or the kernel rule's, where the rule's text naming an invalid field counts)."""
    if not bad:
        return False
    if touches(q.field, bad) or any(touches(r, bad) for r in reads or ()):
        return True
    if reads is None:
        names = {re.split(r"[.\[]", b.rsplit(".", 1)[-1])[0] for b in bad}
        return any(re.search(rf"\b{re.escape(n)}\b", q.rule) for n in names if n)
    return False


def at_defaults(cfg: Any, bad: set[str], probe: bool = False) -> Any:
    """A copy of ``cfg`` with each field named in ``bad`` (dotted, ``[i]`` for list entries) at its default;
    ``probe``: at another valid stand-in where one is obvious (integers doubled, floats halved, booleans flipped), so that a
    rule whose problem changes with the stand-in is known to depend on the field."""
    fixed = copy.deepcopy(cfg)
    for path in bad:
        parts = re.findall(r"\[\d+\]|[^.\[\]]+", path)
        try:
            obj = fixed
            for part in parts[:-1]:
                obj = obj[int(part[1:-1])] if part.startswith("[") else getattr(obj, part)
            f = {x.name: x for x in dataclasses.fields(obj)}[parts[-1]]
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            continue  # not a field (an unknown key, the file itself)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if probe:
                v = (not v) if isinstance(v, bool) else (2 * v or 1) if isinstance(v, int) else (v / 2 or 0.5) if isinstance(v, float) else v
            setattr(obj, f.name, v)
    return fixed


# --------------------------------------------------------------------------- a hook's module, found without importing it


def module_exists(name: str) -> bool:
    """Whether an import of the dotted module ``name`` would find it, decided without importing anything.

    A module already imported counts (``sys.modules``).  Otherwise the search starts from the deepest
    package of ``name`` already imported (its ``__path__``), else from the top-level name's location as the
    import system's finders report it (a top-level look-up imports nothing: there is no parent to run), and
    goes down on disk: each package below is a directory there (regular or namespace), and the module is
    ``<name><suffix>`` or ``<name>/__init__<suffix>`` for a module suffix of this interpreter (``.py``,
    ``.pyc``, extension modules).  No package's ``__init__`` runs (``importlib.util.find_spec`` of a dotted
    name would import every parent package first)."""
    parts = name.split(".")
    if not name or not all(p.isidentifier() for p in parts):
        return False
    if sys.modules.get(name) is not None:
        return True
    locations: list[str] | None = None
    rest: list[str] = []
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is not None:
            path = getattr(mod, "__path__", None)
            if path is None:
                return False  # a module, not a package: it has no submodules
            locations, rest = [str(x) for x in path], parts[i:]
            break
    if locations is None:
        try:
            spec = importlib.util.find_spec(parts[0])  # top-level: nothing is imported to find it
        except (ImportError, ValueError):
            return False
        if spec is None:
            return False
        if len(parts) == 1:
            return True
        if spec.submodule_search_locations is None:
            return False
        locations, rest = [str(x) for x in spec.submodule_search_locations], parts[1:]
    for part in rest[:-1]:
        locations = [os.path.join(d, part) for d in locations if os.path.isdir(os.path.join(d, part))]
    last = rest[-1]
    suffixes = importlib.machinery.all_suffixes()
    return any(os.path.isfile(os.path.join(d, last + sfx)) or os.path.isfile(os.path.join(d, last, "__init__" + sfx))
               for d in locations for sfx in suffixes)
