"""Parallel initialisation from a RunConfig: process group, megatron parallel state, seeds.

``initialize(cfg)`` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), starts NCCL on GPUs or gloo for ``parallel.device == "cpu"`` (after
turning on :mod:`workbench.backend.cpu_mode`), builds megatron's TP/CP/PP/VPP/DP groups
(DP = world / (tp * cp * pp): :class:`workbench.layout.Layout`) and seeds the RNGs the way Megatron does.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from workbench.backend import cpu_mode
from workbench.config import RunConfig, allocator_reason, apply_rank_environment, derive, rank_environment
from workbench.layout import Layout

__all__ = ["Coords", "allocator_note", "initialize", "initialize_for_tests", "coords", "destroy", "device"]


@dataclass(frozen=True)
class Coords:
    """Where this rank sits in the 3-D layout."""

    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_size: int
    pp_size: int
    dp_size: int
    #: context-parallel rank and size (megatron's ``get_context_parallel_rank`` / ``_world_size``); ``dp`` and
    #: ``dp_size`` exclude CP (the ranks of one CP group read the same samples)
    cp: int = 0
    cp_size: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


def device(cfg: RunConfig) -> torch.device:
    if cfg.parallel.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def coords() -> Coords:
    return Coords(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        tp=parallel_state.get_tensor_model_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_rank(),
        dp=parallel_state.get_data_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        cp=parallel_state.get_context_parallel_rank(),
        cp_size=parallel_state.get_context_parallel_world_size(),
    )


def _seed(cfg: RunConfig) -> None:
    # Megatron's rule: a different stream per pipeline stage; TP ranks share the default
    # stream (CPU initialisation of full weights then splits identically) and get a
    # separate tracked stream for TP-sharded dropout.
    seed = cfg.train.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    if cfg.parallel.device == "cuda":
        from workbench.backend.model import training_step_fields

        # megatron's layer graphs need a graph-safe RNG tracker: TE's where the fields name it, else megatron's own
        fields = training_step_fields(cfg)
        te_rng = bool(fields.get("use_te_rng_tracker"))
        graphable = fields.get("cuda_graph_impl") == "local" and not te_rng
        tensor_parallel.model_parallel_cuda_manual_seed(seed, te_rng_tracker=te_rng, use_cudagraphable_rng=graphable,
                                                        force_reset_rng=True)


def _init_parallel_state(cfg: RunConfig) -> Coords:
    p = cfg.parallel
    world = dist.get_world_size()
    cp = max(int(getattr(p, "context_parallel", 1) or 1), 1)
    lay = Layout(world=world, tp=p.tensor_parallel, pp=p.pipeline_parallel, cp=cp)
    if not lay.divisible:
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel*context_parallel*pipeline_parallel = {lay.model_parallel}; "
            "fix parallel.nproc_per_node / nnodes"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_parallel if p.vpp > 1 else None,
        context_parallel_size=cp,
        expert_model_parallel_size=max(p.expert_parallel, 1),
        expert_tensor_parallel_size=p.expert_tensor_parallel,  # None: TP
    )
    _seed(cfg)
    return coords()


def hardware_queue_note(cfg: RunConfig) -> Optional[str]:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS`` as :func:`workbench.config.rank_environment` asks if CUDA has not started
    yet (the backend's entry point sets it before importing torch; :func:`initialize` for in-process API users) and
    say what is in force, for the run's kernel path.  None when the config does not ask for it.  Idempotent."""
    wanted = rank_environment(cfg).get("CUDA_DEVICE_MAX_CONNECTIONS")
    if wanted is None:
        return None
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = wanted
    return _env_note("CUDA_DEVICE_MAX_CONNECTIONS", wanted, default="default queues")


def _env_note(key: str, wanted: Optional[str], default: str, why: Optional[str] = None) -> Optional[str]:
    """What the environment's ``key`` holds against the value ``wanted`` of :func:`workbench.config.rank_environment`
    (None: not asked for): unset though wanted (``default``: what runs instead), as wanted (``why``, if given, said
    after it), or the launch's own value (kept over a wanted one); None when neither sets it."""
    have = os.environ.get(key)
    if have is None:
        return None if wanted is None else f"{key} not set before CUDA started ({default})"
    if wanted is None:
        return f"{key}={have} (set by the launch)"
    if have != wanted:
        return f"{key}={have} (set by the launch; kept)"
    return f"{key}={have}" + (f" ({why})" if why else "")


