"""Optimizer fast paths for megatron-core without apex / Transformer Engine (:func:`prepare_optimizer`).

Without apex, megatron falls back to ``local_multi_tensor_l2_norm`` (a Python loop of ``torch.norm`` plus a host
round trip per tensor: hundreds of device syncs a step) and ``local_multi_tensor_scale`` (a Python loop of copies).
:func:`install_multi_tensor_fallbacks` replaces them with ``torch._foreach_norm`` / ``_foreach_mul_`` /
``_foreach_copy_`` (a handful of multi-tensor kernels, no syncs); :func:`install_per_parameter_fallbacks` replaces two
loops of every step over each parameter or module (the bf16 copy back to the model, the reset of per-batch
temporaries); :func:`use_fused_adam` switches torch's AdamW under
megatron's optimizer to its fused CUDA kernel (the same AdamW update).  What was switched on is recorded in
:data:`STATE` (the fast paths' summary, ``compiled_layer.summary()``).  :func:`offload_fields`: megatron's optimizer
CPU offload for ``parallel.optimizer_cpu_offload``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from workbench import kernel_rule

__all__ = ["STATE", "offload_fields", "offload_threads", "release_offload_startup", "foreach_l2_norm", "foreach_scale",
           "install_multi_tensor_fallbacks", "install_per_parameter_fallbacks", "foreach_copy_this_to_that",
           "reset_temporaries_of_holders", "use_fused_adam", "prepare_optimizer"]

#: What was switched on in this process (shared with ``compiled_layer.summary()``).
STATE: dict[str, str] = {}


def offload_fields(p: Any) -> dict[str, Any]:
    """megatron ``OptimizerConfig`` fields for ``parallel.optimizer_cpu_offload`` (``p``: the parallel config): its
    HybridDeviceOptimizer (CPU AdamW for that share of the distributed optimizer's shard, the GPU's for the rest),
    which megatron runs on the precision-aware optimizer path (Megatron-LM's own argument check requires both), with
    the gradients' copies to the host and the parameters' back overlapped with the step; none when off."""
    f = p.offload_fraction
    if f <= 0:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": f, "use_precision_aware_optimizer": True,
            "overlap_cpu_optimizer_d2h_h2d": True}


def release_offload_startup() -> None:
    """After megatron built the offloading optimizer: free what its first build held (megatron 0.19 builds a
    HybridDeviceOptimizer over all the rank's parameters, then the distributed optimizer builds another over its
    shard; the first's fp32 copies live on in reference cycles until a collection) and the pinned host blocks torch's
    caching host allocator keeps from both builds' bf16 staging copies."""
    import gc

    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def offload_threads() -> int:
    """Under optimizer CPU offload: give the host's AdamW this rank's share of the cores it may run on (torchrun sets
    ``OMP_NUM_THREADS=1`` for a launch of several ranks, which would leave the host step on one core); returns it."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))
    torch.set_num_threads(n)
    return n


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, per_tensor: bool, *args: Any):
    """Drop-in for ``amp_C.multi_tensor_l2norm`` via ``torch._foreach_norm`` (no host syncs)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors, 2.0)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), 2.0).reshape(1)
    return total, (torch.stack(norms) if per_tensor else None)


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list, scale: float | torch.Tensor) -> None:
    """Drop-in for ``amp_C.multi_tensor_scale`` and TE's ``multi_tensor_scale_tensor``: ``dst = src * scale``.

    ``scale`` may be a float or a one-element device tensor.  Filling megatron's tensor-scale
    slot keeps the gradient norm on the device (``get_grad_norm_fp32`` returns a tensor and
    clipping multiplies by ``min(1, max_norm / (norm + 1e-6))`` there) instead of an
    ``.item()`` in the middle of every optimizer step, so the host launches the Adam update
    while the norm is still being computed.  x1.0 leaves the gradients bit-identical.
    """
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if torch.is_tensor(scale):
        scale = scale.reshape(()).to(src[0].dtype)  # stays on the device: never compared on the host
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
        return
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def foreach_copy_this_to_that(this: list, that: list, overflow_buf: "torch.Tensor | None" = None) -> None:
    """Drop-in for megatron's ``_multi_tensor_copy_this_to_that`` (``that[i] = this[i]``): one ``torch._foreach_copy_``.
    Megatron's, with bf16 (no ``overflow_buf``), is a Python loop of ``copy_``: the fp32 main parameters into the bf16
    model's after every step, one kernel and one Python call per parameter (2,131 a step on ``moe-research``, whose
    experts are 2,048 of them; the same values, rounded alike)."""
    if overflow_buf is not None:
        overflow_buf.fill_(0)  # what megatron's multi-tensor path leaves behind
    if this:
        torch._foreach_copy_(that, this)


class _Holders:
    """A model chunk's modules that hold per-batch temporaries, in the place of the chunk for megatron's
    ``reset_model_temporary_tensors`` (which reaches them through ``.modules()``)."""

    def __init__(self, modules: list) -> None:
        self._modules = modules

    def modules(self):
        return iter(self._modules)


#: the attribute of a model chunk that keeps its :class:`_Holders` (found at the chunk's first reset, living with it)
_HOLDERS_ATTR = "_workbench_temporary_holders"


