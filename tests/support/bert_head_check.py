"""Subprocess helper for tests/models/test_bert_masked_head.py (own process: megatron's parallel state is global).

    python tests/support/bert_head_check.py              -> JSON: BERT's step with the masked-LM head on the masked
                                                            positions only against the head on every position
    torchrun --nproc_per_node 2 tests/support/bert_head_check.py  -> the same at TP=2 (and TP=2 + SP: every position)

Both runs use the same weights and batch (the family's synthetic BERT samples, padding included), dropout off, the
family's own ``forward_step`` and ``loss``; the full head is the same model with ``masked_per_sequence = 0``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from workbench.config import preset  # noqa: E402


def _step(model, batch, labels_loss):
    from workbench.models.bert import step

    model.zero_grad(set_to_none=True)
    out = step.forward_step(batch, model)
    total, n, report = step.loss(batch, out)
    (total / n).backward()
    return (total / n).item(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, out[0]


def check(cases: dict) -> dict:
    from workbench.backend import distributed
    from workbench.rank.train import Batch
    from workbench.models.bert.data import SyntheticBertDataset
    from workbench.models.bert.model import build

    out = {}
    first = True
    for name, over in cases.items():
        cfg = preset("bert-tiny", **{"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0, **over})
        if first:
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                distributed.initialize_for_tests(cfg, port=int(os.environ.get("CHECK_PORT", "29641")))
            else:
                distributed.initialize(cfg)
            first = False
        torch.manual_seed(0)
        model = build(cfg)
        ds = SyntheticBertDataset(cfg.model.vocab_size, cfg.model.seq_length, 7)
        items = [ds[i] for i in range(4)]
        raw = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch = Batch(tokens=raw["tokens"], labels=raw["labels"], loss_mask=raw["loss_mask"],
                      extra={k: v for k, v in raw.items() if k not in ("tokens", "labels", "loss_mask")})
        model.train()
        cap = model.masked_per_sequence
        loss_m, grads_m, per_token_m = _step(model, batch, True)
        model.masked_per_sequence = 0
        loss_f, grads_f, per_token_f = _step(model, batch, True)
        rel = max(((grads_m[k] - grads_f[k]).norm() / (grads_f[k].norm() + 1e-12)).item() for k in grads_f)
        mask = batch.loss_mask > 0
        # too many masked positions for the head's rows: refused, never a partial loss
        model.masked_per_sequence = 1
        try:
            _step(model, batch, True)
            refused = None
        except RuntimeError as e:
            refused = str(e)[:200]
        out[name] = {"loss_masked_head": loss_m, "loss_full_head": loss_f, "grad_rel_max": rel, "masked_per_sequence": cap,
                     "same_grad_keys": sorted(grads_m) == sorted(grads_f),
                     "per_token_equal_at_masks": bool(torch.allclose(per_token_m[mask], per_token_f[mask], rtol=1e-5)),
                     "zero_elsewhere": bool((per_token_m[~mask] == 0).all()), "masked_rows": int(mask.sum()),
                     "positions": int(mask.numel()), "overflow_refused": refused,
                     "full_head_nonzero_elsewhere": bool((per_token_f[~mask] != 0).any())}
    return out


def main() -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cases = {"tp1": {}} if world == 1 else {
        "tp2": {"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2},
        "tp2+sp": {"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2, "parallel.sequence_parallel": True}}
    res = check(cases)
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    from compiled_layer_check import _exit  # noqa: E402  (tests/support: the process-group teardown without finalisation)

    _exit(main())
