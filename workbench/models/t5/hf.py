"""HF ``T5ForConditionalGeneration`` (t5 v1.0 / v1.1) and ``MT5ForConditionalGeneration`` (mt5) <->
megatron-core T5: config fields and per-tensor conversion rules.

HF T5: RMS norm without bias (``layer_norm``), no linear biases, unscaled attention scores, one
relative-bias table per stack (in block 0's self-attention, shared by the other blocks), ReLU
(``DenseReluDense.wi``/``wo``; v1.0) or gated GELU-tanh (``wi_0`` gate, ``wi_1`` up; v1.1, mT5)
MLP.  The head: T5 v1.0 ties it to ``shared`` and scales the decoder output by ``d_model ** -0.5``
(``scale_decoder_outputs``; older configs: ``tie_word_embeddings`` not false); v1.1 and mT5 have
their own ``lm_head`` and no scaling.  The workbench maps "scaled" to ``model.tie_embeddings: true``
and "not scaled" to an untied head (``output_layer`` = ``lm_head.weight``; transformers 5 ties
``lm_head`` to ``shared`` in memory for every T5, so both hold the same values there).

megatron-core names: ``linear_qkv`` = per head [q; k; v] (the workbench's QKV layout),
cross-attention ``linear_q`` and ``linear_kv`` = per head [k; v], ``mlp.linear_fc1`` = [wi_0; wi_1]
for the gated MLP (megatron's GLU: ``act(first half) * second half``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from workbench.config import ModelConfig, RunConfig, derive
from workbench.families.t5 import FAMILY
from workbench.families.t5.spans import check_t5_tokenizer
from workbench.models.common.conversion_rules import (ConversionError, Rule, TensorInfo, check_sources, copy_rule,
                                                      need_vocab, pad_vocab_rows, qkv_from_mcore, qkv_to_mcore)

__all__ = ["HF_CLASSES", "model_fields", "infer_model_type", "hf_config_dict_from_run", "hf_to_mcore_rules",
           "mcore_to_hf_rules", "make_random_hf_model", "kv_to_mcore", "kv_from_mcore", "verify_inputs", "hf_logits"]

HF_CLASSES = dict(FAMILY.supports.hf_classes)
_ACTS = {"relu": ("relu", "none"), "gated-gelu": ("geglu", "tanh"), "gated-gelu_new": ("geglu", "tanh"),
         "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gated-silu": ("swiglu", "none")}


def _scaled(hf: dict[str, Any]) -> bool:
    if hf.get("model_type") == "mt5":
        return False
    if "scale_decoder_outputs" in hf:
        return bool(hf["scale_decoder_outputs"])
    return hf.get("tie_word_embeddings", True) is not False


def model_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    """Fill the RunConfig ``model`` section ``m`` (a dict) from an HF T5 / mT5 config."""
    mt = hf.get("model_type")
    if mt not in HF_CLASSES:
        raise ConversionError(f"model_type {mt!r} is not a T5-family type -> one of {sorted(HF_CLASSES)}")
    ff = str(hf.get("feed_forward_proj", "gated-gelu" if mt == "mt5" else "relu"))
    if ff not in _ACTS:
        raise ConversionError(f"config.json: feed_forward_proj {ff!r} is not supported -> one of {sorted(_ACTS)}")
    act, approx = _ACTS[ff]
    h, a, d = int(hf["d_model"]), int(hf["num_heads"]), int(hf.get("d_kv") or int(hf["d_model"]) // int(hf["num_heads"]))
    layers = int(hf["num_layers"])
    seq = int(m.get("seq_length") or 512)
    m.update(
        arch="t5", num_layers=layers, decoder_num_layers=int(hf.get("num_decoder_layers") or layers), hidden_size=h,
        num_attention_heads=a, attention_type="multihead", num_query_groups=None, kv_channels=d if d * a != h else None,
        ffn_hidden_size=int(hf["d_ff"]), vocab_size=int(hf["vocab_size"]), max_position_embeddings=max(seq, 512),
        seq_length=seq, decoder_seq_length=m.get("decoder_seq_length"), position_embedding="relative",
        relative_attention_num_buckets=int(hf.get("relative_attention_num_buckets", 32)),
        relative_attention_max_distance=int(hf.get("relative_attention_max_distance", 128)),
        normalization="rmsnorm", norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-6)), activation=act,
        gelu_approximate=approx, add_bias_linear=False, hidden_dropout=float(hf.get("dropout_rate", 0.0)),
        attention_dropout=0.0, tie_embeddings=_scaled(hf), init_method_std=float(hf.get("initializer_factor", 1.0)) * 0.02,
        attention_backend="auto",
    )


def infer_model_type(m: ModelConfig) -> str:
    """t5 (or a clear refusal naming what has no HF equivalent); mT5 is kept when the checkpoint came from one."""
    problems = []
    if m.position_embedding != "relative" or m.normalization != "rmsnorm":
        problems.append("HF T5 has relative positions and RMS norms")
    if m.add_bias_linear:
        problems.append("HF T5 has no linear biases")
    if m.attention_type != "multihead":
        problems.append("HF T5 has multi-head attention")
    if m.activation == "geglu" and m.gelu_approximate != "tanh":
        problems.append("HF T5's gated GELU is the tanh approximation (gelu_approximate: tanh)")
    if problems:
        raise ConversionError("model has no HF T5ForConditionalGeneration equivalent: " + "; ".join(problems))
    return "t5"


def _tokenizer_ids(cfg: RunConfig) -> dict[str, int]:
    """Pad, EOS and decoder start of the tokenizer a checkpoint trained with (what its span corruption and
    generation used: ``demo-t5``'s pad is 1 and EOS 0); synthetic data's are HF T5's defaults (pad 0, EOS 1)."""
    if cfg.data.source == "synthetic" or not cfg.data.tokenizer:
        return {}
    try:
        v = check_t5_tokenizer(cfg.data.tokenizer)
    except Exception:  # a tokenizer that is not here or not T5's: HF T5's defaults
        return {}
    return {"pad_token_id": v.pad, "eos_token_id": v.eos, "decoder_start_token_id": v.decoder_start}


def hf_config_dict_from_run(cfg: RunConfig, model_type: str, hf_extra: dict | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json content for the exported HF model: token ids from an imported HF config, else from the
    checkpoint's own tokenizer (:func:`_tokenizer_ids`)."""
    m = cfg.model
    extra = {**_tokenizer_ids(cfg), **dict(hf_extra or {})}
    ff = {("relu", "none"): "relu", ("geglu", "tanh"): "gated-gelu", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_new",
          ("swiglu", "none"): "gated-silu"}[(m.activation, m.gelu_approximate if m.activation in ("gelu", "geglu") else "none")]
    out = {
        "model_type": model_type, "architectures": [HF_CLASSES[model_type]], "vocab_size": m.vocab_size,
        "d_model": m.hidden_size, "d_kv": m.head_dim, "d_ff": m.ffn_size, "num_layers": m.num_layers,
        "num_decoder_layers": m.decoder_layers, "num_heads": m.num_attention_heads,
        "relative_attention_num_buckets": m.relative_attention_num_buckets,
        "relative_attention_max_distance": m.relative_attention_max_distance, "dropout_rate": m.hidden_dropout,
        "layer_norm_epsilon": m.norm_epsilon, "initializer_factor": 1.0, "feed_forward_proj": ff,
        "is_encoder_decoder": True, "tie_word_embeddings": m.tie_embeddings, "scale_decoder_outputs": m.tie_embeddings,
        "pad_token_id": extra.get("pad_token_id", 0), "eos_token_id": extra.get("eos_token_id", 1),
        "decoder_start_token_id": extra.get("decoder_start_token_id", extra.get("pad_token_id", 0)),
    }
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    return out


def kv_to_mcore(k: Any, v: Any, heads: int, d: int) -> Any:
    """Cross-attention K and V ``[heads*d, h]`` -> megatron's ``linear_kv`` (per head [k; v])."""
    import torch

    h = k.shape[-1]
    return torch.stack([k.reshape(heads, d, h), v.reshape(heads, d, h)], dim=1).reshape(2 * heads * d, h)


def kv_from_mcore(kv: Any, heads: int, d: int) -> tuple[Any, Any]:
    h = kv.shape[-1]
    x = kv.reshape(heads, 2, d, h)
    return x[:, 0].reshape(heads * d, h), x[:, 1].reshape(heads * d, h)


def _mlp_sources(s: str, gated: bool) -> tuple[str, ...]:
    return (s + "wi_0.weight", s + "wi_1.weight") if gated else (s + "wi.weight",)


def _cat(*ts: Any) -> Any:
    import torch

    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)


def hf_to_mcore_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str) -> list[Rule]:
    """The rules mapping an HF T5 / mT5 checkpoint (``infos``: its tensors' names and shapes) to the full TP=1
    megatron-core T5 state dict (vocab padded per ``derive(cfg)``); a missing tensor or a wrong vocabulary is refused."""
    m = cfg.model
    if model_type not in HF_CLASSES:
        raise ConversionError(f"model_type {model_type!r} is not supported by the T5 adapter")
    a, d = m.num_attention_heads, m.head_dim
    padded = derive(cfg).padded_vocab_size
    src = f"HF {model_type}"
    pad = lambda t: pad_vocab_rows(t, padded)  # noqa: E731
    qkv = lambda q, k, v: qkv_to_mcore(q, k, v, a, a, d)  # noqa: E731
    kv = lambda k, v: kv_to_mcore(k, v, a, d)  # noqa: E731
    shared = "shared.weight" if "shared.weight" in infos else "encoder.embed_tokens.weight"
    need_vocab(infos, shared, src, m.vocab_size)
    rules = [Rule(("embedding.word_embeddings.weight",), (shared,), pad)]
    for stack, n in (("encoder", m.num_layers), ("decoder", m.decoder_layers)):
        rules += [copy_rule(f"{stack}_relative_pos_emb.relative_attention_bias.weight",
                            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
                  copy_rule(f"{stack}.final_layernorm.weight", f"{stack}.final_layer_norm.weight")]
        for i in range(n):
            s, o = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            rules += [copy_rule(o + "input_layernorm.weight", s + "0.layer_norm.weight"),
                      Rule((o + "self_attention.linear_qkv.weight",), tuple(s + f"0.SelfAttention.{x}.weight" for x in "qkv"), qkv),
                      copy_rule(o + "self_attention.linear_proj.weight", s + "0.SelfAttention.o.weight")]
            f = "1."
            if stack == "decoder":
                rules += [copy_rule(o + "pre_cross_attn_layernorm.weight", s + "1.layer_norm.weight"),
                          copy_rule(o + "cross_attention.linear_q.weight", s + "1.EncDecAttention.q.weight"),
                          Rule((o + "cross_attention.linear_kv.weight",),
                               (s + "1.EncDecAttention.k.weight", s + "1.EncDecAttention.v.weight"), kv),
                          copy_rule(o + "cross_attention.linear_proj.weight", s + "1.EncDecAttention.o.weight")]
                f = "2."
            rules += [copy_rule(o + "pre_mlp_layernorm.weight", s + f + "layer_norm.weight"),
                      Rule((o + "mlp.linear_fc1.weight",), _mlp_sources(s + f + "DenseReluDense.", m.gated_mlp), _cat),
                      copy_rule(o + "mlp.linear_fc2.weight", s + f + "DenseReluDense.wo.weight")]
    if not m.tie_embeddings:
        rules.append(Rule(("output_layer.weight",), ("lm_head.weight" if "lm_head.weight" in infos else shared,), pad))
    check_sources(rules, infos, src)
    return rules


def mcore_to_hf_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str,
                      read: Callable[[str], Any] | None = None) -> list[Rule]:
    """The rules of :func:`hf_to_mcore_rules`'s inverse, from the full TP=1 megatron-core T5 state dict (``infos``):
    pad rows are stripped; the tied copies HF's ``save_pretrained`` leaves out (``encoder/decoder.embed_tokens``,
    a tied ``lm_head``) are left out too.  An untied head equal to the shared embeddings is one of those: ``read``
    (a tensor by name) looks at both to decide."""
    import torch

    m = cfg.model
    a, d, V, f = m.num_attention_heads, m.head_dim, m.vocab_size, m.ffn_size
    src = "megatron checkpoint"
    rows = lambda t: t[:V]  # noqa: E731
    split = lambda t: qkv_from_mcore(t, a, a, d)  # noqa: E731
    rules = [Rule(("shared.weight",), ("embedding.word_embeddings.weight",), rows)]
    for stack, n in (("encoder", m.num_layers), ("decoder", m.decoder_layers)):
        rules += [copy_rule(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                            f"{stack}_relative_pos_emb.relative_attention_bias.weight"),
                  copy_rule(f"{stack}.final_layer_norm.weight", f"{stack}.final_layernorm.weight")]
        for i in range(n):
            s, o = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer."
            rules += [Rule(tuple(o + f"0.SelfAttention.{x}.weight" for x in "qkv"), (s + "self_attention.linear_qkv.weight",), split),
                      copy_rule(o + "0.layer_norm.weight", s + "input_layernorm.weight"),
                      copy_rule(o + "0.SelfAttention.o.weight", s + "self_attention.linear_proj.weight")]
            ff = "1."
            if stack == "decoder":
                rules += [copy_rule(o + "1.layer_norm.weight", s + "pre_cross_attn_layernorm.weight"),
                          copy_rule(o + "1.EncDecAttention.q.weight", s + "cross_attention.linear_q.weight"),
                          Rule((o + "1.EncDecAttention.k.weight", o + "1.EncDecAttention.v.weight"),
                               (s + "cross_attention.linear_kv.weight",), lambda t: kv_from_mcore(t, a, d)),
                          copy_rule(o + "1.EncDecAttention.o.weight", s + "cross_attention.linear_proj.weight")]
                ff = "2."
            rules.append(copy_rule(o + ff + "layer_norm.weight", s + "pre_mlp_layernorm.weight"))
            if m.gated_mlp:
                rules.append(Rule((o + ff + "DenseReluDense.wi_0.weight", o + ff + "DenseReluDense.wi_1.weight"),
                                  (s + "mlp.linear_fc1.weight",), lambda t: (t[:f], t[f:])))
            else:
                rules.append(copy_rule(o + ff + "DenseReluDense.wi.weight", s + "mlp.linear_fc1.weight"))
            rules.append(copy_rule(o + ff + "DenseReluDense.wo.weight", s + "mlp.linear_fc2.weight"))
    check_sources(rules, infos, src)
    if not m.tie_embeddings:
        check_sources([copy_rule("lm_head.weight", "output_layer.weight")], infos, src)
        if read is None:
            raise ValueError("an untied T5 head needs read= to compare it with the shared embeddings")
        # equal: HF's save_pretrained leaves the tied copy out too
        if not torch.equal(read("output_layer.weight")[:V], read("embedding.word_embeddings.weight")[:V]):
            rules.append(Rule(("lm_head.weight",), ("output_layer.weight",), rows))
    return rules