def reset_temporaries_of_holders(config: Any, model: list) -> None:
    """megatron's ``reset_model_temporary_tensors`` (run by ``finalize_model_grads`` every step) over the modules that
    can hold what it resets -- an expert bias, a global aux-loss tracker, ``qb_beta`` accumulators -- found at a model
    chunk's first reset, instead of a walk of every module every step (~3,300 on ``moe-research``: its 1,024 experts'
    linears; 37,781 ``named_modules`` calls a step in ``bench/results/moe_profile.jsonl:9``).  The modules are found
    once: a model's modules are not replaced after it is built (a checkpoint load copies into them)."""
    from megatron.core.utils import get_attr_wrapped_model

    holders = []
    for chunk in model:
        found = chunk.__dict__.get(_HOLDERS_ATTR)
        if found is None:
            found = _Holders([m for m in get_attr_wrapped_model(chunk, "modules")()
                              if hasattr(m, "expert_bias") or hasattr(m, "reset_global_aux_loss_tracker")
                              or hasattr(m, "qb_beta_accum")])
            chunk.__dict__[_HOLDERS_ATTR] = found
        holders.append(found)
    _MEGATRON_RESET[0](config, holders)


#: megatron's own ``reset_model_temporary_tensors`` (set by :func:`install_per_parameter_fallbacks`)
_MEGATRON_RESET: list = []


def _finalize_module() -> Any:
    """megatron's ``finalize_model_grads`` module (its package exports the function of the same name)."""
    import sys

    import megatron.core.distributed  # noqa: F401 (imports the module)

    return sys.modules["megatron.core.distributed.finalize_model_grads"]


def install_per_parameter_fallbacks() -> None:
    """Replace megatron's per-parameter and per-module Python loops of every step with :func:`foreach_copy_this_to_that`
    and :func:`reset_temporaries_of_holders` (idempotent)."""
    from megatron.core.optimizer import optimizer as mopt

    fmg = _finalize_module()

    if mopt._multi_tensor_copy_this_to_that is not foreach_copy_this_to_that:
        mopt._multi_tensor_copy_this_to_that = foreach_copy_this_to_that
    if fmg.reset_model_temporary_tensors is not reset_temporaries_of_holders:
        _MEGATRON_RESET[:] = [fmg.reset_model_temporary_tensors]
        fmg.reset_model_temporary_tensors = reset_temporaries_of_holders
    STATE["per_parameter"] = "foreach copy to the model's parameters; temporaries reset on the modules that hold them"


def install_multi_tensor_fallbacks() -> bool:
    """Replace megatron's Python-loop multi-tensor fallbacks with foreach kernels (idempotent).

    Only the local fallbacks are replaced (when apex / TE provide real kernels nothing changes).
    Without TE megatron also has no tensor-scale kernel, so it syncs on the grad norm every
    step; :func:`foreach_scale` fills that slot too.
    """
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads, optimizer as mopt

    changed = False
    if getattr(clip_grads, "l2_norm_impl", None) is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        changed = True
    for mod in (clip_grads, mopt):
        if getattr(mod, "multi_tensor_scale_impl", None) is mutils.local_multi_tensor_scale:
            mod.multi_tensor_scale_impl = foreach_scale
            changed = True
    if clip_grads.l2_norm_impl is foreach_l2_norm and getattr(clip_grads, "multi_tensor_scale_tensor_impl", 0) is None:
        clip_grads.multi_tensor_scale_tensor_impl = foreach_scale
        STATE["grad_norm"] = "on the device (no host sync in the optimizer step)"
        changed = True
    if changed or clip_grads.l2_norm_impl is foreach_l2_norm:
        STATE["multi_tensor"] = "torch._foreach_* (replacing megatron's Python-loop fallbacks)"
        return True
    return False


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    found = []
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, (torch.optim.AdamW, torch.optim.Adam)):
            found.append(inner)
    return found


def use_fused_adam(optimizer: Any) -> int:
    """Switch torch AdamW/Adam param groups under a megatron optimizer to the fused CUDA kernel.

    Same update rule (``torch._fused_adamw_``); returns the number of param groups switched.
    Existing per-parameter ``step`` counters are moved to the device as fused Adam expects.
    """
    switched = 0
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            params = [p for p in group["params"]]
            if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
                continue
            if group.get("differentiable"):
                continue
            group["fused"] = True
            group["foreach"] = False
            for p in params:
                st = opt.state.get(p)
                if st and "step" in st and torch.is_tensor(st["step"]) and st["step"].device != p.device:
                    st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
            switched += 1
        if switched:
            opt._step_supports_amp_scaling = True
            opt.defaults["fused"], opt.defaults["foreach"] = True, False
    if switched:
        STATE["optimizer"] = "torch fused AdamW (torch._fused_adamw_)"
    return switched


def prepare_optimizer(optimizer: Any, cfg: Any) -> dict[str, str]:
    """Optimizer fast paths (called by the training loop after ``get_megatron_optimizer``); what it switched on."""
    if not kernel_rule.fast_paths_wanted(cfg):
        return {}
    install_multi_tensor_fallbacks()
    install_per_parameter_fallbacks()
    use_fused_adam(optimizer)
    return {k: v for k, v in STATE.items() if k in ("multi_tensor", "optimizer")}
