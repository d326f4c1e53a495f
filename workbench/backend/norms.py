"""Sequence-parallel-capable LayerNorm / RMSNorm on plain PyTorch.

megatron-core's local spec wraps ``torch.nn.LayerNorm`` and refuses sequence parallelism
(``AssertionError: sequence parallel not supported by torch LayerNorm``).  The reason is
bookkeeping, not maths: under SP every TP rank normalises a different slice of the
sequence, so the norm's weight/bias gradients are partial sums that must be all-reduced
across the tensor-parallel group.  Megatron does that for every parameter carrying the
attribute ``sequence_parallel=True`` (``finalize_model_grads`` ->
``_allreduce_non_tensor_model_parallel_grads``).  These modules set that attribute, so
TP+SP works without apex or Transformer Engine.

The call signature matches megatron's norm builders: ``Norm(config, hidden_size, eps)``.
The kernels are ``torch.nn.functional.layer_norm`` / ``rms_norm`` (fused single kernels on
CUDA in recent PyTorch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["WorkbenchLayerNorm", "WorkbenchRMSNorm", "WorkbenchNorm"]


def _mark_sequence_parallel(module: torch.nn.Module, config: TransformerConfig) -> None:
    for p in module.parameters():
        setattr(p, "sequence_parallel", bool(config.sequence_parallel))


def _param_device(config: TransformerConfig) -> torch.device | None:
    return torch.device("cpu") if config.use_cpu_initialization else None


class _SPNorm(torch.nn.Module):
    """Shared constructor: a weight (and optionally a bias) flagged ``sequence_parallel``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float, with_bias: bool):
        super().__init__()
        self.config = config
        self.eps = eps
        self.hidden_size = hidden_size
        dev = _param_device(config)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=dev))
        if with_bias:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=dev))
        _mark_sequence_parallel(self, config)


class WorkbenchLayerNorm(_SPNorm):
    """LayerNorm whose params are all-reduced across TP under sequence parallelism."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__(config, hidden_size, eps, with_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class WorkbenchRMSNorm(_SPNorm):
    """RMSNorm (no bias) whose weight is all-reduced across TP under sequence parallelism."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object):
        super().__init__(config, hidden_size, eps, with_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)


class WorkbenchNorm:
    """Builder picking LayerNorm or RMSNorm from ``config.normalization`` (like mcore's LNImpl)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: object):
        if config.normalization == "RMSNorm":
            return WorkbenchRMSNorm(config, hidden_size, eps)
        if config.normalization == "LayerNorm":
            return WorkbenchLayerNorm(config, hidden_size, eps)
        raise ValueError(f"normalization {config.normalization!r} is not supported (use LayerNorm or RMSNorm)")
