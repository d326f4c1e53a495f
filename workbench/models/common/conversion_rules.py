"""Conversion as a list of per-tensor rules: which target tensors are made from which source tensors, and how.

A family's ``hf`` adapter describes a conversion as :class:`Rule` s (``hf_to_mcore_rules`` / ``mcore_to_hf_rules``):
each names its source tensors, its target tensors and a pure-torch function from the one to the other (the QKV
interleave, a transpose, a ``cat`` of gate and up, vocab padding).  The rules are planned from tensor names and
shapes alone (:class:`TensorInfo`, read from file headers), so a missing tensor or a wrong vocabulary is refused
before any data is read, and every target's shape and dtype is known before it is computed (what a streaming
writer needs for its headers).  The same rules run on a whole in-memory state dict (:func:`run_rules`, the
adapters' ``hf_to_mcore`` / ``mcore_to_hf``) or one rule at a time over files (:func:`stream_rules`), so both
paths give bit-identical tensors.  Bad input is a :class:`ConversionError`, which the conversion tools raise too.

It stands below the adapters written in it (``workbench/models/<family>/hf.py``) and the conversion tools
(:mod:`workbench.conversion`) that run them.  Pure torch, imported where it is used: no megatron import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = ["ConversionError", "TensorInfo", "Rule", "copy_rule", "infos_of", "need", "need_vocab", "check_sources",
           "plan_targets", "run_rules", "stream_rules", "strip_module_prefix", "pad_vocab_rows", "qkv_to_mcore",
           "qkv_from_mcore"]


class ConversionError(ValueError):
    """Bad conversion input: the message names the file / field and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's shape and dtype, known without its data."""

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype

    @property
    def nbytes(self) -> int:
        import torch

        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Rule:
    """``targets`` made from ``sources``: ``fn(*source_tensors)`` returns one tensor (one target) or a tuple in
    the order of ``targets``.  ``fn`` depends on the sources' shapes only for its shapes (it runs on meta tensors
    to plan them)."""

    targets: tuple[str, ...]
    sources: tuple[str, ...]
    fn: Callable[..., Any]


def _identity(t: Any) -> Any:
    return t


def copy_rule(target: str, source: str) -> Rule:
    """``target`` is ``source`` unchanged."""
    return Rule((target,), (source,), _identity)


def strip_module_prefix(name: str) -> str:
    """A state-dict name without a DDP ``module.`` prefix (how every HF reader here names tensors)."""
    return re.sub(r"^(module\.)", "", name)


def infos_of(sd: Mapping[str, Any]) -> dict[str, TensorInfo]:
    """:class:`TensorInfo` of every tensor of an in-memory state dict (``module.`` prefixes stripped)."""
    return {strip_module_prefix(k): TensorInfo(tuple(v.shape), v.dtype) for k, v in sd.items() if hasattr(v, "shape")}


def _missing(key: str, src: str) -> Exception:
    return ConversionError(f"{src}: tensor {key!r} is missing -> is this a complete {src} checkpoint of the configured architecture?")


def need(infos: Mapping[str, TensorInfo], key: str, src: str) -> TensorInfo:
    """The info of ``key``, or the ConversionError naming the missing tensor (what a rule planner calls)."""
    if key not in infos:
        raise _missing(key, src)
    return infos[key]


def need_vocab(infos: Mapping[str, TensorInfo], key: str, src: str, vocab_size: int) -> TensorInfo:
    """:func:`need` a vocabulary-indexed tensor (word embeddings, an output head), refusing one whose row count
    is not the config's ``vocab_size``."""
    info = need(infos, key, src)
    if info.shape[0] != vocab_size:
        name = key.split(".")[-2] if "." in key else key
        raise ConversionError(f"{src}: {name} has {info.shape[0]} rows but config vocab_size is {vocab_size}")
    return info


def check_sources(rules: Sequence[Rule], infos: Mapping[str, TensorInfo], src: str) -> None:
    """Refuse (ConversionError) the first source tensor, in rule order, that ``infos`` does not hold."""
    for r in rules:
        for s in r.sources:
            if s not in infos:
                raise _missing(s, src)


def _as_tuple(out: Any, rule: Rule) -> tuple:
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(rule.targets):
        raise ValueError(f"rule for {rule.targets} returned {len(outs)} tensors")
    return outs


