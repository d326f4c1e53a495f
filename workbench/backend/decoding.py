"""Decoding on one rank's model stage: KV cache, sampling, beam search, TP and PP; the decoder-only engine.

megatron-core 0.19 has no beam search, and its static KV cache slices the cache to the
current length every step (dynamic shapes: no CUDA graphs, no cache reordering for
beams, no per-sequence padding masks).  So this engine runs the *model's own modules*
(embedding, each layer's norms / QKV / projection / MLP, final norm, output layer — the
same parameters, the same tensor-parallel linear layers and their collectives) and owns
only the attention-over-cache step:

* a static KV cache ``[batch, kv_groups, max_len, head_dim]`` per local layer, written
  with ``index_copy_`` at a slot held in a tensor, so the decode step has fixed shapes
  and can be captured in a CUDA graph (no per-token host syncs);
* left padding with a validity mask, so prompts of different lengths share one batch,
  each sequence keeping its own positions (as HF ``generate`` does);
* cache reordering for beam search (``index_select`` on the batch dimension);
* pipeline stages exchange hidden states stage to stage; the last stage decides the
  next tokens (and beam reordering) and broadcasts them to the other stages.

Decoding follows two references: greedy / top-k / top-p (with Megatron's decay and
bound) / temperature as in Megatron-LM's ``megatron_generate``; beam search exactly as
HF transformers' vectorised ``_beam_search`` (``length_penalty``, default
``early_stopping=False`` heuristic), for any batch size.

The families' generation parts build their engines from these blocks (GPT: :class:`InferenceEngine`,
T5: :mod:`workbench.models.t5.generate`); the entry point that loads a checkpoint and asks its family for the
engine is :mod:`workbench.rank.inference`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from workbench.config import ConfigError
from workbench.data.tokenizer import decode_visible


__all__ = [
    "GenerationOutput",
    "InferenceEngine",
    "KVCache",
    "StageRunner",
    "SamplingDecoder",
    "BeamSearchDecoder",
    "GraphedDecode",
    "decode_outputs",
    "left_pad",
    "filter_top_k",
    "filter_top_p",
    "dist_ready",
    "pp_info",
]


# --------------------------------------------------------------------------- results


@dataclass
class GenerationOutput:
    """One prompt's result: ids and text of the generated continuation (prompt excluded)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    #: "stop" (EOS / stop token generated, included in token_ids) or "length".
    finish_reason: str = "length"
    #: log-probability of each generated token under the model's raw (untempered) distribution.
    log_probs: list[float] | None = None
    #: beam search: the length-penalised score HF reports as ``sequences_scores``.
    score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- helpers


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def pp_info() -> tuple[int, int]:
    """(pipeline rank, pipeline size); (0, 1) when model parallel is not initialised."""
    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Left-pad token lists to one width: (tokens [b, P], valid mask [b, P])."""
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            valid[i, width - len(p):] = True
    return tokens.to(device), valid.to(device)


def filter_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Keep the k largest logits (Megatron's ``modify_logits_for_top_k_filtering``)."""
    kth = torch.topk(logits, top_k, dim=-1)[0][..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Nucleus filter (Megatron's ``modify_logits_for_top_p_filtering``): keep the smallest
    set of tokens whose cumulative probability reaches ``top_p``; the top token always stays."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum > top_p
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    drop = drop.scatter(-1, sorted_idx, drop)
    return logits.masked_fill(drop, float("-inf"))


# --------------------------------------------------------------------------- KV cache


class KVCache:
    """Static per-layer key/value buffers plus a per-row validity mask over cache slots."""

    def __init__(self, num_layers: int, batch: int, groups: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, groups, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.valid = torch.zeros((batch, max_len), dtype=torch.bool, device=device)
        self.batch, self.max_len = batch, max_len

    def reorder(self, rows: Tensor) -> None:
        """Beam search: row i becomes old row ``rows[i]`` (in place: CUDA graphs keep their pointers)."""
        for buf in self.keys + self.values:
            buf.copy_(buf.index_select(0, rows))
        self.valid.copy_(self.valid.index_select(0, rows))


# --------------------------------------------------------------------------- the stage forward


class StageRunner:
    """Runs this pipeline stage of a megatron-core ``GPTModel`` against a :class:`KVCache`.

    Uses the model's modules and parameters as they are; replaces only core attention by
    SDPA over the cache.  ``forward`` returns gathered last-position logits (float32,
    ``[b, vocab]``) on the last stage and the hidden states ``[s, b, h]`` elsewhere.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        self.pre_process = bool(getattr(model, "pre_process", True))
        self.post_process = bool(getattr(model, "post_process", True))
        cfg = model.config
        self.config = cfg
        if getattr(cfg, "apply_residual_connection_post_layernorm", False):
            raise NotImplementedError("generation: apply_residual_connection_post_layernorm is not supported")
        if getattr(cfg, "attention_output_gate", False):
            raise NotImplementedError("generation: gated attention is not supported")
        if getattr(cfg, "sequence_parallel", False):
            raise ValueError("generation runs without sequence parallelism: set parallel.sequence_parallel=false")
        self.layers = list(model.decoder.layers)
        first_attn = self.layers[0].self_attention if self.layers else None
        self.head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        self.heads = first_attn.num_attention_heads_per_partition if first_attn else 0
        self.groups = first_attn.num_query_groups_per_partition if first_attn else 0
        self.softmax_scale = getattr(cfg, "softmax_scale", None)
        self.position_type = getattr(model, "position_embedding_type", "learned_absolute")
        if self.position_type not in ("learned_absolute", "rope", "none"):
            raise NotImplementedError(f"generation: position embedding '{self.position_type}' is not supported")
        self._rope_table: Tensor | None = None
        self.alibi_slopes: Tensor | None = None
        if getattr(cfg, "workbench_alibi", False):
            from workbench.backend.attention import alibi_slopes

            tp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
            slopes = alibi_slopes(cfg.num_attention_heads)
            self.alibi_slopes = slopes[tp_rank * self.heads:(tp_rank + 1) * self.heads]
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        if self.alibi_slopes is not None:
            self.alibi_slopes = self.alibi_slopes.to(self.device)
        if self.position_type == "rope":
            # the whole table up front: no host sync (or allocation) inside a captured decode step
            length = int(getattr(model, "max_sequence_length", 0) or 0)
            self._rope_table = model.rotary_pos_emb(length)[:, 0, 0, :].to(self.device)  # [L, dim]

    # ---- pieces
    def rope_freqs(self, positions: Tensor) -> Tensor | None:
        """Rotary frequencies for per-sequence positions ``[s, b]`` -> ``[s, b, 1, dim]``."""
        if self.position_type != "rope":
            return None
        return self._rope_table[positions].unsqueeze(2)

    def _attention(self, layer, x: Tensor, layer_idx: int, cache: KVCache, slots: Tensor,
                   mask: Tensor, freqs: Tensor | None) -> Tensor:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        attn = layer.self_attention
        q, k, v = attn.get_query_key_value_tensors(x, None)[:3]  # [s, b, heads, d], [s, b, groups, d]
        if freqs is not None:
            q = apply_rotary_pos_emb(q, freqs, self.config)
            k = apply_rotary_pos_emb(k, freqs, self.config)
        kc, vc = cache.keys[layer_idx], cache.values[layer_idx]
        kc.index_copy_(2, slots, k.permute(1, 2, 0, 3).to(kc.dtype))
        vc.index_copy_(2, slots, v.permute(1, 2, 0, 3).to(vc.dtype))
        qb = q.permute(1, 2, 0, 3)  # [b, heads, s, d]
        keys, values = kc, vc
        if self.heads != self.groups:
            rep = self.heads // self.groups
            keys = keys.repeat_interleave(rep, dim=1)
            values = values.repeat_interleave(rep, dim=1)
        if self.alibi_slopes is not None:  # -slope * (query slot - key slot): slots are positions within a row
            dist_ = slots.view(1, -1, 1) - torch.arange(kc.shape[2], device=kc.device).view(1, 1, -1)
            bias = -self.alibi_slopes.view(-1, 1, 1) * dist_.float()
            mask = torch.where(mask, 0.0, float("-inf")).to(qb.dtype) + bias.to(qb.dtype)[None]
        ctx = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=self.softmax_scale)
        s, b = x.shape[0], x.shape[1]
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        out, bias = attn.linear_proj(ctx)
        return out if bias is None else out + bias

    def _layer(self, layer, h: Tensor, idx: int, cache: KVCache, slots: Tensor, mask: Tensor,
               freqs: Tensor | None) -> Tensor:
        normed = layer.input_layernorm(h)
        residual = h
        if isinstance(normed, tuple):
            normed, residual = normed
        h = residual + self._attention(layer, normed, idx, cache, slots, mask, freqs)
        normed = layer.pre_mlp_layernorm(h)
        residual = h
        if isinstance(normed, tuple):
            normed, residual = normed
        out = layer.mlp(normed)
        if isinstance(out, tuple):
            out, bias = out
            if bias is not None:
                out = out + bias
        return residual + out

    # ---- whole stage
    def forward(self, tokens: Tensor | None, hidden: Tensor | None, positions: Tensor, cache: KVCache,
                slots: Tensor, mask: Tensor) -> Tensor:
        """tokens/positions ``[b, s]``; slots ``[s]`` cache columns to write; mask ``[b, 1, s, L]`` (True = attend)."""
        if self.pre_process:
            h = self.model.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        else:
            h = hidden
        freqs = self.rope_freqs(positions.t())
        for i, layer in enumerate(self.layers):
            h = self._layer(layer, h, i, cache, slots, mask, freqs)
        if not self.post_process:
            return h
        h = self.model.decoder.final_layernorm(h[-1:]) if getattr(self.model.decoder, "final_layernorm", None) is not None else h[-1:]
        weight = self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights else None
        logits, _ = self.model.output_layer(h, weight=weight)
        if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[0, :, : self.vocab_size].float()


# --------------------------------------------------------------------------- decoders


class SamplingDecoder:
    """Greedy / top-k / top-p (+ decay, bound) / temperature, Megatron semantics; seeded."""

    def __init__(self, gen, n: int, max_new: int, stop_ids: list[int], pad_id: int, device: torch.device):
        self.gen = gen
        self.greedy = bool(gen.greedy) or gen.top_k == 1
        self.top_p = float(gen.top_p)
        self.stop = torch.tensor(stop_ids or [-1], dtype=torch.long, device=device)
        self.pad_id = pad_id
        self.done = torch.zeros(n, dtype=torch.bool, device=device)
        self.tokens = torch.full((n, max_new), pad_id, dtype=torch.long, device=device)
        self.log_probs = torch.zeros((n, max_new), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(n, dtype=torch.long, device=device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(gen.seed))

    def step(self, logits: Tensor, t: int) -> tuple[Tensor, Tensor | None]:
        """-> (next input token per row, cache reorder rows or None)."""
        if self.greedy:
            tok = torch.argmax(logits, dim=-1)
        else:
            work = logits / self.gen.temperature if self.gen.temperature != 1.0 else logits
            if self.gen.top_k > 1:
                work = filter_top_k(work, self.gen.top_k)
            elif self.top_p > 0.0:
                work = filter_top_p(work, self.top_p)
            probs = work.softmax(dim=-1)
            tok = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            if self.top_p > 0.0 and self.gen.top_p_decay > 0.0:
                self.top_p = self.top_p * self.gen.top_p_decay
                if self.gen.top_p_bound > 0.0:
                    self.top_p = max(self.top_p, self.gen.top_p_bound)
        if self.gen.return_log_probs:
            lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None]).squeeze(1)
            self.log_probs[:, t] = torch.where(self.done, torch.zeros_like(lp), lp)
        tok = torch.where(self.done, torch.full_like(tok, self.pad_id), tok)
        self.tokens[:, t] = tok
        self.lengths += (~self.done).long()
        self.done |= torch.isin(tok, self.stop)
        return tok, None

    def finished(self) -> bool:
        return bool(self.done.all())

    def results(self) -> list[tuple[list[int], str, list[float] | None, float | None]]:
        toks, lens, done = self.tokens.cpu(), self.lengths.cpu(), self.done.cpu()
        lps = self.log_probs.cpu() if self.gen.return_log_probs else None
        out = []
        for i in range(toks.shape[0]):
            n = int(lens[i])
            out.append((toks[i, :n].tolist(), "stop" if bool(done[i]) else "length",
                        lps[i, :n].tolist() if lps is not None else None, None))
        return out


class BeamSearchDecoder:
    """HF transformers' vectorised beam search (``GenerationMixin._beam_search``), batch >= 1.

    Same candidate count (``max(2, 1 + n_eos) * num_beams``), same length penalty
    (``score / generated_len ** length_penalty``), same ``early_stopping=False`` heuristic,
    so outputs are token-identical to ``model.generate(num_beams=..., do_sample=False)``.
    """

    def __init__(self, gen, batch: int, prompt_width: int, max_new: int, stop_ids: list[int], pad_id: int,
                 device: torch.device, early_stopping: bool | str = False):
        nb = int(gen.num_beams)
        self.gen, self.batch, self.nb, self.device = gen, batch, nb, device
        self.P, self.max_new = prompt_width, max_new
        self.max_length = prompt_width + max_new
        self.early_stopping = early_stopping
        self.length_penalty = float(gen.length_penalty)
        self.stop = torch.tensor(stop_ids or [-1], dtype=torch.long, device=device)
        n_eos = len(stop_ids)
        self.keep = max(2, 1 + n_eos) * nb
        self.top_mask = torch.cat([torch.ones(nb, dtype=torch.bool), torch.zeros(self.keep - nb, dtype=torch.bool)]).to(device)
        fill = pad_id
        # generated part only (HF keeps the prompt too; it never changes, so we drop it)
        self.running = torch.full((batch, nb, max_new), fill, dtype=torch.long, device=device)
        self.running_lp = torch.zeros((batch, nb, max_new), dtype=torch.float32, device=device)
        self.seqs = self.running.clone()
        self.seqs_lp = self.running_lp.clone()
        self.running_scores = torch.zeros((batch, nb), dtype=torch.float32, device=device)
        self.running_scores[:, 1:] = -1e9
        self.scores = torch.full((batch, nb), -1e9, dtype=torch.float32, device=device)
        self.running_len = torch.zeros((batch, nb), dtype=torch.long, device=device)
        self.seq_len = torch.zeros((batch, nb), dtype=torch.long, device=device)
        self.finished_mask = torch.zeros((batch, nb), dtype=torch.bool, device=device)
        self.heuristic_unsat = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self.hits = torch.zeros((batch, nb), dtype=torch.bool, device=device)
        self._stop_now = False

    @staticmethod
    def _gather(t: Tensor, idx: Tensor) -> Tensor:
        while idx.dim() < t.dim():
            idx = idx.unsqueeze(-1)
        return torch.take_along_dim(t, idx, dim=1)

    def step(self, logits: Tensor, t: int) -> tuple[Tensor, Tensor]:
        B, nb = self.batch, self.nb
        V = logits.shape[-1]
        cur_len = self.P + t  # HF's cur_len before this token
        raw_lp = torch.log_softmax(logits, dim=-1).view(B, nb, V)
        acc = (raw_lp + self.running_scores[:, :, None]).reshape(B, nb * V)
        topk_lp, topk_idx = torch.topk(acc, k=self.keep, dim=-1)
        beam_src = topk_idx // V
        ids = topk_idx % V
        cand = self._gather(self.running, beam_src)
        cand[:, :, t] = ids
        cand_lp = self._gather(self.running_lp, beam_src)
        cand_lp[:, :, t] = self._gather(raw_lp.reshape(B, nb * V), topk_idx)
        cand_len = self._gather(self.running_len, beam_src) + 1
        rows = beam_src + torch.arange(B, device=self.device)[:, None] * nb  # flat cache rows
        hits = torch.isin(ids, self.stop)
        if cur_len + 1 >= self.max_length:
            hits = torch.ones_like(hits)
        # running beams for the next step
        run_lp = topk_lp + hits.float() * -1.0e9
        nxt = torch.topk(run_lp, k=nb, dim=-1)[1]
        self.running = self._gather(cand, nxt)
        self.running_lp = self._gather(cand_lp, nxt)
        self.running_len = self._gather(cand_len, nxt)
        self.running_scores = self._gather(run_lp, nxt)
        reorder = self._gather(rows, nxt).reshape(-1)
        # finished hypotheses
        just = hits & self.top_mask[None, :]
        fin = topk_lp / ((cur_len + 1 - self.P) ** self.length_penalty)
        full = torch.all(self.finished_mask, dim=-1, keepdim=True) & (self.early_stopping is True)
        fin = fin + full.float() * -1.0e9
        fin = fin + (~self.heuristic_unsat).float() * -1.0e9
        fin = fin + (~just).float() * -1.0e9
        m_seq = torch.cat([self.seqs, cand], dim=1)
        m_lp = torch.cat([self.seqs_lp, cand_lp], dim=1)
        m_len = torch.cat([self.seq_len, cand_len], dim=1)
        m_scores = torch.cat([self.scores, fin], dim=1)
        m_fin = torch.cat([self.finished_mask, just], dim=1)
        best = torch.topk(m_scores, k=nb, dim=-1)[1]
        self.seqs, self.seqs_lp, self.seq_len = self._gather(m_seq, best), self._gather(m_lp, best), self._gather(m_len, best)
        self.scores, self.finished_mask = self._gather(m_scores, best), self._gather(m_fin, best)
        # early-stop heuristic (HF, early_stopping False / True / "never")
        new_len = cur_len + 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.P
        else:
            best_len = new_len - self.P
        best_running = self.running_scores[:, :1] / (best_len ** self.length_penalty)
        worst_fin = torch.where(self.finished_mask, torch.min(self.scores, dim=1, keepdim=True)[0], -1.0e9)
        self.heuristic_unsat = self.heuristic_unsat & torch.any(best_running > worst_fin, dim=-1, keepdim=True)
        self.hits = hits
        next_tokens = self.running[:, :, t].reshape(-1)
        return next_tokens, reorder

    def finished(self) -> bool:
        improvement = bool(torch.any(self.heuristic_unsat))
        open_beam = not (bool(torch.all(self.finished_mask)) and self.early_stopping is True)
        valid = not bool(torch.all(self.hits))
        return not (improvement and open_beam and valid)

    def results(self) -> list[tuple[list[int], str, list[float] | None, float | None]]:
        seqs, lens, lps, scores = self.seqs.cpu(), self.seq_len.cpu(), self.seqs_lp.cpu(), self.scores.cpu()
        stop = set(self.stop.tolist())
        out = []
        for b in range(self.batch):
            n = int(lens[b, 0])
            toks = seqs[b, 0, :n].tolist()
            reason = "stop" if toks and toks[-1] in stop else "length"
            out.append((toks, reason, lps[b, 0, :n].tolist() if self.gen.return_log_probs else None, float(scores[b, 0])))
        return out


# --------------------------------------------------------------------------- engine


class GraphedDecode:
    """A CUDA graph of one decode step (stage forward for one token) with static buffers."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], tok: Tensor, step: Tensor):
        self.tok, self.step = tok, step
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(self.tok, self.step)
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(self.tok, self.step)

    def __call__(self, tok: Tensor, step: int) -> Tensor:
        self.tok.copy_(tok.view_as(self.tok))
        self.step.fill_(step)
        self.graph.replay()
        return self.out


def decode_outputs(engine: Any, prompts: list[list[int]], gen: Any, stop_ids: Sequence[int] | None,
                   early_stopping: bool | str, decode_text: bool) -> list[GenerationOutput]:
    """What every engine's ``generate`` does once its prompts are checked: the stop ids (default the
    engine's EOS id plus ``gen.stop_token``), ``engine._generate(prompts, gen, stop_ids, early_stopping)``
    under ``inference_mode`` timed into ``engine.last_timing``, and one :class:`GenerationOutput` per prompt
    (text through ``decode_visible`` when ``decode_text`` and the engine has a tokenizer).

    ``_generate`` returns one ``(token_ids, finish_reason, log_probs, score)`` per prompt, or None on a rank
    that does not decide the tokens (a pipeline stage before the last): its outputs are empty.
    """
    if stop_ids is None:
        stop_ids = [x for x in (engine.eos_id, gen.stop_token) if x is not None]
    stop_ids = sorted(set(int(x) for x in stop_ids))
    t0 = time.perf_counter()
    with torch.inference_mode():
        decoded = engine._generate(prompts, gen, stop_ids, early_stopping)
    engine.last_timing = {"seconds": time.perf_counter() - t0}
    outs = []
    for p, (toks, reason, lps, score) in zip(prompts, decoded or [([], "length", None, None)] * len(prompts)):
        text = None
        if decode_text and engine.tokenizer is not None and decoded is not None:
            text = decode_visible(engine.tokenizer, toks)  # ids past the tokenizer show as <id:N>, not as nothing
        outs.append(GenerationOutput(prompt_ids=p, token_ids=toks, text=text, finish_reason=reason,
                                     log_probs=lps, score=score))
    return outs


class InferenceEngine:
    """Generates with one pipeline stage of a megatron-core GPT model (all stages run it together).

    ``vocab_size`` is the tokenizer's (unpadded) vocabulary: logits beyond it (Megatron's
    vocab padding, which depends on TP) are dropped, so sampling draws the same random
    numbers at every TP size.
    """

    def __init__(self, model: torch.nn.Module, vocab_size: int, max_positions: int,
                 tokenizer: Any = None, eos_id: int | None = None, pad_id: int | None = None, bos_id: int | None = None,
                 cuda_graphs: bool | str = "auto", sync_interval: int = 16):
        while hasattr(model, "module") and not hasattr(model, "decoder"):  # DDP / Float16Module wrappers
            model = model.module
        half = torch.bfloat16 if getattr(model.config, "bf16", False) else torch.float16 if getattr(model.config, "fp16", False) else None
        if half is not None and any(p.dtype != half for p in model.parameters()):
            model.to(half)  # what Float16Module does: mcore keeps e.g. position embeddings in fp32
        model.eval()
        self.model = model
        self.runner = StageRunner(model, vocab_size)
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.tokenizer = tokenizer
        if eos_id is None and tokenizer is not None:
            eos_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_id = eos_id
        self.bos_id = bos_id if bos_id is not None else getattr(tokenizer, "bos_token_id", None)
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        self.device = self.runner.device
        tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        _, pp = pp_info()
        if cuda_graphs == "auto":
            cuda_graphs = self.device.type == "cuda" and tp * pp == 1
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        #: how often (decode steps) to check on the host whether every row has stopped.
        self.sync_interval = 1 if self.device.type == "cpu" else max(1, sync_interval)
        self._sessions: dict[tuple[int, int], dict[str, Any]] = {}
        self.last_timing: dict[str, float] = {}

    # ---- public
    def generate(self, prompts: Sequence[Sequence[int]], gen, *, stop_ids: Sequence[int] | None = None,
                 early_stopping: bool | str = False, decode_text: bool = True) -> list[GenerationOutput]:
        """Generate for a batch of token-id prompts (any lengths). Returns one output per prompt.

        ``stop_ids`` defaults to the EOS id plus ``gen.stop_token``.
        """
        problems = gen.validate()
        if problems:
            raise ConfigError(problems)
        prompts = [list(p) for p in prompts]
        if gen.add_bos:
            bos = self.bos_id if self.bos_id is not None else self.eos_id
            if bos is None:
                raise ValueError("add_bos: the tokenizer has no BOS (or EOS) token id")
            prompts = [[bos] + p for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: give at least one token")
            if len(p) + gen.max_new_tokens > self.max_positions:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={gen.max_new_tokens} that exceeds "
                                 f"the model's {self.max_positions} positions: shorten the prompt or lower max_new_tokens")
        return decode_outputs(self, prompts, gen, stop_ids, early_stopping, decode_text)

    # ---- internals
    def _session(self, n: int, max_len: int) -> dict[str, Any]:
        key = (n, max_len)
        if key not in self._sessions:
            self._sessions.clear()  # one live cache at a time: memory is the constraint
            r = self.runner
            cache = KVCache(len(r.layers), n, r.groups, max_len, r.head_dim, r.dtype, self.device)
            self._sessions[key] = {"cache": cache, "graph": None,
                                   "tok": torch.zeros((n, 1), dtype=torch.long, device=self.device),
                                   "step": torch.zeros((), dtype=torch.long, device=self.device),
                                   "base_pos": torch.zeros(n, dtype=torch.long, device=self.device),
                                   "P": torch.zeros((), dtype=torch.long, device=self.device)}
        return self._sessions[key]

    def _decode_fn(self, sess: dict[str, Any]) -> Callable[[Tensor, Tensor], Tensor]:
        cache: KVCache = sess["cache"]

        def fn(tok: Tensor, step: Tensor) -> Tensor:
            slot = (sess["P"] + step).view(1)
            cache.valid.index_fill_(1, slot, True)
            pos = (sess["base_pos"] + step).view(-1, 1)
            mask = cache.valid[:, None, None, :]
            return self.runner.forward(tok, None, pos, cache, slot, mask)

        return fn

    def _stage_call(self, tokens: Tensor | None, positions: Tensor, cache: KVCache, slots: Tensor,
                    mask: Tensor, shape: tuple[int, int]) -> Tensor | None:
        """Run this stage, exchanging hidden states with neighbours. Returns logits on the last stage."""
        pp_rank, pp = pp_info()
        hidden = None
        if pp > 1 and pp_rank > 0:
            s, b = shape
            hidden = torch.empty((s, b, self.model.config.hidden_size), dtype=self.runner.dtype, device=self.device)
            torch.distributed.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        out = self.runner.forward(tokens if pp_rank == 0 else None, hidden, positions, cache, slots, mask)
        if pp > 1 and pp_rank < pp - 1:
            torch.distributed.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return None
        return out

    def _broadcast_decision(self, tok: Tensor | None, reorder: Tensor | None, done: bool, n: int) -> tuple[Tensor, Tensor | None, bool]:
        """Last pipeline stage -> every stage: next tokens, beam reordering, stop flag."""
        pp_rank, pp = pp_info()
        if pp == 1:
            return tok, reorder, done
        buf = torch.zeros(2 * n + 2, dtype=torch.long, device=self.device)
        if pp_rank == pp - 1:
            buf[:n] = tok
            if reorder is not None:
                buf[n:2 * n] = reorder
                buf[2 * n] = 1
            buf[2 * n + 1] = int(done)
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(buf, src=src, group=parallel_state.get_pipeline_model_parallel_group())
        tok = buf[:n].clone()
        reorder = buf[n:2 * n].clone() if bool(buf[2 * n]) else None
        return tok, reorder, bool(buf[2 * n + 1])

    def _generate(self, prompts: list[list[int]], gen, stop_ids: list[int], early_stopping) -> list | None:
        pp_rank, pp = pp_info()
        last = pp_rank == pp - 1
        nb = int(gen.num_beams)
        B = len(prompts)
        n = B * nb
        tokens, valid = left_pad(prompts, self.pad_id, self.device)
        P = tokens.shape[1]
        max_new = int(gen.max_new_tokens)
        L = P + max_new
        if nb > 1:
            tokens = tokens.repeat_interleave(nb, dim=0)
            valid = valid.repeat_interleave(nb, dim=0)
        sess = self._session(n, L)
        cache: KVCache = sess["cache"]
        cache.valid.zero_()
        cache.valid[:, :P] = valid
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        sess["base_pos"].copy_(valid.long().sum(-1))
        sess["P"].fill_(P)
        # prefill: causal over the prompt, padding keys masked, each query always sees itself
        q_idx = torch.arange(P, device=self.device)
        k_idx = torch.arange(L, device=self.device)
        causal = k_idx[None, :] <= q_idx[:, None]
        mask = (causal[None] & cache.valid[:, None, :]) | (k_idx[None, None, :] == q_idx[None, :, None])
        logits = self._stage_call(tokens, positions, cache, q_idx, mask[:, None], (P, n))

        decoder = None
        if last:
            if nb > 1:
                decoder = BeamSearchDecoder(gen, B, P, max_new, stop_ids, self.pad_id, self.device, early_stopping)
            else:
                decoder = SamplingDecoder(gen, n, max_new, stop_ids, self.pad_id, self.device)
        decode = self._decode_fn(sess)
        if self.cuda_graphs and sess["graph"] is None:
            try:
                sess["graph"] = GraphedDecode(decode, sess["tok"], sess["step"])
            except Exception as e:  # capture is an optimisation: fall back to eager, loudly
                print(f"[inference] CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", file=sys.stderr)
                self.cuda_graphs = False
                torch.cuda.synchronize()
        graph = sess["graph"] if self.cuda_graphs else None
        if graph is not None:  # capture warm-up wrote a decode slot: forget it
            cache.valid[:, P:] = False

        for t in range(max_new):
            tok = reorder = None
            done = False
            if last:
                tok, reorder = decoder.step(logits, t)
                if t == max_new - 1:
                    done = True
                elif nb > 1 or (t + 1) % self.sync_interval == 0:
                    done = decoder.finished()
            tok, reorder, done = self._broadcast_decision(tok, reorder, done, n)
            if done:
                break
            if reorder is not None:
                cache.reorder(reorder)
            if graph is not None:
                logits = graph(tok, t)
            else:
                sess["step"].fill_(t)
                if pp > 1:
                    slot = (sess["P"] + sess["step"]).view(1)
                    cache.valid.index_fill_(1, slot, True)
                    pos = (sess["base_pos"] + sess["step"]).view(-1, 1)
                    logits = self._stage_call(tok.view(-1, 1), pos, cache, slot, cache.valid[:, None, None, :], (1, n))
                else:
                    logits = decode(tok.view(-1, 1), sess["step"])
        result = decoder.results() if last else None
        if pp > 1:
            obj = [result]
            torch.distributed.broadcast_object_list(obj, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                                    group=parallel_state.get_pipeline_model_parallel_group())
            result = obj[0]
        return result
