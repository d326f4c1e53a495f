"""Build the real model for a grid of configs and report what was built (tests/backend/test_kernel_rule.py).

    torchrun --nproc_per_node 2 tests/support/kernel_rule_check.py   -> one JSON line per config (rank 0)

Two gloo ranks on CPU, the compiled fast paths allowed on CPU and run eagerly (same
selection, no inductor).  Per config: the megatron parallel state is rebuilt, every model
chunk of the rank is built by the backend (``workbench.rank.build.build_model``, i.e. the
model family's spec), ``compiled_layer.prepare_model`` runs, and one training-mode forward runs on
every stage.  What was built -- core attention class, whether every layer ran the compiled
dense path (``fast_calls``), the norm class, the cross-entropy bound on the last stage --
is gathered from both ranks and printed next to what the planner's kernel path (the one
kernel rule) says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from workbench import planner  # noqa: E402
from workbench.config import preset  # noqa: E402

#: (name, overrides of the tiny preset); every config runs on 2 ranks
GRID = [
    ("dp2-learned", {}),
    ("tp2", {"parallel.tensor_parallel": 2}),
    ("tp2-sp", {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}),
    ("tp2-gqa", {"parallel.tensor_parallel": 2, "model.attention_type": "grouped", "model.num_query_groups": 2}),
    ("tp2-mqa", {"parallel.tensor_parallel": 2, "model.attention_type": "multiquery"}),
    ("rope", {"model.position_embedding": "rope"}),
    ("alibi", {"model.position_embedding": "alibi"}),
    ("llama-like", {"model.normalization": "rmsnorm", "model.activation": "swiglu", "model.add_bias_linear": False}),
    ("recompute-selective", {"parallel.recompute": "selective"}),
    ("recompute-full", {"parallel.recompute": "full"}),
    ("pp2", {"parallel.pipeline_parallel": 2}),
    ("pp2-vpp2", {"parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2, "train.global_batch_size": 8}),
    ("dropout", {"model.hidden_dropout": 0.1}),
    ("no-compile", {"train.compile_kernels": False}),
    ("local-attention", {"model.attention_backend": "local"}),
]


def _built(cfg) -> dict:
    from megatron.core import parallel_state

    from workbench.backend import compiled_layer
    from workbench.rank.build import build_model
    from workbench.backend.norms import WorkbenchNorm

    p = cfg.parallel
    chunks = []
    for i in range(p.vpp):
        vp = i if p.vpp > 1 else None
        torch.manual_seed(0)
        chunks.append(build_model(cfg, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                                  post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                                  vp_stage=vp))
    compiled_layer.prepare_model(chunks, cfg)
    m = cfg.model
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    tokens = torch.randint(1, m.vocab_size, (b, s))
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    tsp = p.tensor_parallel if p.sequence_parallel else 1
    for chunk in chunks:
        chunk.train()
        if not chunk.pre_process:
            chunk.set_input_tensor(torch.randn(s // tsp, b, h))
        chunk(tokens, pos, None, labels=tokens if chunk.post_process else None)
    layers = [mod for c in chunks for mod in c.modules() if isinstance(mod, torch.nn.Module) and hasattr(mod, "self_attention")]
    compiled = [isinstance(x, compiled_layer.CompiledTransformerLayer) and x.fast_path_blocker is None and x.fast_calls > 0 for x in layers]
    core = {type(x.self_attention.core_attention).__name__ for x in layers}
    norms = {type(x.input_layernorm) for x in layers}
    ce = {c.compute_language_model_loss.__func__ is compiled_layer.lm_cross_entropy
          for c in chunks if c.post_process and hasattr(c.compute_language_model_loss, "__func__")}
    return {
        "attention": sorted({"SDPAttention": "sdpa", "DotProductAttention": "local"}.get(n, n) for n in core),
        "layer": sorted({"compiled" if c else "stock" for c in compiled}),
        "norm": sorted({"workbench" if issubclass(n, WorkbenchNorm) else ("torch" if n.__module__.startswith("torch") else n.__name__)
                        for n in norms}),
        "cross_entropy": sorted({"compiled" if x else "vocab_parallel" for x in ce}),
    }


def main() -> int:
    from megatron.core import parallel_state

    from workbench import kernel_rule
    from workbench.backend import compiled_layer, cpu_mode, distributed

    dist.init_process_group("gloo")
    cpu_mode.enable()
    kernel_rule.allow_fast_paths_on_cpu(True)
    compiled_layer.set_compile(False)  # the fast paths' own maths, eagerly: same selection, no inductor on CPU
    for name, overrides in GRID:
        cfg = preset("tiny", **{"train.compile_kernels": True, "parallel.nproc_per_node": 2, **overrides})
        parallel_state.destroy_model_parallel()
        distributed._init_parallel_state(cfg)
        try:
            built = _built(cfg)
        except Exception as e:  # reported, so one config's failure names itself
            built = {"error": f"{type(e).__name__}: {e}"}
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, built)
        if dist.get_rank() == 0:
            kp = planner.kernel_path(cfg, planner.PlannerAssumptions(transformer_engine=False))
            print(json.dumps({"config": name, "planned": kp.to_dict(), "built": views}), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
