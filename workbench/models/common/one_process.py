"""A model of any family in this one process: a one-process CPU group, the TP=1/PP=1 config, the full model.

What needs a whole model on the CPU without torchrun asks here: conversion (:mod:`workbench.conversion`, whose
checkpoint files take the storage keys megatron's own ``sharded_state_dict`` gives this model, so that it never
re-implements them) and BERT's fill-mask (:mod:`workbench.models.bert.fill_mask`).  The model is the family's own
(:meth:`workbench.models.parts.FamilyParts.model`), built from the backend's blocks as a run builds it.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

from workbench.config import RunConfig
from workbench.launch.stores import private_world
from workbench.models.parts import parts_of
from workbench.run.files import free_port

__all__ = ["single_process_group", "cpu_build_config", "model_overrides", "build_full_model"]

_ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def cpu_build_config(cfg: RunConfig, dtype: str | None = None) -> RunConfig:
    """``cfg`` at TP=1/PP=1 on one CPU process (the layout conversion works at), optionally another dtype.

    The vocab stays padded for ``cfg``'s tensor-parallel size, so the written checkpoint has
    exactly the rows the target layout's model holds.
    """
    # keep the target layout's vocab padding: pad(V, d, tp) == pad(V, d * tp, 1)
    over: dict[str, Any] = {
        "model.make_vocab_size_divisible_by": cfg.model.make_vocab_size_divisible_by * max(cfg.parallel.tensor_parallel, 1),
        "parallel.tensor_parallel": 1, "parallel.pipeline_parallel": 1, "parallel.expert_parallel": 1, "parallel.context_parallel": 1,
        "parallel.expert_tensor_parallel": None,
        "parallel.virtual_pipeline_parallel": None, "parallel.sequence_parallel": False,
        "parallel.nnodes": 1, "parallel.nproc_per_node": 1, "parallel.device": "cpu",
        "parallel.distributed_optimizer": False, "parallel.overlap_grad_reduce": False,
        "parallel.overlap_param_gather": False, "parallel.recompute": "none",
        "train.compile_kernels": False, "model.attention_backend": "sdpa",
    }
    if dtype:
        over["train.precision"] = dtype
    return cfg.replace(**over)


def model_overrides(cfg: RunConfig) -> dict[str, Any]:
    """TransformerConfig overrides the conversion needs beyond the builder's defaults."""
    import functools

    import torch.nn.functional as F

    over: dict[str, Any] = {}
    if cfg.model.activation == "gelu" and cfg.model.gelu_approximate == "tanh":
        over["activation_func"] = functools.partial(F.gelu, approximate="tanh")
    return over


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-process gloo group with megatron's TP=PP=1 state and CPU mode; torn down on exit.

    Re-uses an existing group when this process already has one of model-parallel size 1.
    """
    with warnings.catch_warnings():
        # megatron / torch.distributed.checkpoint deprecation chatter is not actionable for a conversion
        for mod in (r"megatron\..*", r"torch\.distributed\..*"):
            warnings.filterwarnings("ignore", category=UserWarning, module=mod)
            warnings.filterwarnings("ignore", category=FutureWarning, module=mod)
        with _group():
            yield


@contextlib.contextmanager
def _group() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if dist.is_available() and dist.is_initialized():
        created = False
        if ps.model_parallel_is_initialized():
            if ps.get_tensor_model_parallel_world_size() != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
                raise RuntimeError("conversion runs at TP=1/PP=1 but this process already has a model-parallel group; "
                                   "run the conversion in its own process (e.g. the `workbench convert` CLI)")
        else:
            ps.initialize_model_parallel(1, 1)
            created = True
        try:
            yield
        finally:
            if created:
                ps.destroy_model_parallel()
        return

    from workbench.backend import cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests

    saved_env = {k: os.environ.get(k) for k in _ENV_KEYS}
    was_enabled = cpu_mode.enabled()
    os.environ["LOCAL_RANK"] = "0"
    try:
        private_world("cpu")  # an in-memory store: the group listens for no peers (it has none)
        initialize_for_tests(cpu_build_config(RunConfig()), rank=0, world_size=1, port=free_port())
        yield
    finally:
        destroy()
        if not was_enabled:
            cpu_mode.disable()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_full_model(cfg: RunConfig, dtype: str | None = None) -> Any:
    """A TP=1/PP=1 CPU GPTModel for ``cfg`` (call inside :func:`single_process_group`)."""
    import torch

    from workbench.backend.model import transformer_config

    c = cpu_build_config(cfg, dtype)
    config = transformer_config(c, perform_initialization=False, **model_overrides(c))
    with torch.device("cpu"):
        return parts_of(c).model().build(c, config=config)
