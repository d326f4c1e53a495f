"""T5's span corruption (Raffel et al., 2020, section 3.1.4), exactly as T5's ``random_spans_noise_mask``.

A raw sequence of ``tokens_length`` tokens is split into alternating non-noise / noise spans:
``round(length * noise_density)`` noise tokens in ``round(noise / mean_noise_span_length)`` spans,
both segmentations uniformly random.  The encoder sees the non-noise tokens with each noise span
replaced by one sentinel (``<extra_id_0>``, ``<extra_id_1>``, ...) and ``</s>``; the decoder
predicts ``<extra_id_0> span_0 <extra_id_1> span_1 ... </s>``.  :func:`input_and_target_lengths`
picks the raw length whose corrupted input fills the encoder exactly (T5's
``compute_input_and_target_lengths``), so no encoder token is padding.

Torch-free; numpy is imported where the corruption runs.  :func:`span_problems` is a config rule
(sequence lengths against the noise settings) and :func:`check_t5_tokenizer` a data rule.
"""

from __future__ import annotations

from typing import Any

from workbench.data.errors import DataError
from workbench.data.tokenizer import load_tokenizer

__all__ = ["input_and_target_lengths", "random_spans_noise_mask", "corrupt", "span_problems", "check_t5_tokenizer",
           "T5Vocab", "SENTINEL"]

SENTINEL = "<extra_id_{}>"


def _lengths(tokens_length: int, noise_density: float, mean_span: float) -> tuple[int, int, int]:
    """(encoder input length, decoder target length, noise spans) of ``tokens_length`` raw tokens (each + </s>)."""
    noise = int(round(tokens_length * noise_density))
    noise = min(max(noise, 1), max(tokens_length - 1, 1))
    spans = max(int(round(noise / mean_span)), 1)
    return tokens_length - noise + spans + 1, noise + spans + 1, spans


def input_and_target_lengths(inputs_length: int, noise_density: float, mean_span: float) -> tuple[int, int, int]:
    """(raw tokens per sample, decoder target length, noise spans) for an encoder of ``inputs_length``.

    The longest raw length whose corrupted input (+ </s>) fits ``inputs_length`` (T5's rule)."""
    n = 2
    while n < 1_000_000 and _lengths(n + 1, noise_density, mean_span)[0] <= inputs_length:
        n += 1
    inp, tgt, spans = _lengths(n, noise_density, mean_span)
    return n, tgt, spans


def random_spans_noise_mask(length: int, noise_density: float, mean_span: float, rng: Any) -> Any:
    """Boolean numpy mask ``[length]`` (True = noise): alternating non-noise / noise spans, non-noise first."""
    import numpy as np

    noise = int(round(length * noise_density))
    noise = min(max(noise, 1), length - 1)
    spans = max(int(round(noise / mean_span)), 1)
    nonnoise = length - noise

    def segmentation(items: int, segments: int) -> Any:
        first = np.arange(items - 1) < (segments - 1)
        rng.shuffle(first)
        seg_id = np.cumsum(np.pad(first, [[1, 0]]))
        return np.unique(seg_id, return_counts=True)[1]

    interleaved = np.stack([segmentation(nonnoise, spans), segmentation(noise, spans)], axis=1).reshape(-1)
    starts = np.cumsum(interleaved)[:-1]
    indicator = np.zeros(length, dtype=np.int64)
    indicator[starts] = 1
    return (np.cumsum(indicator) % 2) == 1


def corrupt(tokens: Any, mask: Any, sentinels: list[int], eos: int) -> tuple[Any, Any]:
    """(encoder input, decoder target) numpy int64 arrays, each ending in ``eos`` (see module docstring)."""
    import numpy as np

    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    starts = mask & ~np.concatenate([[False], mask[:-1]])
    if int(starts.sum()) > len(sentinels):
        raise ValueError(f"{int(starts.sum())} noise spans but only {len(sentinels)} sentinel tokens")
    inp, tgt, k = [], [], -1
    for i, tok in enumerate(tokens):
        if starts[i]:
            k += 1
            inp.append(sentinels[k])
            tgt.append(sentinels[k])
        if mask[i]:
            tgt.append(int(tok))
        else:
            inp.append(int(tok))
    return np.array(inp + [eos], dtype=np.int64), np.array(tgt + [eos], dtype=np.int64)


