"""T5 generation: the encoder runs once, the decoder step by step with a static self-attention KV cache
and cross-attention keys / values computed once from the encoder output.

Like the decoder-only engine (:mod:`workbench.backend.decoding`), this runs the model's own modules and
parameters (embedding, each decoder layer's norms, ``linear_qkv`` / ``linear_q`` / ``linear_kv`` /
``linear_proj``, MLP, the final norm and the LM head with T5's scaling; tensor-parallel linears and
their collectives) and owns only attention over the caches:

* encoder: :meth:`WorkbenchT5Model.encode` over right-padded prompts (T5 pads on the right; the
  padding mask keeps pad keys out of every attention, as HF's ``attention_mask`` does);
* cross-attention: per decoder layer ``linear_kv(encoder output)`` once per request (``[n, heads/tp,
  s_enc, d]``), rows repeated per beam;
* self-attention: ``[n, heads/tp, 1 + max_new, d]`` per layer, written at the step's slot with
  ``index_copy_``; the decoder's relative position bias is one ``[heads/tp, L, L]`` table per request
  whose row ``t`` is picked with a tensor index, so a decode step has fixed shapes (CUDA graphs on one GPU);
* decoding: the GPT engine's :class:`SamplingDecoder` (greedy, top-k, top-p, temperature) and
  :class:`BeamSearchDecoder` (HF's beam search; the decoder "prompt" is the start token, so lengths and
  the length penalty count generated tokens exactly as HF's ``generate`` does for encoder-decoders).

No pipeline parallelism (T5 has none in megatron-core 0.19).  The returned engine has the GPT
engine's interface (``generate``, ``last_timing``, ``tokenizer``) so :func:`run_request` serves both.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from workbench.backend.decoding import (BeamSearchDecoder, GenerationOutput, GraphedDecode, KVCache, SamplingDecoder,
                                        decode_outputs)
from workbench.config import ConfigError

__all__ = ["T5Engine", "make_engine"]


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


class T5Engine:
    """Generates with a megatron-core T5 model (whole model on this rank; TP ranks run it together)."""

    def __init__(self, model: Any, vocab_size: int, tokenizer: Any = None, eos_id: int | None = None,
                 pad_id: int | None = None, decoder_start_id: int | None = None, cuda_graphs: bool | str = "auto"):
        model = _unwrap(model)
        half = torch.bfloat16 if getattr(model.config, "bf16", False) else torch.float16 if getattr(model.config, "fp16", False) else None
        if half is not None:
            model = model.to(half)
        self.model = model.eval()
        if getattr(model.config, "sequence_parallel", False):
            raise ValueError("generation runs without sequence parallelism: set parallel.sequence_parallel=false")
        self.vocab_size, self.tokenizer, self.eos_id = int(vocab_size), tokenizer, eos_id
        self.pad_id = 0 if pad_id is None else int(pad_id)
        self.start_id = self.pad_id if decoder_start_id is None else int(decoder_start_id)
        self.layers = list(model.decoder.layers)
        attn = self.layers[0].self_attention
        self.heads = attn.num_attention_heads_per_partition
        self.head_dim = attn.hidden_size_per_attention_head
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
        if cuda_graphs == "auto":
            cuda_graphs = self.device.type == "cuda" and self.tp == 1
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.sync_interval = 1 if self.device.type == "cpu" else 16
        self.last_timing: dict[str, float] = {}
        self._sessions: dict[tuple[int, int, int], dict[str, Any]] = {}

    # ---- pieces
    def _heads(self, x: Tensor) -> Tensor:
        """``[s, n, heads*d]`` -> ``[n, heads, s, d]``."""
        s, n = x.shape[0], x.shape[1]
        return x.view(s, n, self.heads, self.head_dim).permute(1, 2, 0, 3)

    def _merge(self, ctx: Tensor) -> Tensor:
        n, _, s, _ = ctx.shape
        return ctx.permute(2, 0, 1, 3).reshape(s, n, self.heads * self.head_dim)

    @staticmethod
    def _norm_out(out: Any) -> Tensor:
        return out[0] if isinstance(out, tuple) else out

    def _cross_kv(self, enc: Tensor) -> list[tuple[Tensor, Tensor]]:
        out = []
        for layer in self.layers:
            ca = layer.cross_attention
            kv, _ = ca.linear_kv(enc)  # [s, n, heads * 2d]: per head [k; v]
            s, n = kv.shape[0], kv.shape[1]
            kv = kv.view(s, n, self.heads, 2 * self.head_dim)
            k, v = kv[..., : self.head_dim], kv[..., self.head_dim:]
            out.append((k.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous()))
        return out

    def _step(self, tok: Tensor, step: Tensor, sess: dict[str, Any]) -> Tensor:
        """One decoder position for every row: tok ``[n, 1]`` at slot ``step`` -> logits ``[n, vocab]`` (fp32)."""
        cache: KVCache = sess["cache"]
        slot = step.view(1)
        cache.valid.index_fill_(1, slot, True)
        bias = sess["bias"].index_select(2, slot)  # [1, heads, 1, L]
        self_mask = bias.masked_fill(~cache.valid[:, None, None, :], float("-inf"))
        m = self.model
        x = m.embedding(input_ids=tok, position_ids=None)  # [1, n, h]
        for i, layer in enumerate(self.layers):
            normed = self._norm_out(layer.input_layernorm(x))
            q, k, v = layer.self_attention.get_query_key_value_tensors(normed, None)[:3]
            kc, vc = cache.keys[i], cache.values[i]
            kc.index_copy_(2, slot, k.permute(1, 2, 0, 3).to(kc.dtype))
            vc.index_copy_(2, slot, v.permute(1, 2, 0, 3).to(vc.dtype))
            ctx = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), kc, vc, attn_mask=self_mask, scale=1.0)
            out, b = layer.self_attention.linear_proj(self._merge(ctx))
            x = x + (out if b is None else out + b)
            normed = self._norm_out(layer.pre_cross_attn_layernorm(x))
            q, _ = layer.cross_attention.linear_q(normed)
            ck, cv = sess["cross"][i]
            ctx = F.scaled_dot_product_attention(self._heads(q), ck, cv, attn_mask=sess["enc_mask"], scale=1.0)
            out, b = layer.cross_attention.linear_proj(self._merge(ctx))
            x = x + (out if b is None else out + b)
            normed = self._norm_out(layer.pre_mlp_layernorm(x))
            out = layer.mlp(normed)
            if isinstance(out, tuple):
                out, b = out
                out = out if b is None else out + b
            x = x + out
        x = m.decoder.final_layernorm(x)
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits = m.lm_head(x, word_embeddings_weight=weight)
        if self.tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[0, :, : self.vocab_size].float()

    # ---- public
    def generate(self, prompts: Sequence[Sequence[int]], gen: Any, *, stop_ids: Sequence[int] | None = None,
                 early_stopping: bool | str = False, decode_text: bool = True) -> list[GenerationOutput]:
        """Encoder inputs (token-id lists, any lengths) -> generated decoder tokens, one output per prompt."""
        problems = gen.validate()
        if problems:
            raise ConfigError(problems)
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: give at least one token")
        return decode_outputs(self, prompts, gen, stop_ids, early_stopping, decode_text)

    def _session(self, n: int, L: int, S: int, cross: list[tuple[Tensor, Tensor]], enc_mask: Tensor) -> dict[str, Any]:
        """Static buffers for ``n`` rows, ``L`` decoder slots and ``S`` encoder tokens (kept for the next request of
        the same shape, so a captured decode graph is replayed, not re-captured); this request's cross-attention
        keys / values and encoder mask are copied in."""
        key = (n, L, S)
        sess = self._sessions.get(key)
        if sess is None:
            self._sessions = {}  # one live cache at a time: memory is the constraint
            sess = {"cache": KVCache(len(self.layers), n, self.heads, L, self.head_dim, self.dtype, self.device),
                    "cross": [(k.clone(), v.clone()) for k, v in cross], "enc_mask": enc_mask.clone(),
                    "bias": self.model.relative_bias("decoder", L, L).to(self.dtype), "graph": None}
            self._sessions[key] = sess
        else:
            for (kb, vb), (k, v) in zip(sess["cross"], cross):
                kb.copy_(k)
                vb.copy_(v)
            sess["enc_mask"].copy_(enc_mask)
        return sess

    def _generate(self, prompts: list[list[int]], gen: Any, stop_ids: list[int], early_stopping: Any) -> list:
        nb, B = int(gen.num_beams), len(prompts)
        n, max_new = B * nb, int(gen.max_new_tokens)
        S = max(len(p) for p in prompts)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        real = torch.zeros((B, S), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            real[i, : len(p)] = True
        ids, real = ids.to(self.device), real.to(self.device)
        enc = self.model.encode(ids, ~real[:, None, None, :])  # [S, B, h]
        if nb > 1:
            enc = enc.repeat_interleave(nb, dim=1)
            real = real.repeat_interleave(nb, dim=0)
        L = 1 + max_new
        sess = self._session(n, L, S, self._cross_kv(enc), real[:, None, None, :])
        cache: KVCache = sess["cache"]
        if nb > 1:
            decoder = BeamSearchDecoder(gen, B, 1, max_new, stop_ids, self.pad_id, self.device, early_stopping)
        else:
            decoder = SamplingDecoder(gen, n, max_new, stop_ids, self.pad_id, self.device)
        tok = torch.full((n, 1), self.start_id, dtype=torch.long, device=self.device)
        step = torch.zeros((), dtype=torch.long, device=self.device)
        fn = lambda t, s: self._step(t, s, sess)  # noqa: E731
        if self.cuda_graphs and sess["graph"] is None:
            try:
                sess["graph"] = GraphedDecode(fn, tok.clone(), step.clone())
            except Exception as e:  # capture is an optimisation: fall back to eager, loudly
                print(f"[t5 generate] CUDA graph capture failed ({type(e).__name__}: {e}); decoding eagerly", file=sys.stderr)
                self.cuda_graphs = False
        graph = sess["graph"] if self.cuda_graphs else None
        cache.valid.zero_()  # a new request (and the capture's warm-up steps wrote slot 0)
        for t in range(max_new):
            if graph is not None:
                logits = graph(tok, t)
            else:
                step.fill_(t)
                logits = fn(tok, step)
            nxt, reorder = decoder.step(logits, t)
            if t == max_new - 1 or ((nb > 1 or (t + 1) % self.sync_interval == 0) and decoder.finished()):
                break
            if reorder is not None:
                cache.reorder(reorder)
            tok = nxt.view(-1, 1)
        return decoder.results()


def make_engine(model: Any, cfg: Any, tokenizer: Any, ids: dict[str, Any], cuda_graphs: bool | str = "auto") -> T5Engine:
    """The engine :func:`workbench.rank.inference.load_engine` returns for a T5 checkpoint."""
    pad = ids.get("pad")
    return T5Engine(model, vocab_size=cfg.model.vocab_size, tokenizer=tokenizer, eos_id=ids.get("eos"),
                    pad_id=pad if pad is not None else 0, cuda_graphs=cuda_graphs)