#: rank-environment keys read after CUDA starts (TE reads ``UB_SKIPMC`` when it sets up userbuffers): set even then
_READ_LATE = ("UB_SKIPMC",)


def _apply_environment(cfg: RunConfig) -> None:
    """:func:`workbench.config.rank_environment` in this process (a launch's own values kept): all of it before CUDA
    starts; once CUDA has started (an in-process caller that used it first), the keys read later, and the allocator's
    settings through torch at run time (they apply to the segments it maps from then on)."""
    if not torch.cuda.is_initialized():
        apply_rank_environment(cfg)
        return
    env = rank_environment(cfg)
    for key, value in env.items():
        if key in _READ_LATE:
            os.environ.setdefault(key, value)
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        try:
            torch.cuda.memory._set_allocator_settings(conf)
        except (AttributeError, RuntimeError):
            return  # the note says the default allocator runs
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


def allocator_note(cfg: RunConfig) -> Optional[str]:
    """The CUDA caching allocator's settings in force, for the run's kernel path: ``PYTORCH_CUDA_ALLOC_CONF`` as
    :func:`workbench.config.rank_environment` asks for it (:func:`workbench.config.allocator_reason`) or as the
    launch set it; None when neither sets it."""
    return _env_note("PYTORCH_CUDA_ALLOC_CONF", rank_environment(cfg).get("PYTORCH_CUDA_ALLOC_CONF"),
                     default="default allocator", why=allocator_reason(cfg))


def initialize(cfg: RunConfig, timeout_s: float = 600.0) -> Coords:
    """Initialise from torchrun's environment. Safe to call once per process."""
    if cfg.parallel.device == "cpu":
        cpu_mode.enable()
        backend = "gloo"
    else:
        _apply_environment(cfg)  # before is_available(), which may start CUDA (in-process API users)
        if not torch.cuda.is_available():
            raise RuntimeError("parallel.device is 'cuda' but no GPU is visible; set parallel.device: cpu for CPU mode")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    expected = derive(cfg).world_size
    if dist.get_world_size() != expected:
        print(
            f"[workbench] note: torchrun world size {dist.get_world_size()} differs from parallel.nnodes*nproc_per_node = {expected}; "
            "using the actual world size",
            flush=True,
        )
    return _init_parallel_state(cfg)


def initialize_for_tests(cfg: RunConfig, rank: int = 0, world_size: int = 1, port: int = 29533) -> Coords:
    """In-process initialisation (no torchrun): gloo on localhost. For tests and notebooks."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    return initialize(cfg, timeout_s=120.0)


def _free_captured_graphs() -> None:
    """Free inductor's (compiled layer) and megatron's (TE's layer) CUDA graphs before the NCCL communicators
    their collectives were captured on, and megatron's process-wide graph record with them.

    Measured on 2 H200s: with the TP collectives inside graph-replayed layers,
    ``destroy_process_group`` otherwise waits forever (a futex) and the finished rank never exits.
    """
    if not torch.cuda.is_initialized():
        return
    try:  # like the rest of destroy(): never raise (a failed run's device may be in an error state)
        torch.cuda.synchronize()
        if "torch._inductor.cudagraph_trees" in sys.modules:
            sys.modules["torch._inductor.cudagraph_trees"].reset_cudagraph_trees()
        mgraphs = sys.modules.get("megatron.core.transformer.cuda_graphs")  # TE's layer: megatron's own graphs
        if mgraphs is not None and mgraphs._CudagraphGlobalRecord.cudagraph_created:
            mgraphs.delete_cuda_graphs()
    except Exception:
        pass


def destroy() -> None:
    """Tear down megatron's groups and the default process group (idempotent)."""
    _free_captured_graphs()
    from workbench.backend.tp_overlap import destroy_userbuffers

    destroy_userbuffers()  # TE's communicators hold NCCL bootstrap groups: before the process group goes
    try:
        parallel_state.destroy_model_parallel()
    except Exception:
        pass
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
