"""BERT's default train step: the forward step, the masked-LM + sentence-order loss, masked-token accuracy.

Batches (from :mod:`.data`) hold ``tokens``, ``labels`` (the original ids at masked positions, 0
elsewhere), ``loss_mask`` (1 at masked positions) and in ``extra``: ``padding_mask`` (1 = real
token), ``tokentype_ids`` (sentence A / B; only when ``model.num_tokentypes`` > 0) and
``is_random`` (the sentence-order label; only with the binary head).

``forward_step(batch, model, return_logits)`` returns, on the last pipeline stage, the tuple
``(per-token MLM losses [b, s], binary logits [b, 2] or None, correct [b, s] or None)`` (the
third only in eval: whether the vocab-parallel argmax is the label), hidden states elsewhere.  In training
the model is given the ``loss_mask`` and runs its masked-LM head on the masked positions only (the same
losses there, 0 at the others, which the loss mask drops in any case; ``WorkbenchBertModel.masked_lm_losses``).
``loss(batch, output)`` -> ``(loss_sum, num_tokens, report)`` in megatron's convention: the
schedule divides ``loss_sum`` by ``num_tokens``, giving ``MLM token mean + sentence-order mean``
(Megatron-LM's ``pretrain_bert`` total); the report holds ``lm loss`` (MLM), ``sop loss`` and,
in eval, ``mlm accuracy`` as ``[sum, count]`` pairs that the trainer averages over micro-batches
and data-parallel ranks.  A ``train.loss_func`` hook receives the same tuple as ``losses``.

Context parallelism (``parallel.context_parallel`` > 1): the trainer cuts :data:`PER_TOKEN_KEYS` (with the tokens,
labels and loss mask) into each CP rank's load-balanced chunks.  The pooled first token, and so the sentence-order
logits, exist on CP rank 0 only (the rank holding chunk 0): its sentence-order loss counts once, weighted by the
masked tokens of the whole sequence (what the trainer divides by), and the other CP ranks add none to the loss or
the report.

Labelled batches (``extra["label"]``; ``model.num_labels`` > 0, :mod:`.finetune`): the forward step
returns the class logits and the loss is their cross entropy per sample (under the same
``lm loss`` key, the trainer's main loss) with ``accuracy`` in the report.
"""

from __future__ import annotations

from typing import Any

__all__ = ["forward_step", "loss", "classification_loss", "logits_forward", "masked_accuracy", "LOSS_NAME", "SOP_NAME", "ACCURACY_NAME",
           "CLASS_ACCURACY_NAME", "PER_TOKEN_KEYS"]

#: the key the reported (masked-LM) loss goes under
LOSS_NAME = "lm loss"
SOP_NAME = "sop loss"
ACCURACY_NAME = "mlm accuracy"
#: sequence classification's accuracy (train steps and eval)
CLASS_ACCURACY_NAME = "accuracy"
#: BERT's own per-token keys ``[b, s]`` besides tokens, labels and loss mask: cut along the sequence under context
#: parallelism (``workbench.rank.data.shard_batch``)
PER_TOKEN_KEYS = ("padding_mask", "tokentype_ids")