def plan_targets(rules: Sequence[Rule], infos: Mapping[str, TensorInfo], dtype: Any = None) -> dict[str, TensorInfo]:
    """Shape and dtype of every target, in rule order, from the sources' infos alone (each rule runs on meta
    tensors); ``dtype``: the targets' cast."""
    import torch

    out: dict[str, TensorInfo] = {}
    for r in rules:
        metas = [torch.empty(infos[s].shape, dtype=infos[s].dtype, device="meta") for s in r.sources]
        for name, t in zip(r.targets, _as_tuple(r.fn(*metas), r)):
            if name in out:
                raise ValueError(f"two rules make {name!r}")
            out[name] = TensorInfo(tuple(t.shape), dtype if dtype is not None else t.dtype)
    return out


def _finish(t: Any, dtype: Any) -> Any:
    return (t.to(dtype) if dtype is not None else t).contiguous()


def run_rules(rules: Sequence[Rule], sd: Mapping[str, Any], dtype: Any = None,
              progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Every target of ``rules`` from an in-memory state dict ``sd`` (already checked by :func:`check_sources`)."""
    out: dict[str, Any] = {}
    for r in (progress or _identity)(rules):
        for name, t in zip(r.targets, _as_tuple(r.fn(*[sd[s] for s in r.sources]), r)):
            out[name] = _finish(t, dtype)
    return out


def stream_rules(rules: Sequence[Rule], read: Callable[[str], Any], write: Callable[[str, Any], None], dtype: Any = None,
                 progress: Callable[[Iterable], Iterable] | None = None) -> None:
    """Run ``rules`` one at a time: read its sources (``read(name)``), make its targets, hand each to
    ``write(name, tensor)``, and let go of all of them before the next rule; memory is bounded by one rule's
    tensors, not the model.

    The next rule's sources are read on a second thread while this rule's targets are made and
    written (file reads, hashing and file writes run without the GIL), so reading and writing overlap as a copy's
    do; memory holds at most one more rule's sources.  Every ``read`` runs on that thread, in rule order.  The
    cyclic garbage collector waits until the last rule is written.  A rule never writes into its sources: a source
    may be the reader's own buffer, still being hashed (:func:`workbench.checkpoint.dcp._load_chunk`)."""
    import gc

    rules = list(rules)
    was_on = gc.isenabled()
    gc.disable()  # tensors go by reference counts; a collection would walk every object the imports made, often
    try:
        _stream(rules, read, write, dtype, progress)
    finally:
        if was_on:
            gc.enable()


def _stream(rules: list[Rule], read: Callable[[str], Any], write: Callable[[str, Any], None], dtype: Any,
            progress: Callable[[Iterable], Iterable] | None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def fetch(r: Rule) -> list[Any]:
        return [read(s) for s in r.sources]

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-convert-read")
    try:
        nxt = pool.submit(fetch, rules[0]) if rules else None
        for i, r in enumerate((progress or _identity)(rules)):
            sources = nxt.result()
            nxt = pool.submit(fetch, rules[i + 1]) if i + 1 < len(rules) else None
            outs = _as_tuple(r.fn(*sources), r)
            del sources
            for name, t in zip(r.targets, outs):
                write(name, _finish(t, dtype))
            del outs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- tensor layouts


def pad_vocab_rows(t: Any, padded: int, real: int | None = None) -> Any:
    """Resize the vocab dim of ``[rows, h]`` to ``padded`` rows.

    Existing rows are kept (cut when shrinking, never below ``real``); new rows are the
    mean of the ``real`` vocabulary rows (all rows when ``real`` is None).
    """
    import torch

    v = t.shape[0]
    real = v if real is None else real
    if padded < real:
        raise ConversionError(f"cannot pad a vocabulary of {real} rows to {padded}")
    if padded == v:
        return t
    if padded < v:
        return t[:padded].clone()
    fill = t[:real].float().mean(dim=0, keepdim=True).to(t.dtype).expand(padded - v, *t.shape[1:])
    return torch.cat([t, fill], dim=0)


def qkv_to_mcore(q: Any, k: Any, v: Any, heads: int, groups: int, d: int) -> Any:
    import torch

    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()


def qkv_from_mcore(qkv: Any, heads: int, groups: int, d: int) -> tuple[Any, Any, Any]:
    tail = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *tail)
    q = x[:, : per * d].reshape(heads * d, *tail).contiguous()
    k = x[:, per * d: (per + 1) * d].reshape(groups * d, *tail).contiguous()
    v = x[:, (per + 1) * d:].reshape(groups * d, *tail).contiguous()
    return q, k, v
