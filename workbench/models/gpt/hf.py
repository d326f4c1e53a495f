"""HF GPT-2 / Llama (and its MoE kin, :mod:`.hf_moe`) <-> megatron-core GPT: config fields and per-tensor conversion rules.

The generic machinery is below and above it: the rule vocabulary, vocab padding and the per-group QKV layout in
:mod:`workbench.models.common.conversion_rules`, reading/writing HF dirs in the conversion tools that run this
adapter (:mod:`workbench.conversion.hf`); this module holds what is GPT's: the HF config fields, the
tensor names of GPT-2 (``Conv1D`` weights ``[in, out]``, ``c_attn`` = ``[q | k | v]``) and of
Llama (rotate-half RoPE q/k, which is mcore's default), and the random demo models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from workbench.config import ModelConfig, RunConfig, derive
from workbench.families.gpt import FAMILY
from workbench.models.common.conversion_rules import (ConversionError, Rule, TensorInfo, check_sources, copy_rule,
                                                      need, need_vocab, pad_vocab_rows, qkv_from_mcore, qkv_to_mcore)
from workbench.models.gpt import hf_moe

__all__ = ["HF_CLASSES", "model_fields", "infer_model_type", "hf_config_dict_from_run", "hf_to_mcore_rules",
           "mcore_to_hf_rules", "verify_inputs", "hf_logits",
           "make_random_hf_model"]

#: the HF model types this adapter converts, and their HF classes
HF_CLASSES = dict(FAMILY.supports.hf_classes)
_GELU_TANH = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}


def _rope_theta(hf: dict) -> float:
    rp = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling")
    rtype = (rp.get("rope_type") if isinstance(rp, dict) else None) or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if rtype not in (None, "default"):
        raise ConversionError(f"config.json: RoPE scaling {rtype!r} is not supported by the workbench model -> only plain RoPE (rope_type 'default')")
    theta = (rp.get("rope_theta") if isinstance(rp, dict) else None) or hf.get("rope_theta") or 10000.0
    return float(theta)


def model_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    """Fill the RunConfig ``model`` section ``m`` (a dict) from an HF GPT-2 / Llama config."""
    mt = hf.get("model_type")
    m["qk_layernorm"], m["qk_norm_scope"] = False, "head"  # Qwen3-MoE's per-head / OLMoE's all-heads q/k norms (hf_moe)
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
    elif mt in ("llama", *hf_moe.MODEL_TYPES):  # Mixtral, Qwen3-MoE, OLMoE: Llama's decoder with MoE MLPs (hf_moe)
        if mt in hf_moe.MODEL_TYPES:
            hf_moe.model_fields(hf, m)
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
        raise ConversionError(f"model_type {mt!r} is not a GPT-family type -> one of {sorted(HF_CLASSES)}")


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
        if m.qk_layernorm:
            if not m.moe.num_experts:
                raise ConversionError("model.qk_layernorm on a dense model: HF Qwen3 / OLMo 2 (dense) export is not mapped -> "
                                      "export a model with experts (Qwen3-MoE, OLMoE) or set qk_layernorm: false (Llama)")
            return "olmoe" if m.qk_norm_scope == "all_heads" else "qwen3_moe"
        return "mixtral" if m.moe.num_experts else "llama"
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
        if model_type in hf_moe.MODEL_TYPES:
            out.update(hf_moe.hf_config_fields(cfg, model_type))
    out.update(keep)
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    return out


def _vocab_pad(padded: int) -> Callable[[Any], Any]:
    return lambda t: pad_vocab_rows(t, padded)


def _rows(n: int) -> Callable[[Any], Any]:
    return lambda t: t[:n]


def _transpose(t: Any) -> Any:
    return t.t()


def _qk_norm_rules(infos: Mapping[str, TensorInfo], s: str, o: str, m: ModelConfig, src: str) -> list[Rule]:
    """The q/k norms (``self_attn.q_norm`` / ``k_norm``) -> megatron's ``q_layernorm`` / ``k_layernorm``: Qwen3's per
    head (head_dim wide), OLMoE's over all heads (``qk_norm_scope: all_heads``: all query heads' / all KV heads'
    width, in megatron's head order, which is HF's); a norm of another width is refused."""
    rules = []
    scope = "each head (head_dim)" if m.qk_norm_scope == "head" else "all heads at once (qk_norm_scope all_heads)"
    for n, width in zip("qk", hf_moe.qk_norm_widths(m)):
        info = need(infos, s + f"{n}_norm.weight", src)
        if tuple(info.shape) != (width,):
            raise ConversionError(f"{src}: {s}{n}_norm.weight has shape {tuple(info.shape)}, not ({width},) -> "
                                  f"this model type's q/k norms normalise {scope}; a norm of another width has no mapping")
        rules.append(copy_rule(o + f"{n}_layernorm.weight", s + f"{n}_norm.weight"))
    return rules


def hf_to_mcore_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str) -> list[Rule]:
    """The rules mapping an HF GPT-2 / Llama checkpoint (``infos``: its tensors' names and shapes) to the full TP=1
    megatron-core state dict (vocab padded per ``derive(cfg)``); a missing tensor or a wrong vocabulary is refused."""
    import torch

    m = cfg.model
    a, g, d, h = m.num_attention_heads, m.query_groups, m.head_dim, m.hidden_size
    padded = derive(cfg).padded_vocab_size
    src = f"HF {model_type}"
    rules: list[Rule] = []
    if model_type == "gpt2":
        P = "transformer." if any(k.startswith("transformer.") for k in infos) else ""
        need_vocab(infos, f"{P}wte.weight", src, m.vocab_size)
        rules.append(Rule(("embedding.word_embeddings.weight",), (f"{P}wte.weight",), _vocab_pad(padded)))
        rules.append(copy_rule("embedding.position_embeddings.weight", f"{P}wpe.weight"))
        for i in range(m.num_layers):
            s, o = f"{P}h.{i}.", f"decoder.layers.{i}."
            rules += [copy_rule(o + "input_layernorm.weight", s + "ln_1.weight"),
                      copy_rule(o + "input_layernorm.bias", s + "ln_1.bias"),
                      Rule((o + "self_attention.linear_qkv.weight",), (s + "attn.c_attn.weight",),
                           lambda w: qkv_to_mcore(*w.t().split(h, dim=0), a, g, d)),
                      Rule((o + "self_attention.linear_qkv.bias",), (s + "attn.c_attn.bias",),
                           lambda b: qkv_to_mcore(*b.split(h, dim=0), a, g, d)),
                      Rule((o + "self_attention.linear_proj.weight",), (s + "attn.c_proj.weight",), _transpose),
                      copy_rule(o + "self_attention.linear_proj.bias", s + "attn.c_proj.bias"),
                      copy_rule(o + "pre_mlp_layernorm.weight", s + "ln_2.weight"),
                      copy_rule(o + "pre_mlp_layernorm.bias", s + "ln_2.bias"),
                      Rule((o + "mlp.linear_fc1.weight",), (s + "mlp.c_fc.weight",), _transpose),
                      copy_rule(o + "mlp.linear_fc1.bias", s + "mlp.c_fc.bias"),
                      Rule((o + "mlp.linear_fc2.weight",), (s + "mlp.c_proj.weight",), _transpose),
                      copy_rule(o + "mlp.linear_fc2.bias", s + "mlp.c_proj.bias")]
        rules += [copy_rule("decoder.final_layernorm.weight", f"{P}ln_f.weight"),
                  copy_rule("decoder.final_layernorm.bias", f"{P}ln_f.bias")]
        if not m.tie_embeddings:
            rules.append(Rule(("output_layer.weight",), ("lm_head.weight",), _vocab_pad(padded)))
    elif model_type in ("llama", *hf_moe.MODEL_TYPES):
        P = "model." if any(k.startswith("model.") for k in infos) else ""
        need_vocab(infos, f"{P}embed_tokens.weight", src, m.vocab_size)
        rules.append(Rule(("embedding.word_embeddings.weight",), (f"{P}embed_tokens.weight",), _vocab_pad(padded)))
        qkv = lambda q, k, v: qkv_to_mcore(q, k, v, a, g, d)  # noqa: E731
        cat = lambda x, y: torch.cat([x, y], dim=0)  # noqa: E731
        for i in range(m.num_layers):
            s, o = f"{P}layers.{i}.", f"decoder.layers.{i}."
            rules += [copy_rule(o + "input_layernorm.weight", s + "input_layernorm.weight"),
                      Rule((o + "self_attention.linear_qkv.weight",), tuple(s + f"self_attn.{n}_proj.weight" for n in "qkv"), qkv),
                      copy_rule(o + "self_attention.linear_proj.weight", s + "self_attn.o_proj.weight"),
                      copy_rule(o + "pre_mlp_layernorm.weight", s + "post_attention_layernorm.weight")]
            if m.qk_layernorm:
                rules += _qk_norm_rules(infos, s + "self_attn.", o + "self_attention.", m, src)
            if hf_moe.is_moe_layer(cfg, i):
                rules += hf_moe.experts_to_mcore_rules(infos, s, o, cfg)
            else:
                rules += [Rule((o + "mlp.linear_fc1.weight",), (s + "mlp.gate_proj.weight", s + "mlp.up_proj.weight"), cat),
                          copy_rule(o + "mlp.linear_fc2.weight", s + "mlp.down_proj.weight")]
            if m.add_bias_linear:
                rules += [Rule((o + "self_attention.linear_qkv.bias",), tuple(s + f"self_attn.{n}_proj.bias" for n in "qkv"), qkv),
                          copy_rule(o + "self_attention.linear_proj.bias", s + "self_attn.o_proj.bias"),
                          Rule((o + "mlp.linear_fc1.bias",), (s + "mlp.gate_proj.bias", s + "mlp.up_proj.bias"), cat),
                          copy_rule(o + "mlp.linear_fc2.bias", s + "mlp.down_proj.bias")]
        rules.append(copy_rule("decoder.final_layernorm.weight", f"{P}norm.weight"))
        if not m.tie_embeddings:
            rules.append(Rule(("output_layer.weight",), ("lm_head.weight",), _vocab_pad(padded)))
    else:
        raise ConversionError(f"model_type {model_type!r} is not supported")
    check_sources(rules, infos, src)
    return rules


def mcore_to_hf_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str,
                      read: Callable[[str], Any] | None = None) -> list[Rule]:
    """The rules of :func:`hf_to_mcore_rules`'s inverse, from the full TP=1 megatron-core state dict (``infos``):
    pad rows are stripped (they never reach HF)."""
    import torch

    m = cfg.model
    a, g, d, V = m.num_attention_heads, m.query_groups, m.head_dim, m.vocab_size
    src = "megatron checkpoint"
    rules: list[Rule] = []
    emb = "embedding.word_embeddings.weight"
    if model_type == "gpt2":
        def c_attn(qkv: Any) -> Any:
            return torch.cat(qkv_from_mcore(qkv, a, g, d), dim=0)

        rules += [Rule(("transformer.wte.weight",), (emb,), _rows(V)),
                  copy_rule("transformer.wpe.weight", "embedding.position_embeddings.weight")]
        for i in range(m.num_layers):
            s, o = f"decoder.layers.{i}.", f"transformer.h.{i}."
            rules += [copy_rule(o + "ln_1.weight", s + "input_layernorm.weight"),
                      copy_rule(o + "ln_1.bias", s + "input_layernorm.bias"),
                      Rule((o + "attn.c_attn.weight",), (s + "self_attention.linear_qkv.weight",), lambda w: c_attn(w).t()),
                      Rule((o + "attn.c_attn.bias",), (s + "self_attention.linear_qkv.bias",), c_attn),
                      Rule((o + "attn.c_proj.weight",), (s + "self_attention.linear_proj.weight",), _transpose),
                      copy_rule(o + "attn.c_proj.bias", s + "self_attention.linear_proj.bias"),
                      copy_rule(o + "ln_2.weight", s + "pre_mlp_layernorm.weight"),
                      copy_rule(o + "ln_2.bias", s + "pre_mlp_layernorm.bias"),
                      Rule((o + "mlp.c_fc.weight",), (s + "mlp.linear_fc1.weight",), _transpose),
                      copy_rule(o + "mlp.c_fc.bias", s + "mlp.linear_fc1.bias"),
                      Rule((o + "mlp.c_proj.weight",), (s + "mlp.linear_fc2.weight",), _transpose),
                      copy_rule(o + "mlp.c_proj.bias", s + "mlp.linear_fc2.bias")]
        rules += [copy_rule("transformer.ln_f.weight", "decoder.final_layernorm.weight"),
                  copy_rule("transformer.ln_f.bias", "decoder.final_layernorm.bias")]
        if not m.tie_embeddings:
            rules.append(Rule(("lm_head.weight",), ("output_layer.weight",), _rows(V)))
    elif model_type in ("llama", *hf_moe.MODEL_TYPES):
        f = m.ffn_size
        split_qkv = lambda t: qkv_from_mcore(t, a, g, d)  # noqa: E731
        halves = lambda t: (t[:f], t[f:])  # noqa: E731
        rules.append(Rule(("model.embed_tokens.weight",), (emb,), _rows(V)))
        for i in range(m.num_layers):
            s, o = f"decoder.layers.{i}.", f"model.layers.{i}."
            rules += [copy_rule(o + "input_layernorm.weight", s + "input_layernorm.weight"),
                      Rule(tuple(o + f"self_attn.{n}_proj.weight" for n in "qkv"), (s + "self_attention.linear_qkv.weight",), split_qkv),
                      copy_rule(o + "self_attn.o_proj.weight", s + "self_attention.linear_proj.weight"),
                      copy_rule(o + "post_attention_layernorm.weight", s + "pre_mlp_layernorm.weight")]
            if m.qk_layernorm:
                rules += [copy_rule(o + f"self_attn.{n}_norm.weight", s + f"self_attention.{n}_layernorm.weight") for n in "qk"]
            if hf_moe.is_moe_layer(cfg, i):
                rules += hf_moe.experts_from_mcore_rules(s, o, cfg)
            else:
                rules += [Rule((o + "mlp.gate_proj.weight", o + "mlp.up_proj.weight"), (s + "mlp.linear_fc1.weight",), halves),
                          copy_rule(o + "mlp.down_proj.weight", s + "mlp.linear_fc2.weight")]
            if m.add_bias_linear:
                rules += [Rule(tuple(o + f"self_attn.{n}_proj.bias" for n in "qkv"), (s + "self_attention.linear_qkv.bias",), split_qkv),
                          copy_rule(o + "self_attn.o_proj.bias", s + "self_attention.linear_proj.bias"),
                          Rule((o + "mlp.gate_proj.bias", o + "mlp.up_proj.bias"), (s + "mlp.linear_fc1.bias",), halves),
                          copy_rule(o + "mlp.down_proj.bias", s + "mlp.linear_fc2.bias")]
        rules.append(copy_rule("model.norm.weight", "decoder.final_layernorm.weight"))
        if not m.tie_embeddings:
            rules.append(Rule(("lm_head.weight",), ("output_layer.weight",), _rows(V)))
    else:
        raise ConversionError(f"model_type {model_type!r} is not supported")
    check_sources(rules, infos, src)
    return rules


# --------------------------------------------------------------------------- demos


def make_random_hf_model(out: str | Path, model_type: str = "gpt2", hidden: int = 96, layers: int = 4, heads: int = 6,
                         kv_heads: int = 2, vocab: int = 1000, positions: int = 128, seed: int = 0, *, tied: bool | None = None) -> Path:
    """A small randomly initialised HF model dir (GPT-2, or Llama with GQA) for demos and tests; ``tied``: the LM head
    shares the word embeddings (default: GPT-2 tied, Llama untied)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if model_type == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab, n_positions=positions,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                           tie_word_embeddings=True if tied is None else tied))
    elif model_type == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                             num_key_value_heads=kv_heads, intermediate_size=2 * hidden, vocab_size=vocab,
                                             max_position_embeddings=positions, tie_word_embeddings=bool(tied),
                                             bos_token_id=1, eos_token_id=2))
    elif model_type == "mixtral":
        model = hf_moe.make_random_mixtral(hidden, layers, heads, kv_heads, vocab, positions, bool(tied))
    elif model_type == "qwen3_moe":
        model = hf_moe.make_random_qwen3_moe(hidden, layers, heads, kv_heads, vocab, positions, bool(tied))
    elif model_type == "olmoe":
        model = hf_moe.make_random_olmoe(hidden, layers, heads, kv_heads, vocab, positions, bool(tied))
    else:
        raise ConversionError(f"model_type {model_type!r} -> gpt2, llama, mixtral, qwen3_moe or olmoe")
    out = Path(out)
    model.save_pretrained(out)
    return out


def verify_inputs(vocab: int, batch_size: int, seq_length: int, seed: int = 0) -> dict[str, Any]:
    """Random token ids for a logits comparison (what :func:`workbench.models.gpt.step.logits_forward` reads)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, vocab, (batch_size, seq_length), generator=g)}


def hf_logits(hf_dir: str | Path, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """(HF causal-LM logits ``[b, s, V]`` fp32, positions to compare: None = all) for :func:`verify_inputs`."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(inputs["tokens"]).logits.float(), None