def make_random_hf_model(out: str | Path, model_type: str = "t5", hidden: int = 96, layers: int = 3, heads: int = 6,
                         kv_heads: int = 0, vocab: int = 1000, positions: int = 128, seed: int = 0, *,
                         feed_forward_proj: str | None = None, tied: bool | None = None, d_kv: int | None = None,
                         decoder_layers: int | None = None, buckets: int = 16, max_distance: int = 40) -> Path:
    """A small randomly initialised HF T5 (v1.0: ReLU, tied + scaled; ``feed_forward_proj='gated-gelu'``:
    v1.1 style, no scaling) or mT5 dir for demos and tests; norms perturbed so a wrong mapping shows."""
    import torch
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, d_model=hidden, d_kv=d_kv or hidden // heads, d_ff=2 * hidden + 12, num_layers=layers,
              num_decoder_layers=decoder_layers or layers, num_heads=heads, relative_attention_num_buckets=buckets,
              relative_attention_max_distance=max_distance, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
              decoder_start_token_id=0)
    if model_type == "mt5":
        model = MT5ForConditionalGeneration(MT5Config(feed_forward_proj=feed_forward_proj or "gated-gelu", **kw))
    elif model_type == "t5":
        ff = feed_forward_proj or "relu"
        tie = (ff == "relu") if tied is None else tied
        model = T5ForConditionalGeneration(T5Config(feed_forward_proj=ff, tie_word_embeddings=tie, **kw))
    else:
        raise ConversionError(f"model_type {model_type!r} -> t5 or mt5")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "relative_attention_bias" in name:
                p.mul_(20.0)  # HF initialises it tiny: make the bias matter
        if not getattr(model.config, "scale_decoder_outputs", True) or model_type == "mt5":
            # unscaled heads on HF's std-1 embeddings: the residual stream is the input token's embedding, so
            # greedy decoding would repeat the start token forever; smaller embeddings let the layers speak
            model.shared.weight.mul_(0.05)
    out = Path(out)
    model.save_pretrained(out)
    return out


def verify_inputs(vocab: int, batch_size: int, seq_length: int, seed: int = 0) -> dict[str, Any]:
    """Random inputs for a logits comparison (``workbench convert verify``): encoder ids ``[b, s]`` right-padded
    (row i shorter by ~s/3 per row, at least 2 real tokens) with their mask, and decoder ids ``[b, max(s // 2, 2)]``
    starting with the start token 0; what :func:`workbench.models.t5.step.logits_forward` reads."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (batch_size, seq_length), generator=g)
    lengths = torch.tensor([max(2, seq_length - i * max(1, seq_length // 3)) for i in range(batch_size)])
    mask = (torch.arange(seq_length)[None] < lengths[:, None]).long()
    dec = torch.randint(2, vocab, (batch_size, max(seq_length // 2, 2)), generator=g)
    dec[:, 0] = 0
    return {"tokens": tokens, "enc_mask": mask, "dec_tokens": dec}


def hf_logits(hf_dir: str | Path, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """(HF T5 / mT5 decoder logits ``[b, s_dec, V]`` fp32, None: every decoder position is compared)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(input_ids=inputs["tokens"], attention_mask=inputs["enc_mask"], decoder_input_ids=inputs["dec_tokens"])
    return out.logits.float(), None