def span_problems(cfg: Any) -> list[tuple[str, str, str]]:
    """Config rule: noise settings in range, and the encoder / decoder lengths hold a corrupted sample."""
    m, d = cfg.model, cfg.data
    out: list[tuple[str, str, str]] = []
    if not 0.0 < d.noise_density < 1.0:
        out.append(("data.noise_density", f"must be in (0, 1) (got {d.noise_density})", "use 0.15 (T5)"))
        return out
    if d.mean_noise_span_length < 1.0:
        out.append(("data.mean_noise_span_length", f"must be >= 1 (got {d.mean_noise_span_length})", "use 3.0 (T5)"))
        return out
    raw, tgt, spans = input_and_target_lengths(m.seq_length, d.noise_density, d.mean_noise_span_length)
    if m.seq_length < 4 or raw - int(round(raw * d.noise_density)) < 1:
        out.append(("model.seq_length", f"seq_length {m.seq_length} is too short for span corruption at noise_density "
                    f"{d.noise_density} (no room for text, a sentinel and </s>)", "use seq_length >= 8 (T5: 512)"))
    elif tgt > m.decoder_seq:
        out.append(("model.decoder_seq_length", f"span corruption of {m.seq_length} encoder tokens (noise_density "
                    f"{d.noise_density}, mean_noise_span_length {d.mean_noise_span_length}) makes {tgt}-token targets, "
                    f"longer than decoder_seq_length {m.decoder_seq}",
                    f"set decoder_seq_length >= {tgt}, or lower noise_density / seq_length"))
    if spans > 100:
        out.append(("data.mean_noise_span_length", f"{spans} noise spans per sample need {spans} sentinel tokens; T5 "
                    "tokenizers have 100", "raise mean_noise_span_length or lower seq_length / noise_density"))
    return out


class T5Vocab:
    """A tokenizer plus what span corruption needs: sentinel ids (``<extra_id_i>`` in order), eos, pad."""

    def __init__(self, tokenizer: Any, sentinels: list[int], eos: int, pad: int):
        self.tokenizer, self.sentinels, self.eos, self.pad = tokenizer, sentinels, int(eos), int(pad)

    @property
    def decoder_start(self) -> int:
        """T5 starts the decoder with the pad token."""
        return self.pad


def check_t5_tokenizer(spec: Any, cfg: Any = None) -> T5Vocab:
    """The tokenizer with its sentinels, eos and pad, or a :class:`DataError` naming what is missing."""
    tok = load_tokenizer(spec)
    sentinels = []
    while (i := tok.token_to_id(SENTINEL.format(len(sentinels)))) is not None:
        sentinels.append(int(i))
    hint = ("use data.tokenizer: demo-t5, a T5 tokenizer (its tokenizer.json has <extra_id_0> ... <extra_id_99>), "
            "or a SentencePiece .model (read as T5's, with 100 sentinels)")
    if not sentinels:
        raise DataError(str(spec), "the tokenizer has no sentinel tokens (<extra_id_0>, <extra_id_1>, ...): span "
                        "corruption replaces each masked span by one", hint)
    eos = tok.token_to_id("</s>")
    if eos is None:
        eos = tok.eod if tok.has_eod else None
    if eos is None:
        raise DataError(str(spec), "the tokenizer has no end-of-sequence token (</s> or its eos_token)", hint)
    pad = tok.pad
    if pad is None:
        raise DataError(str(spec), "the tokenizer has no padding token (<pad>)", hint)
    if cfg is not None:
        m, d = cfg.model, cfg.data
        _, _, spans = input_and_target_lengths(m.seq_length, d.noise_density, d.mean_noise_span_length)
        if spans > len(sentinels):
            raise DataError(str(spec), f"{len(sentinels)} sentinel tokens, but span corruption of {m.seq_length} tokens "
                            f"makes {spans} spans", "raise data.mean_noise_span_length or use a tokenizer with more sentinels")
        if tok.vocab_size > m.vocab_size:
            raise DataError(str(spec), f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size is {m.vocab_size}",
                            f"set model.vocab_size: {tok.vocab_size}")
    return T5Vocab(tok, sentinels, eos, pad)
