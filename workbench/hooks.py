"""The custom train step API: replace the forward step and/or the loss of the backend.

Two hooks, set by dotted path in the run config (``train.forward_step`` /
``train.loss_func``, e.g. ``"my_project.losses:keytoken_weighted_loss"``, with
``train.hook_kwargs`` passed as keyword arguments) or as callables through the Python
API (``workbench.rank.train.Trainer(cfg, run_dir, hooks=TrainHooks(...))``).

``forward_step(batch: Batch, model, **hook_kwargs) -> Tensor``
    Runs one micro-batch through one model chunk.  On the last pipeline stage it returns
    per-token losses ``[b, s]`` (call ``model(batch.tokens, batch.position_ids,
    batch.attention_mask, labels=batch.labels)``), or the logits when
    ``train.return_logits`` is on; on other stages the hidden states.  Every stage receives the
    whole batch (tokens too), so a loss hook on the last stage can look at the inputs.  The
    default is the model family's (:meth:`workbench.models.parts.FamilyParts.step`); a hook
    that wraps it calls :func:`default_forward_step` with the batch it was given: the batch
    carries its run's context, the family's default step (:attr:`Batch.family_step`).

``loss_func(batch: Batch, losses: Tensor, **hook_kwargs) -> Tensor | (Tensor, dict)``
    Turns the per-token losses ``[b, s]`` (fp32; ``batch.logits`` holds this rank's
    vocab-parallel logit shard ``[b, s, v/tp]`` when ``train.return_logits`` is on) into the
    scalar loss of the micro-batch (a mean: the backend divides by the number of
    micro-batches, Megatron's legacy convention).  Optionally also a dict of extra scalars to
    report.  The default (no hook) is Megatron's token-mean cross entropy.

:func:`keytoken_weighted_loss` is the reference guide's "custom train step" example.
This module is import-light (torch only inside functions).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

__all__ = ["Batch", "TrainHooks", "resolve", "load_hooks", "default_forward_step", "keytoken_weighted_loss"]


@dataclass
class Batch:
    """One micro-batch as the hooks see it (tensors on the training device; some None on middle stages)."""

    tokens: Any = None
    labels: Any = None
    loss_mask: Any = None
    position_ids: Any = None
    attention_mask: Any = None
    #: the last stage's logits [b, s, vocab/tp], only with train.return_logits
    logits: Any = None
    #: anything else the data source delivers (e.g. document ids)
    extra: dict = field(default_factory=dict)
    #: the context of the run: its model family's default train step (:class:`workbench.families.family.StepPart`),
    #: which :func:`default_forward_step` runs (the trainer sets it on every batch)
    family_step: Any = None


@dataclass
class TrainHooks:
    forward_step: Optional[Callable[..., Any]] = None
    loss_func: Optional[Callable[..., Any]] = None
    kwargs: dict = field(default_factory=dict)
    return_logits: bool = False


def resolve(path: str) -> Callable[..., Any]:
    """Import ``'pkg.module:attr'`` (or ``'pkg.module.attr'``); clear error naming the path."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"hook path '{path}' must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"hook path '{path}': cannot import module '{mod_name}' ({e}); put it on PYTHONPATH") from e
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"hook path '{path}': '{mod_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"hook path '{path}' is not callable")
    return obj


def load_hooks(cfg: Any) -> TrainHooks:
    """The hooks a RunConfig names (train.forward_step / loss_func / hook_kwargs / return_logits)."""
    t = cfg.train
    return TrainHooks(
        forward_step=resolve(t.forward_step) if t.forward_step else None,
        loss_func=resolve(t.loss_func) if t.loss_func else None,
        kwargs=dict(t.hook_kwargs or {}),
        return_logits=bool(t.return_logits),
    )


def default_forward_step(batch: Batch, model: Any, *args: Any, **kwargs: Any) -> Any:
    """The default forward step of the batch's model family (:attr:`Batch.family_step`), for a
    ``train.forward_step`` hook that wraps it (e.g. to record or alter a micro-batch, then run the default)."""
    if getattr(batch, "family_step", None) is None:
        raise RuntimeError("default_forward_step runs on a batch of a training run (workbench.rank.train.Trainer sets "
                           "Batch.family_step, its model family's step); outside one, set it: "
                           "Batch(..., family_step=workbench.models.parts.parts_of(cfg).step())")
    return batch.family_step.forward_step(batch, model, *args, **kwargs)


def keytoken_weighted_loss(batch: Batch, losses: Any, keytoken_ids: list[int] = (), alpha: float = 0.25, **_: Any) -> Any:
    """The reference guide's custom loss: per-sample mean loss, weighted by 1 + alpha * #key tokens.

    ``weights[i] = 1 + alpha * sum_k count(tokens[i] == keytoken_ids[k])``; loss =
    mean_i(weights[i] * masked_mean(losses[i])).  (The guide then averages across data
    parallel ranks for reporting; the backend does that for every reported loss.)
    """
    import torch

    b, s = losses.shape
    mask = batch.loss_mask.view(b, s).float()
    per_sample = (losses.float() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    tokens = batch.tokens if batch.tokens is not None else batch.labels
    if len(keytoken_ids):
        weights = torch.stack([(tokens == kt).float() for kt in keytoken_ids]).sum(dim=(0, 2))
    else:
        weights = torch.zeros(b, device=losses.device)
    weights = 1.0 + alpha * weights
    return (per_sample * weights).mean()
