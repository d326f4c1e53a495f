"""Fill-mask with a BERT checkpoint: the most likely tokens at each ``[MASK]`` of a text.

``fill_mask(ckpt, texts, top_k)`` builds the checkpoint's model at TP=1/PP=1 on the CPU in this process
(:func:`workbench.models.common.one_process.single_process_group`, as the converters do), loads the weights
through :func:`workbench.checkpoint.load_checkpoint`, and runs one forward over
``[CLS] text [SEP]`` (right-padded, padding mask, token type 0).  Each result holds, per ``[MASK]``,
the ``top_k`` tokens with their probabilities, the filled-in text, and the inputs and vocabulary
logits (``[b, s, V]``, padding rows of the vocabulary cut) so they can be compared with another
implementation (e.g. the HF export: :func:`hf_mlm_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from workbench.checkpoint import checkpoint_config, load_checkpoint, read_metadata
from workbench.families.bert.vocab import check_bert_tokenizer
from workbench.models.common.one_process import build_full_model, single_process_group

__all__ = ["FillMaskResult", "fill_mask", "encode_masked", "hf_mlm_logits"]


@dataclass
class FillMaskResult:
    text: str
    #: per [MASK] of the text, in order: [(token, probability), ...] best first
    predictions: list[list[tuple[str, float]]] = field(default_factory=list)

    @property
    def filled(self) -> str:
        """The text with each [MASK] replaced by its best token."""
        out = self.text
        for preds in self.predictions:
            out = out.replace("[MASK]", preds[0][0] if preds else "?", 1)
        return out

    def __str__(self) -> str:
        """The filled-in text, then each mask's candidates quoted (a punctuation candidate stays visible as one)."""
        alts = " | ".join(", ".join(f"{t!r} {p:.2f}" for t, p in preds) for preds in self.predictions)
        return f"{self.filled}    [{alts}]"


def encode_masked(vocab: Any, texts: Sequence[str], max_length: int) -> dict[str, Any]:
    """``tokens``, ``padding_mask``, ``tokentype_ids`` ``[b, s]`` for ``[CLS] text [SEP]`` (right-padded)."""
    import torch

    rows = [[vocab.cls] + vocab.encode(t)[: max_length - 2] + [vocab.sep] for t in texts]
    s = max(map(len, rows))
    tokens = torch.full((len(rows), s), vocab.pad, dtype=torch.long)
    mask = torch.zeros((len(rows), s), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"tokens": tokens, "padding_mask": mask, "tokentype_ids": torch.zeros_like(tokens)}


def fill_mask(ckpt: str | Path, texts: Sequence[str] | str, top_k: int = 5, tokenizer: Any = None) -> tuple[list[FillMaskResult], dict]:
    """(one :class:`FillMaskResult` per text, ``{"inputs": ..., "logits": [b, s, V]}``) for a BERT checkpoint."""
    import torch

    texts = [texts] if isinstance(texts, str) else list(texts)
    meta = read_metadata(ckpt)
    cfg = checkpoint_config(meta)  # the recorded config as data: hooks it names are never imported
    vocab = check_bert_tokenizer(tokenizer or cfg.data.tokenizer)
    inputs = encode_masked(vocab, texts, cfg.model.seq_length)
    V = cfg.model.vocab_size
    with single_process_group():
        model = build_full_model(cfg, "fp32")
        load_checkpoint(meta["path"], [model], load_optimizer=False)
        model.eval()
        with torch.no_grad():
            out = model(inputs["tokens"], inputs["padding_mask"], tokentype_ids=inputs["tokentype_ids"])
    logits = (out[0] if isinstance(out, tuple) else out)[..., :V].float()
    probs = torch.softmax(logits, dim=-1)
    results = []
    for i, text in enumerate(texts):
        where = (inputs["tokens"][i] == vocab.mask).nonzero().flatten().tolist()
        preds = []
        for pos in where:
            p, ids = probs[i, pos].topk(top_k)
            preds.append([(vocab.decode([int(t)]).strip(), float(q)) for q, t in zip(p, ids)])
        results.append(FillMaskResult(text, preds))
    return results, {"inputs": inputs, "logits": logits}


def hf_mlm_logits(hf_dir: str | Path, inputs: dict[str, Any]) -> Any:
    """HF ``MegatronBertForPreTraining``'s masked-LM logits ``[b, s, V]`` (fp32) for :func:`encode_masked` inputs."""
    import torch
    from transformers import MegatronBertForPreTraining

    hf = MegatronBertForPreTraining.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    b, s = inputs["tokens"].shape
    with torch.no_grad():  # explicit positions: HF's position_ids buffer is left uninitialised when megatron-core has
        return hf(input_ids=inputs["tokens"], attention_mask=inputs["padding_mask"],  # built a model in this process
                  token_type_ids=inputs["tokentype_ids"], position_ids=torch.arange(s)[None].expand(b, -1)).prediction_logits.float()
