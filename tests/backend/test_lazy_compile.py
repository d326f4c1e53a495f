"""megatron-core's import-time ``torch.compile`` calls deferred to first use (workbench/lazy_compile.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.support import ROOT
from workbench.lazy_compile import lazy_compile

_PROBE = """
import json, sys
import workbench.rank.train
import megatron.core.jit, megatron.core.transformer.moe.router as router
from megatron.core.fusions import fused_bias_gelu
import torch
print(json.dumps({"jit_fuser": megatron.core.jit.jit_fuser.__name__,
                  "fusion_deferred": hasattr(fused_bias_gelu.bias_gelu, "__wrapped_lazily__"),
                  "router_deferred": hasattr(router.InferenceTopKRouter._compiled_topk_routing, "__wrapped_lazily__")
                                     if hasattr(router, "InferenceTopKRouter") else None,
                  "torch_compile_restored": torch.compile.__module__ == "torch",
                  "compiler_imported": sorted(m for m in ("torch._dynamo", "torch._inductor.compile_fx")
                                              if m in sys.modules)}))
"""


def test_a_rank_imports_megatron_without_torchs_compiler():
    """A rank process's imports (the trainer, megatron-core, its fusions and router) leave dynamo and inductor
    unimported; megatron's ``jit_fuser`` and its fusions are the deferred compile; ``torch.compile`` is torch's own
    again after the import."""
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _PROBE], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["jit_fuser"] == "lazy_compile" and got["fusion_deferred"], got
    assert got["router_deferred"] in (True, None), got
    assert got["torch_compile_restored"] and got["compiler_imported"] == [], got


def test_the_deferred_compile_compiles_once_at_the_first_call_and_inlines_inside_a_compiled_region():
    from torch._dynamo.testing import CompileCounter

    inner_backend, outer_backend = CompileCounter(), CompileCounter()

    def gelu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x + b)

    deferred = lazy_compile(gelu_bias, backend=inner_backend)
    assert deferred.__name__ == "gelu_bias" and inner_backend.frame_count == 0  # nothing compiled yet
    x, b = torch.randn(4, 8), torch.randn(8)
    torch.testing.assert_close(deferred(x, b), gelu_bias(x, b))
    torch.testing.assert_close(deferred(x, b), gelu_bias(x, b))
    assert inner_backend.frame_count == 1  # compiled at the first call, reused after

    @torch.compile(backend=outer_backend, fullgraph=True)
    def outer(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return deferred(x, b) * 2  # traced inline (fullgraph: no break), as a torch.compile'd function would be

    torch.testing.assert_close(outer(x, b), 2 * gelu_bias(x, b))
    assert outer_backend.frame_count == 1 and inner_backend.frame_count == 1

    @lazy_compile(backend=inner_backend)  # the decorator form with options
    def relu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + b)

    assert inner_backend.frame_count == 1
    torch.testing.assert_close(relu_bias(x, b), torch.relu(x + b))
    assert inner_backend.frame_count == 2
