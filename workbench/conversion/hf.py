"""Hugging Face GPT-2 / Llama <-> megatron-core: configs and full (unsharded) state dicts.

Pure torch: no megatron import.  The megatron side is the *full* state dict of a
TP=1/PP=1 ``GPTModel`` (stock names: ``embedding.word_embeddings.weight``,
``decoder.layers.<i>.self_attention.linear_qkv.weight``, ...).  That is enough for any
layout, because a dist checkpoint stores global tensors and megatron itself shards
them per TP rank: the fused QKV rows are per query group ``[q_g (heads/groups x d),
k_g (d), v_g (d)]`` concatenated over groups, so a contiguous TP split hands every rank
whole groups; ``linear_fc1`` of SwiGLU is ``cat[gate, up]`` and mcore's checkpoint
factory keeps that global order at any TP.

Conventions checked numerically by the tests (HF logits == mcore logits at TP=2/PP=2):
- GPT-2 ``Conv1D`` weights are ``[in, out]``: transposed to mcore's ``[out, in]``;
  ``c_attn`` is ``[q | k | v]`` and is regrouped per head.
- HF Llama q/k are in the rotate-half RoPE convention, which is mcore's default
  (``rotary_interleaved=False``), so no permutation is needed.
- vocab: padded on import to :func:`workbench.config.derive`'s size; pad rows are the
  mean of the real rows (so padded logits never dominate the softmax, unlike zero rows
  under all-negative logits), and are stripped on export.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterable

from workbench.config import ModelConfig, RunConfig, derive

__all__ = [
    "ConversionError",
    "SUPPORTED_MODEL_TYPES",
    "read_hf_config",
    "run_config_from_hf",
    "hf_config_dict_from_run",
    "infer_model_type",
    "hf_to_mcore",
    "mcore_to_hf",
    "load_hf_state_dict",
    "save_hf_state_dict",
    "parse_size",
    "pad_vocab_rows",
    "TOKENIZER_FILES",
]

SUPPORTED_MODEL_TYPES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")
_GELU_TANH = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}


class ConversionError(ValueError):
    """Bad conversion input: the message names the file / field and the fix."""


# --------------------------------------------------------------------------- configs


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """config.json of a local HF model directory, as a dict (no network, no transformers import)."""
    p = Path(hf_dir).expanduser()
    if not p.is_dir():
        raise ConversionError(f"--hf {p}: not a directory -> pass a local Hugging Face model directory (config.json + weights)")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ConversionError(f"{p}: no config.json -> save the model with model.save_pretrained(DIR) first")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{cfg}: not valid JSON ({e})") from None
    mt = data.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"{cfg}: model_type {mt!r} is not supported -> supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED_MODEL_TYPES.items())}")
    return data


def _rope_theta(hf: dict) -> float:
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    rtype = (rp.get("rope_type") if isinstance(rp, dict) else None) or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rtype not in (None, "default"):
        raise ConversionError(f"config.json: RoPE scaling {rtype!r} is not supported by the workbench model -> only plain RoPE (rope_type 'default')")
    theta = (rp.get("rope_theta") if isinstance(rp, dict) else None) or hf.get("rope_theta") or 10000.0
    return float(theta)


def run_config_from_hf(hf: dict[str, Any], base: RunConfig | None = None, tp: int = 1, pp: int = 1,
                       vpp: int | None = None, dtype: str | None = None,
                       make_vocab_size_divisible_by: int | None = None) -> RunConfig:
    """The workbench RunConfig implied by an HF config, with the requested layout (not yet validated)."""
    mt = hf.get("model_type")
    d = (base or RunConfig(name=f"{mt}-converted")).to_dict()
    m = d["model"]
    if mt == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in _GELU_TANH | {"gelu"}:
            raise ConversionError(f"config.json: activation_function {act!r} is not supported -> gelu or gelu_new")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            raise ConversionError("config.json: GPT-2 attention scaling variants (scale_attn_weights=false / "
                                  "scale_attn_by_inverse_layer_idx) have no megatron-core equivalent")
        h = int(hf["n_embd"])
        m.update(
            num_layers=int(hf["n_layer"]), hidden_size=h, num_attention_heads=int(hf["n_head"]),
            attention_type="multihead", num_query_groups=None, ffn_hidden_size=int(hf.get("n_inner") or 4 * h),
            kv_channels=None, vocab_size=int(hf["vocab_size"]), max_position_embeddings=int(hf["n_positions"]),
            seq_length=min(int(hf["n_positions"]), m.get("seq_length") or 1024), position_embedding="learned",
            normalization="layernorm", norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)), activation="gelu",
            gelu_approximate="tanh" if act in _GELU_TANH else "none", add_bias_linear=True,
            hidden_dropout=float(hf.get("resid_pdrop", 0.0)), attention_dropout=float(hf.get("attn_pdrop", 0.0)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), init_method_std=float(hf.get("initializer_range", 0.02)),
        )
    elif mt == "llama":
        if hf.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"config.json: hidden_act {hf.get('hidden_act')!r} is not supported -> Llama's silu (SwiGLU)")
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            raise ConversionError("config.json: attention_bias and mlp_bias differ; the workbench model has one add_bias_linear switch -> "
                                  "only models with both or neither are supported")
        h, a = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        g = int(hf.get("num_key_value_heads") or a)
        head_dim = int(hf.get("head_dim") or h // a)
        m.update(
            num_layers=int(hf["num_hidden_layers"]), hidden_size=h, num_attention_heads=a,
            attention_type="multihead" if g == a else ("multiquery" if g == 1 else "grouped"),
            num_query_groups=g if g not in (1, a) else None, ffn_hidden_size=int(hf["intermediate_size"]),
            kv_channels=head_dim if head_dim * a != h else None, vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            seq_length=min(int(hf["max_position_embeddings"]), m.get("seq_length") or 1024),
            position_embedding="rope", rotary_base=_rope_theta(hf), rotary_percent=1.0, normalization="rmsnorm",
            norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu", gelu_approximate="none",
            add_bias_linear=bool(hf.get("attention_bias", False)), hidden_dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_method_std=float(hf.get("initializer_range", 0.02)),
        )
    else:
        raise ConversionError(f"model_type {mt!r} is not supported -> one of {sorted(SUPPORTED_MODEL_TYPES)}")
    if make_vocab_size_divisible_by is not None:
        m["make_vocab_size_divisible_by"] = int(make_vocab_size_divisible_by)
    par = d["parallel"]
    par.update(tensor_parallel=int(tp), pipeline_parallel=int(pp),
               virtual_pipeline_parallel=int(vpp) if vpp and vpp > 1 else None)
    par["nproc_per_node"] = max(par.get("nproc_per_node", 1), int(tp) * int(pp)) if par.get("nnodes", 1) == 1 else par["nproc_per_node"]
    if par["nproc_per_node"] % (int(tp) * int(pp)):
        par["nproc_per_node"] = int(tp) * int(pp)
    if dtype:
        d["train"]["precision"] = dtype
    return RunConfig.from_dict(d)


def infer_model_type(m: ModelConfig) -> str:
    """Which HF architecture a workbench model maps onto, or a clear refusal."""
    if m.position_embedding == "learned" and m.normalization == "layernorm" and m.activation == "gelu":
        if m.query_groups != m.num_attention_heads or (m.kv_channels and m.kv_channels * m.num_attention_heads != m.hidden_size):
            raise ConversionError("model: GPT-2 export needs multi-head attention with head_dim = hidden/heads")
        if not m.add_bias_linear:
            raise ConversionError("model.add_bias_linear is false: HF GPT-2 always has linear biases -> no HF equivalent")
        return "gpt2"
    if m.position_embedding == "rope" and m.normalization == "rmsnorm" and m.activation == "swiglu":
        if m.rotary_percent != 1.0:
            raise ConversionError("model.rotary_percent < 1 has no HF Llama equivalent")
        return "llama"
    raise ConversionError(
        f"model (position_embedding={m.position_embedding}, normalization={m.normalization}, activation={m.activation}) "
        "matches neither HF GPT-2 (learned/layernorm/gelu) nor Llama (rope/rmsnorm/swiglu) -> no HF export for this architecture")


def hf_config_dict_from_run(cfg: RunConfig, model_type: str, hf_extra: dict | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json content for the exported HF model (tokens ids etc. kept from the imported config when known)."""
    m = cfg.model
    extra = dict(hf_extra or {})
    keep = {k: extra[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in extra}
    if model_type == "gpt2":
        out = {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": m.vocab_size,
            "n_positions": m.max_position_embeddings, "n_embd": m.hidden_size, "n_layer": m.num_layers,
            "n_head": m.num_attention_heads, "n_inner": m.ffn_size, "layer_norm_epsilon": m.norm_epsilon,
            "activation_function": "gelu_new" if m.gelu_approximate == "tanh" else "gelu",
            "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
            "initializer_range": m.init_method_std, "tie_word_embeddings": m.tie_embeddings,
            # GPT-2's <|endoftext|> is the last id; kept in range for other vocab sizes
            "bos_token_id": m.vocab_size - 1, "eos_token_id": m.vocab_size - 1,
        }
    else:
        out = {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": m.ffn_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.query_groups,
            "head_dim": m.head_dim, "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.norm_epsilon, "hidden_act": "silu", "attention_bias": m.add_bias_linear,
            "mlp_bias": m.add_bias_linear, "attention_dropout": m.attention_dropout,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
            "rope_theta": float(m.rotary_base), "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_method_std,
        }
    out.update(keep)
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    return out


# --------------------------------------------------------------------------- tensors


def pad_vocab_rows(t: Any, padded: int, real: int | None = None) -> Any:
    """Resize the vocab dim of ``[rows, h]`` to ``padded`` rows.

    Existing rows are kept (cut when shrinking, never below ``real``); new rows are the
    mean of the ``real`` vocabulary rows (all rows when ``real`` is None).
    """
    import torch

    v = t.shape[0]
    real = v if real is None else real
    if padded < real:
        raise ConversionError(f"cannot pad a vocabulary of {real} rows to {padded}")
    if padded == v:
        return t
    if padded < v:
        return t[:padded].clone()
    fill = t[:real].float().mean(dim=0, keepdim=True).to(t.dtype).expand(padded - v, *t.shape[1:])
    return torch.cat([t, fill], dim=0)


def _qkv_to_mcore(q: Any, k: Any, v: Any, heads: int, groups: int, d: int) -> Any:
    import torch

    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()


def _qkv_from_mcore(qkv: Any, heads: int, groups: int, d: int) -> tuple[Any, Any, Any]:
    tail = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *tail)
    q = x[:, : per * d].reshape(heads * d, *tail).contiguous()
    k = x[:, per * d: (per + 1) * d].reshape(groups * d, *tail).contiguous()
    v = x[:, (per + 1) * d:].reshape(groups * d, *tail).contiguous()
    return q, k, v


