"""megatron-core's fusions compiled at their first call, not at its import.

megatron-core decorates its fused element-wise functions (bias + GELU / SwiGLU / GEGLU, bias-dropout-add, rotary,
...) with ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on current torch.  ``torch.compile`` does
nothing but wrap a function until its first call, yet applying it imports torch's whole compiler stack (dynamo and
inductor's ``compile_fx``): measured on a 2-core machine, ``import workbench.rank.train`` took 13.6 s of CPU, 6.4-7.2 s
with the fusers deferred and the compiled layer's ``torch.compiler.disable`` applied at its first compile
(:data:`IMPORT_CPU_S`).  Every rank, generation, conversion-check and calibration process
pays that at start, most of them never running a single fusion (the compiled layer replaces megatron's fused
element-wise paths on GPUs; CPU runs keep them off).

:func:`install` (run by ``workbench/__init__.py`` before anything can import megatron-core; torch-free) puts a
finder in front of Python's import system for the modules of :data:`_MODULES` alone: each runs with ``torch.compile``
being :func:`lazy_compile`, so ``megatron.core.jit`` binds ``jit_fuser`` to it (and every fusion module that imports
it after gets the deferred one) and the router's decorated method is deferred too.  :func:`lazy_compile` makes the
same ``torch.compile(fn, **options)`` at the function's first eager call and calls it; inside another compiled region
(``torch.compiler.is_compiling()``) it calls the plain function, which dynamo then traces inline, as it does a
``torch.compile``'d function there.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from typing import Any, Callable

__all__ = ["install", "lazy_compile", "IMPORT_CPU_S"]

#: CPU seconds (user + sys) of ``import workbench.rank.train`` on the 2-core development machine, megatron's fusers
#: compiled at import vs deferred (2026-12-02, torch 2.14, megatron-core 0.19.2; the suite's processes ran beside it)
IMPORT_CPU_S = {"at_import": 13.6, "deferred": 6.8}

#: megatron-core's modules that apply ``torch.compile`` when imported: its ``jit_fuser`` (bound to it, then applied
#: by every fusion module), and the router's inference method (decorated; imported by the pipeline schedules)
_MODULES = ("megatron.core.jit", "megatron.core.transformer.moe.router")

#: torch's own ``torch.compile`` (what :func:`lazy_compile` calls)
_REAL: dict[str, Callable] = {}


def lazy_compile(model: Callable | None = None, **options: Any) -> Any:
    """``torch.compile(model, **options)``, made at the first call outside a compiled region (a decorator with or
    without options, like ``torch.compile``)."""
    if model is None:
        return functools.partial(lazy_compile, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        import torch

        if torch.compiler.is_compiling():
            return model(*args, **kwargs)
        if compiled is None:
            compiled = _REAL.get("compile", torch.compile)(model, **options)
        return compiled(*args, **kwargs)

    call.__wrapped_lazily__ = model  # (what tests and debugging look for)
    return call


class _DeferFusers(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_MODULES` through the other finders and runs each with ``torch.compile`` being
    :func:`lazy_compile` (what they decorate with it, or bind to it, is deferred)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in _MODULES:
            return None
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            torch = sys.modules.get("torch")  # (imported by megatron.core before either module)
            if torch is None or torch.compile is lazy_compile:
                return run(module)
            _REAL.setdefault("compile", torch.compile)
            torch.compile = lazy_compile
            try:
                run(module)
            finally:
                torch.compile = _REAL["compile"]

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Defer megatron-core's import-time compiles (idempotent; a module of :data:`_MODULES` imported already keeps
    what it made)."""
    if not any(isinstance(f, _DeferFusers) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferFusers())