def masked_accuracy(logits: Any, labels: Any) -> Any:
    """Whether the argmax over the whole (tensor-parallel) vocabulary is the label: ``[b, s]`` float.

    ``logits`` is this rank's vocab shard ``[b, s, V/tp]``; the maximum and the label's logit are
    all-reduced (MAX) over the tensor-parallel group, so no rank gathers the full vocabulary.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    logits = logits.float()
    vl = logits.shape[-1]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * vl
    best = logits.max(dim=-1).values
    local = labels - start
    inside = (local >= 0) & (local < vl)
    picked = torch.gather(logits, -1, local.clamp(0, vl - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(inside, picked, torch.full_like(picked, float("-inf")))
    if tp > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(picked, op=dist.ReduceOp.MAX, group=group)
    return (picked >= best).float()


def forward_step(batch: Any, model: Any, return_logits: bool = False, **_: Any) -> Any:
    """BERT's forward: (MLM losses, binary logits, eval-only correctness) on the last stage, hidden states elsewhere;
    for a labelled batch (sequence classification, :mod:`.finetune`) the class logits ``[b, num_labels]``."""
    extra = batch.extra
    types = extra.get("tokentype_ids")
    if "label" in extra:
        return model(batch.tokens, extra["padding_mask"], tokentype_ids=types)
    if model.training or batch.labels is None:
        out = model(batch.tokens, extra["padding_mask"], tokentype_ids=types, lm_labels=batch.labels,
                    loss_mask=batch.loss_mask if model.training else None)
        if isinstance(out, tuple):
            return out[0], out[1], None
        return out
    # eval: the logits are needed for the masked-token accuracy; the loss is the same cross entropy
    from megatron.core import tensor_parallel

    out = model(batch.tokens, extra["padding_mask"], tokentype_ids=types)
    if not isinstance(out, tuple):
        return out
    logits, binary = out
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.labels)
    return losses, binary, masked_accuracy(logits, batch.labels)


def loss(batch: Any, output: Any) -> tuple[Any, Any, dict]:
    """MLM sum (+ sentence-order mean x tokens), the masked-token count, and the report (see module docstring)."""
    import torch
    import torch.nn.functional as F

    if "label" in batch.extra:
        return classification_loss(batch, output)
    lm_losses, binary, correct = output
    mask = batch.loss_mask.reshape(-1).float()
    mlm_sum = torch.sum(lm_losses.reshape(-1).float() * mask)
    n = mask.sum()
    num_tokens = n.to(torch.int)  # megatron's schedule clamps the divisor at 1 (after the CP sum under CP)
    report = {LOSS_NAME: torch.stack([mlm_sum.detach().clone(), n.detach()])}
    total = mlm_sum
    if binary is not None:
        target = batch.extra["is_random"].reshape(-1).long()
        sop = F.cross_entropy(binary.float(), target)
        weight, b = _sop_weight(num_tokens, float(target.numel()))
        total = mlm_sum + sop * weight
        report[SOP_NAME] = torch.stack([sop.detach() * b, torch.full_like(sop.detach(), b)])  # (no host copy: capturable)
    if correct is not None:
        report[ACCURACY_NAME] = torch.stack([torch.sum(correct.reshape(-1) * mask).detach(), n.detach()])
    return total, num_tokens, report


def _sop_weight(num_tokens: Any, samples: float) -> tuple[Any, float]:
    """(the sentence-order loss's weight in the summed loss, the samples it reports): the micro-batch's masked tokens
    and samples; under context parallelism the whole sequence's masked tokens (summed over the CP group, as the
    trainer sums the divisor) on CP rank 0, which holds the pooled first token, and nothing on the other CP ranks."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() <= 1:
        return num_tokens.float().clamp(min=1), samples
    import torch.distributed as dist

    whole = num_tokens.detach().float().clone()
    dist.all_reduce(whole, group=parallel_state.get_context_parallel_group())
    whole = whole.clamp(min=1)  # as megatron's schedule clamps the CP-summed divisor
    if parallel_state.get_context_parallel_rank() == 0:
        return whole, samples
    return whole * 0.0, 0.0


def classification_loss(batch: Any, logits: Any) -> tuple[Any, Any, dict]:
    """Cross-entropy sum over the micro-batch's samples, their count, and the report (loss and accuracy as [sum, count])."""
    import torch
    import torch.nn.functional as F

    target = batch.extra["label"].reshape(-1).long()
    logits = logits.float()
    ce = F.cross_entropy(logits, target, reduction="sum")
    n = torch.full((), float(target.numel()), device=logits.device)  # (no host copy: capturable)
    correct = (logits.argmax(dim=-1) == target).float().sum()
    report = {LOSS_NAME: torch.stack([ce.detach().clone(), n]), CLASS_ACCURACY_NAME: torch.stack([correct.detach(), n])}
    return ce, n.to(torch.int), report


def logits_forward(chunk: Any, inputs: dict) -> Any:
    """One model chunk's forward for logits (conversion's verify): hidden states, or the last stage's vocab-parallel
    masked-LM logits ``[b, s, V/tp]``; ``inputs``: ``tokens``, ``padding_mask`` and ``tokentype_ids``
    (:func:`workbench.models.bert.hf.verify_inputs`)."""
    out = chunk(inputs["tokens"], inputs["padding_mask"], tokentype_ids=inputs.get("tokentype_ids"))
    return out[0] if isinstance(out, tuple) else out