def _take(sd: dict, key: str, src: str) -> Any:
    if key not in sd:
        raise ConversionError(f"{src}: tensor {key!r} is missing -> is this a complete {src} checkpoint of the configured architecture?")
    return sd[key]


def hf_to_mcore(hf_sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Map an HF state dict to the full TP=1 megatron-core state dict (vocab padded per ``derive(cfg)``)."""
    import torch

    m = cfg.model
    a, g, d, h = m.num_attention_heads, m.query_groups, m.head_dim, m.hidden_size
    padded = derive(cfg).padded_vocab_size
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    it = progress if progress else (lambda x: x)
    out: dict[str, Any] = {}
    src = f"HF {model_type}"
    sd = {re.sub(r"^(module\.)", "", k): v for k, v in hf_sd.items()}
    if model_type == "gpt2":
        P = "transformer." if any(k.startswith("transformer.") for k in sd) else ""
        wte = _take(sd, f"{P}wte.weight", src)
        if wte.shape[0] != m.vocab_size:
            raise ConversionError(f"{src}: wte has {wte.shape[0]} rows but config vocab_size is {m.vocab_size}")
        out["embedding.word_embeddings.weight"] = pad_vocab_rows(wte, padded)
        out["embedding.position_embeddings.weight"] = _take(sd, f"{P}wpe.weight", src)
        for i in it(range(m.num_layers)):
            s, o = f"{P}h.{i}.", f"decoder.layers.{i}."
            out[o + "input_layernorm.weight"] = _take(sd, s + "ln_1.weight", src)
            out[o + "input_layernorm.bias"] = _take(sd, s + "ln_1.bias", src)
            w = _take(sd, s + "attn.c_attn.weight", src).t()
            b = _take(sd, s + "attn.c_attn.bias", src)
            out[o + "self_attention.linear_qkv.weight"] = _qkv_to_mcore(*w.split(h, dim=0), a, g, d)
            out[o + "self_attention.linear_qkv.bias"] = _qkv_to_mcore(*b.split(h, dim=0), a, g, d)
            out[o + "self_attention.linear_proj.weight"] = _take(sd, s + "attn.c_proj.weight", src).t().contiguous()
            out[o + "self_attention.linear_proj.bias"] = _take(sd, s + "attn.c_proj.bias", src)
            out[o + "pre_mlp_layernorm.weight"] = _take(sd, s + "ln_2.weight", src)
            out[o + "pre_mlp_layernorm.bias"] = _take(sd, s + "ln_2.bias", src)
            out[o + "mlp.linear_fc1.weight"] = _take(sd, s + "mlp.c_fc.weight", src).t().contiguous()
            out[o + "mlp.linear_fc1.bias"] = _take(sd, s + "mlp.c_fc.bias", src)
            out[o + "mlp.linear_fc2.weight"] = _take(sd, s + "mlp.c_proj.weight", src).t().contiguous()
            out[o + "mlp.linear_fc2.bias"] = _take(sd, s + "mlp.c_proj.bias", src)
        out["decoder.final_layernorm.weight"] = _take(sd, f"{P}ln_f.weight", src)
        out["decoder.final_layernorm.bias"] = _take(sd, f"{P}ln_f.bias", src)
        if not m.tie_embeddings:
            out["output_layer.weight"] = pad_vocab_rows(_take(sd, "lm_head.weight", src), padded)
    elif model_type == "llama":
        P = "model." if any(k.startswith("model.") for k in sd) else ""
        emb = _take(sd, f"{P}embed_tokens.weight", src)
        if emb.shape[0] != m.vocab_size:
            raise ConversionError(f"{src}: embed_tokens has {emb.shape[0]} rows but config vocab_size is {m.vocab_size}")
        out["embedding.word_embeddings.weight"] = pad_vocab_rows(emb, padded)
        bias = m.add_bias_linear
        for i in it(range(m.num_layers)):
            s, o = f"{P}layers.{i}.", f"decoder.layers.{i}."
            out[o + "input_layernorm.weight"] = _take(sd, s + "input_layernorm.weight", src)
            q, k, v = (_take(sd, s + f"self_attn.{n}_proj.weight", src) for n in "qkv")
            out[o + "self_attention.linear_qkv.weight"] = _qkv_to_mcore(q, k, v, a, g, d)
            out[o + "self_attention.linear_proj.weight"] = _take(sd, s + "self_attn.o_proj.weight", src)
            out[o + "pre_mlp_layernorm.weight"] = _take(sd, s + "post_attention_layernorm.weight", src)
            out[o + "mlp.linear_fc1.weight"] = torch.cat([_take(sd, s + "mlp.gate_proj.weight", src),
                                                          _take(sd, s + "mlp.up_proj.weight", src)], dim=0)
            out[o + "mlp.linear_fc2.weight"] = _take(sd, s + "mlp.down_proj.weight", src)
            if bias:
                qb, kb, vb = (_take(sd, s + f"self_attn.{n}_proj.bias", src) for n in "qkv")
                out[o + "self_attention.linear_qkv.bias"] = _qkv_to_mcore(qb, kb, vb, a, g, d)
                out[o + "self_attention.linear_proj.bias"] = _take(sd, s + "self_attn.o_proj.bias", src)
                out[o + "mlp.linear_fc1.bias"] = torch.cat([_take(sd, s + "mlp.gate_proj.bias", src),
                                                            _take(sd, s + "mlp.up_proj.bias", src)], dim=0)
                out[o + "mlp.linear_fc2.bias"] = _take(sd, s + "mlp.down_proj.bias", src)
        out["decoder.final_layernorm.weight"] = _take(sd, f"{P}norm.weight", src)
        if not m.tie_embeddings:
            out["output_layer.weight"] = pad_vocab_rows(_take(sd, "lm_head.weight", src), padded)
    else:
        raise ConversionError(f"model_type {model_type!r} is not supported")
    return {k: cast(v).contiguous() for k, v in out.items()}


def mcore_to_hf(sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Inverse of :func:`hf_to_mcore`: pad rows are stripped (they never reach HF)."""
    import torch

    m = cfg.model
    a, g, d, h, V = m.num_attention_heads, m.query_groups, m.head_dim, m.hidden_size, m.vocab_size
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    it = progress if progress else (lambda x: x)
    src = "megatron checkpoint"
    out: dict[str, Any] = {}
    emb = _take(sd, "embedding.word_embeddings.weight", src)[:V]
    if model_type == "gpt2":
        out["transformer.wte.weight"] = emb
        out["transformer.wpe.weight"] = _take(sd, "embedding.position_embeddings.weight", src)
        for i in it(range(m.num_layers)):
            s, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out[o + "ln_1.weight"] = _take(sd, s + "input_layernorm.weight", src)
            out[o + "ln_1.bias"] = _take(sd, s + "input_layernorm.bias", src)
            q, k, v = _qkv_from_mcore(_take(sd, s + "self_attention.linear_qkv.weight", src), a, g, d)
            out[o + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t()
            qb, kb, vb = _qkv_from_mcore(_take(sd, s + "self_attention.linear_qkv.bias", src), a, g, d)
            out[o + "attn.c_attn.bias"] = torch.cat([qb, kb, vb], dim=0)
            out[o + "attn.c_proj.weight"] = _take(sd, s + "self_attention.linear_proj.weight", src).t()
            out[o + "attn.c_proj.bias"] = _take(sd, s + "self_attention.linear_proj.bias", src)
            out[o + "ln_2.weight"] = _take(sd, s + "pre_mlp_layernorm.weight", src)
            out[o + "ln_2.bias"] = _take(sd, s + "pre_mlp_layernorm.bias", src)
            out[o + "mlp.c_fc.weight"] = _take(sd, s + "mlp.linear_fc1.weight", src).t()
            out[o + "mlp.c_fc.bias"] = _take(sd, s + "mlp.linear_fc1.bias", src)
            out[o + "mlp.c_proj.weight"] = _take(sd, s + "mlp.linear_fc2.weight", src).t()
            out[o + "mlp.c_proj.bias"] = _take(sd, s + "mlp.linear_fc2.bias", src)
        out["transformer.ln_f.weight"] = _take(sd, "decoder.final_layernorm.weight", src)
        out["transformer.ln_f.bias"] = _take(sd, "decoder.final_layernorm.bias", src)
        if not m.tie_embeddings:
            out["lm_head.weight"] = _take(sd, "output_layer.weight", src)[:V]
    elif model_type == "llama":
        out["model.embed_tokens.weight"] = emb
        f = m.ffn_size
        for i in it(range(m.num_layers)):
            s, o = f"decoder.layers.{i}.", f"model.layers.{i}."
            out[o + "input_layernorm.weight"] = _take(sd, s + "input_layernorm.weight", src)
            q, k, v = _qkv_from_mcore(_take(sd, s + "self_attention.linear_qkv.weight", src), a, g, d)
            out[o + "self_attn.q_proj.weight"], out[o + "self_attn.k_proj.weight"], out[o + "self_attn.v_proj.weight"] = q, k, v
            out[o + "self_attn.o_proj.weight"] = _take(sd, s + "self_attention.linear_proj.weight", src)
            out[o + "post_attention_layernorm.weight"] = _take(sd, s + "pre_mlp_layernorm.weight", src)
            fc1 = _take(sd, s + "mlp.linear_fc1.weight", src)
            out[o + "mlp.gate_proj.weight"], out[o + "mlp.up_proj.weight"] = fc1[:f], fc1[f:]
            out[o + "mlp.down_proj.weight"] = _take(sd, s + "mlp.linear_fc2.weight", src)
            if m.add_bias_linear:
                qb, kb, vb = _qkv_from_mcore(_take(sd, s + "self_attention.linear_qkv.bias", src), a, g, d)
                out[o + "self_attn.q_proj.bias"], out[o + "self_attn.k_proj.bias"], out[o + "self_attn.v_proj.bias"] = qb, kb, vb
                out[o + "self_attn.o_proj.bias"] = _take(sd, s + "self_attention.linear_proj.bias", src)
                b1 = _take(sd, s + "mlp.linear_fc1.bias", src)
                out[o + "mlp.gate_proj.bias"], out[o + "mlp.up_proj.bias"] = b1[:f], b1[f:]
                out[o + "mlp.down_proj.bias"] = _take(sd, s + "mlp.linear_fc2.bias", src)
        out["model.norm.weight"] = _take(sd, "decoder.final_layernorm.weight", src)
        if not m.tie_embeddings:
            out["lm_head.weight"] = _take(sd, "output_layer.weight", src)[:V]
    else:
        raise ConversionError(f"model_type {model_type!r} is not supported")
    return {k: cast(v).contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------- HF files


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, Any]:
    """All tensors of a local HF checkpoint: (sharded) safetensors, else (sharded) pytorch_model.bin with weights_only."""
    import torch

    p = Path(hf_dir)
    files: list[Path] = []
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        idx = p / index_name
        if idx.is_file():
            wm = json.loads(idx.read_text()).get("weight_map", {})
            files = [p / f for f in sorted(set(wm.values()))]
            break
    if not files:
        files = sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))
    if not files:
        raise ConversionError(f"{p}: no model weights (*.safetensors or pytorch_model*.bin) -> save with model.save_pretrained(DIR)")
    out: dict[str, Any] = {}
    for f in files:
        if not f.is_file():
            raise ConversionError(f"{f}: listed in the index but missing -> the download/copy is incomplete")
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            try:
                out.update(torch.load(str(f), map_location="cpu", weights_only=True))
            except Exception as e:  # pickle.UnpicklingError and friends
                raise ConversionError(f"{f}: cannot be loaded safely with weights_only=True ({e}) -> re-save it as safetensors") from None
    return out


def parse_size(text: str | int) -> int:
    """'2GB' / '500MB' / '10KB' / bytes -> bytes (decimal units, like HF)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper()
    mobj = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB)?", s)
    if not mobj:
        raise ConversionError(f"--max-shard-size {text!r}: not a size -> use e.g. 2GB, 500MB")
    mult = {"B": 1, None: 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[mobj.group(2)]
    n = int(float(mobj.group(1)) * mult)
    if n <= 0:
        raise ConversionError(f"--max-shard-size {text!r} must be positive")
    return n


def save_hf_state_dict(sd: dict[str, Any], out_dir: Path, max_shard_size: int) -> list[str]:
    """Write safetensors shards (+ index when more than one) like ``save_pretrained`` does."""
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][k] = t.contiguous()
        size += nbytes
    names = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    total = 0
    for name, shard in zip(names, shards):
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        for k, t in shard.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        (out_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names
