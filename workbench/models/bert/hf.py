"""HF ``MegatronBertForPreTraining`` (model type ``megatron-bert``) <-> megatron-core BERT: config fields
and per-tensor conversion rules.

HF's megatron-bert is Megatron's pre-LN BERT: a LayerNorm before attention (``attention.ln``) and
before the MLP (``ln``), a final ``encoder.ln``, no embedding LayerNorm, the pooler, the MLM head
(``transform`` dense -> GELU -> LayerNorm, decoder tied to the word embeddings, a vocab bias) and
the sentence-order head (``seq_relationship``).  HF's original ``bert`` is post-LN (a LayerNorm
after each residual sum and after the embeddings): no mapping of weights gives the same function,
so it is refused (:data:`workbench.families.bert.FAMILY` ``supports.hf_refused``).

The generic machinery: the rule vocabulary, vocab padding and the per-group QKV layout are
:mod:`workbench.models.common.conversion_rules`; HF dirs are the conversion tools' (:mod:`workbench.conversion.hf`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from workbench.config import ModelConfig, RunConfig, derive
from workbench.families.bert import FAMILY
from workbench.models.common.conversion_rules import (ConversionError, Rule, TensorInfo, check_sources, copy_rule,
                                                      need_vocab, pad_vocab_rows, qkv_from_mcore, qkv_to_mcore)

__all__ = ["HF_CLASSES", "model_fields", "infer_model_type", "hf_config_dict_from_run", "hf_to_mcore_rules",
           "mcore_to_hf_rules", "make_random_hf_model", "verify_inputs", "hf_logits"]

#: the HF model types this adapter converts, and their HF classes
HF_CLASSES = dict(FAMILY.supports.hf_classes)
_REFUSED = dict(FAMILY.supports.hf_refused)


def model_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    """Fill the RunConfig ``model`` section ``m`` (a dict) from an HF megatron-bert config."""
    mt = hf.get("model_type")
    if mt in _REFUSED:
        raise ConversionError(f"config.json: model_type {mt!r}: {_REFUSED[mt]}")
    if mt != "megatron-bert":
        raise ConversionError(f"model_type {mt!r} is not a BERT-family type -> one of {sorted(HF_CLASSES)}")
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ConversionError(f"config.json: hidden_act {act!r} is not supported -> megatron's BERT uses exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(f"config.json: position_embedding_type {hf.get('position_embedding_type')!r} -> only 'absolute'")
    h, a = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    m.update(
        arch="bert", num_layers=int(hf["num_hidden_layers"]), hidden_size=h, num_attention_heads=a, attention_type="multihead",
        num_query_groups=None, ffn_hidden_size=int(hf["intermediate_size"]), kv_channels=None, vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=int(hf["max_position_embeddings"]),
        seq_length=min(int(hf["max_position_embeddings"]), m.get("seq_length") or 512), position_embedding="learned",
        normalization="layernorm", norm_epsilon=float(hf.get("layer_norm_eps", 1e-12)), activation="gelu", gelu_approximate="none",
        add_bias_linear=True, hidden_dropout=float(hf.get("hidden_dropout_prob", 0.0)),
        attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.0)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), init_method_std=float(hf.get("initializer_range", 0.02)),
        num_tokentypes=int(hf.get("type_vocab_size", 2)), add_binary_head=True, add_pooler=False,
    )


def infer_model_type(m: ModelConfig) -> str:
    """megatron-bert, or a clear refusal naming what has no HF equivalent."""
    problems = []
    if m.position_embedding != "learned":
        problems.append("position_embedding must be learned")
    if m.normalization != "layernorm" or m.activation != "gelu" or m.gelu_approximate != "none":
        problems.append("HF megatron-bert has LayerNorm and exact GELU")
    if m.query_groups != m.num_attention_heads or (m.kv_channels and m.kv_channels * m.num_attention_heads != m.hidden_size):
        problems.append("HF megatron-bert needs multi-head attention with head_dim = hidden/heads")
    if not m.add_bias_linear:
        problems.append("HF megatron-bert always has linear biases")
    if not m.add_binary_head:
        problems.append("MegatronBertForPreTraining has the pooler and sentence-order head: train with add_binary_head: true")
    if problems:
        raise ConversionError("model has no HF MegatronBertForPreTraining equivalent: " + "; ".join(problems))
    return "megatron-bert"


def hf_config_dict_from_run(cfg: RunConfig, model_type: str, hf_extra: dict | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json content for the exported HF model (the pad id is kept from an imported config)."""
    m = cfg.model
    extra = dict(hf_extra or {})
    out = {
        "model_type": "megatron-bert", "architectures": ["MegatronBertForPreTraining"], "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "intermediate_size": m.ffn_size, "hidden_act": "gelu", "hidden_dropout_prob": m.hidden_dropout,
        "attention_probs_dropout_prob": m.attention_dropout, "max_position_embeddings": m.max_position_embeddings,
        "type_vocab_size": max(m.num_tokentypes, 1), "initializer_range": m.init_method_std, "layer_norm_eps": m.norm_epsilon,
        "position_embedding_type": "absolute", "tie_word_embeddings": m.tie_embeddings, "pad_token_id": extra.get("pad_token_id", 0),
    }
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    return out


#: the MLM logits' bias of an untied HF head (tied, it is ``cls.predictions.bias``)
_DECODER_BIAS = "cls.predictions.decoder.bias"

_LAYER = [  # (mcore suffix, HF suffix) of the per-layer tensors other than QKV
    ("input_layernorm.weight", "attention.ln.weight"), ("input_layernorm.bias", "attention.ln.bias"),
    ("self_attention.linear_proj.weight", "attention.output.dense.weight"),
    ("self_attention.linear_proj.bias", "attention.output.dense.bias"),
    ("pre_mlp_layernorm.weight", "ln.weight"), ("pre_mlp_layernorm.bias", "ln.bias"),
    ("mlp.linear_fc1.weight", "intermediate.dense.weight"), ("mlp.linear_fc1.bias", "intermediate.dense.bias"),
    ("mlp.linear_fc2.weight", "output.dense.weight"), ("mlp.linear_fc2.bias", "output.dense.bias"),
]
_TOP = [  # (mcore, HF) outside the layers, vocab-free
    ("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
    ("encoder.final_layernorm.weight", "bert.encoder.ln.weight"), ("encoder.final_layernorm.bias", "bert.encoder.ln.bias"),
    ("pooler.dense.weight", "bert.pooler.dense.weight"), ("pooler.dense.bias", "bert.pooler.dense.bias"),
    ("lm_head.dense.weight", "cls.predictions.transform.dense.weight"), ("lm_head.dense.bias", "cls.predictions.transform.dense.bias"),
    ("lm_head.layer_norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("lm_head.layer_norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("binary_head.weight", "cls.seq_relationship.weight"), ("binary_head.bias", "cls.seq_relationship.bias"),
]


def hf_to_mcore_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str) -> list[Rule]:
    """The rules mapping an HF MegatronBertForPreTraining checkpoint (``infos``: its tensors' names and shapes) to
    the full TP=1 megatron-core BERT state dict; a missing tensor or a wrong vocabulary is refused."""
    m = cfg.model
    if model_type != "megatron-bert":
        raise ConversionError(f"model_type {model_type!r}: {_REFUSED.get(model_type, 'not supported')}")
    a, g, d = m.num_attention_heads, m.query_groups, m.head_dim
    padded = derive(cfg).padded_vocab_size
    src = "HF megatron-bert"
    pad = lambda t: pad_vocab_rows(t, padded)  # noqa: E731
    qkv = lambda q, k, v: qkv_to_mcore(q, k, v, a, g, d)  # noqa: E731
    need_vocab(infos, "bert.embeddings.word_embeddings.weight", src, m.vocab_size)
    rules = [Rule(("embedding.word_embeddings.weight",), ("bert.embeddings.word_embeddings.weight",), pad)]
    if m.num_tokentypes > 0:
        n = m.num_tokentypes
        rules.append(Rule(("embedding.tokentype_embeddings.weight",), ("bert.embeddings.token_type_embeddings.weight",),
                          lambda t: t[:n]))
    for i in range(m.num_layers):
        s, o = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
        rules += [Rule((o + "self_attention.linear_qkv.weight",),
                       tuple(s + f"attention.self.{n}.weight" for n in ("query", "key", "value")), qkv),
                  Rule((o + "self_attention.linear_qkv.bias",),
                       tuple(s + f"attention.self.{n}.bias" for n in ("query", "key", "value")), qkv)]
        rules += [copy_rule(o + mk, s + hk) for mk, hk in _LAYER]
    rules += [copy_rule(mk, hk) for mk, hk in _TOP]
    # the logits' bias: tied, HF ties decoder.bias to cls.predictions.bias; untied, the decoder (weight and bias) is its own
    rules.append(Rule(("output_layer.bias",), (_DECODER_BIAS if not m.tie_embeddings else "cls.predictions.bias",), pad))
    if not m.tie_embeddings:
        rules.append(Rule(("output_layer.weight",), ("cls.predictions.decoder.weight",), pad))
    check_sources(rules, infos, src)
    return rules


def mcore_to_hf_rules(infos: Mapping[str, TensorInfo], cfg: RunConfig, model_type: str,
                      read: Callable[[str], Any] | None = None) -> list[Rule]:
    """The rules of :func:`hf_to_mcore_rules`'s inverse, from the full TP=1 megatron-core BERT state dict
    (``infos``): pad rows are stripped (they never reach HF)."""
    import torch

    m = cfg.model
    a, g, d, V = m.num_attention_heads, m.query_groups, m.head_dim, m.vocab_size
    src = "megatron checkpoint"
    emb = "embedding.word_embeddings.weight"
    rows = lambda t: t[:V]  # noqa: E731
    rules = [Rule(("bert.embeddings.word_embeddings.weight",), (emb,), rows)]
    if m.num_tokentypes > 0:
        rules.append(copy_rule("bert.embeddings.token_type_embeddings.weight", "embedding.tokentype_embeddings.weight"))
    else:  # HF always has a token-type table; one zero row adds nothing
        dt, h = infos[emb].dtype if emb in infos else torch.float32, m.hidden_size
        rules.append(Rule(("bert.embeddings.token_type_embeddings.weight",), (), lambda: torch.zeros(1, h, dtype=dt)))
    split = lambda t: qkv_from_mcore(t, a, g, d)  # noqa: E731
    for i in range(m.num_layers):
        s, o = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        rules += [Rule(tuple(o + f"attention.self.{n}.weight" for n in ("query", "key", "value")),
                       (s + "self_attention.linear_qkv.weight",), split),
                  Rule(tuple(o + f"attention.self.{n}.bias" for n in ("query", "key", "value")),
                       (s + "self_attention.linear_qkv.bias",), split)]
        rules += [copy_rule(o + hk, s + mk) for mk, hk in _LAYER]
    rules += [copy_rule(hk, mk) for mk, hk in _TOP]
    # tied: the decoder's bias is HF's tied copy of cls.predictions.bias and its weight the word embeddings, both left
    # out (from_pretrained ties them), as HF's own save_pretrained does; untied, HF computes the logits with the
    # decoder's own weight and bias (cls.predictions.bias is then unused), so both are written
    if m.tie_embeddings:
        rules.append(Rule(("cls.predictions.bias",), ("output_layer.bias",), rows))
    else:
        rules.append(Rule(("cls.predictions.bias", _DECODER_BIAS), ("output_layer.bias",), lambda t: (t[:V], t[:V].clone())))
        rules.append(Rule(("cls.predictions.decoder.weight",), ("output_layer.weight",), rows))
    check_sources(rules, infos, src)
    return rules


def make_random_hf_model(out: str | Path, model_type: str = "megatron-bert", hidden: int = 96, layers: int = 4, heads: int = 6,
                         kv_heads: int = 0, vocab: int = 1000, positions: int = 128, seed: int = 0, *, tied: bool = True) -> Path:
    """A small randomly initialised HF MegatronBertForPreTraining dir for demos and tests (``kv_heads`` is unused;
    ``tied``: the MLM decoder shares the word embeddings, else it has its own weight and bias)."""
    import torch
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    if model_type != "megatron-bert":
        raise ConversionError(f"model_type {model_type!r} -> megatron-bert")
    torch.manual_seed(seed)
    model = MegatronBertForPreTraining(MegatronBertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=2 * hidden,
        max_position_embeddings=positions, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=tied))
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot hide behind ones and zeros
        for name, p in model.named_parameters():
            if name.endswith(("bias", "ln.weight", "LayerNorm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    out = Path(out)
    model.save_pretrained(out)
    return out


def verify_inputs(vocab: int, batch_size: int, seq_length: int, seed: int = 0) -> dict[str, Any]:
    """Random ``[b, s]`` inputs for a logits comparison: token ids, right padding (row i shorter by ~s/3 per row,
    at least 2 real tokens) and two token types (sentence B from the middle); what
    :func:`workbench.models.bert.step.logits_forward` reads."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch_size, seq_length), generator=g)
    lengths = torch.tensor([max(2, seq_length - i * max(1, seq_length // 3)) for i in range(batch_size)])
    mask = (torch.arange(seq_length)[None] < lengths[:, None]).long()
    types = ((torch.arange(seq_length)[None] >= (lengths[:, None] // 2)).long()) * mask
    return {"tokens": tokens, "padding_mask": mask, "tokentype_ids": types}


def hf_logits(hf_dir: str | Path, inputs: dict[str, Any]) -> tuple[Any, Any]:
    """(HF MegatronBertForPreTraining MLM logits ``[b, s, V]`` fp32, the real (unpadded) positions to compare)."""
    import torch
    from transformers import MegatronBertForPreTraining

    hf = MegatronBertForPreTraining.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    mask = inputs["padding_mask"]
    b, s = mask.shape
    with torch.no_grad():  # explicit positions: HF's position_ids buffer is left uninitialised when megatron-core has
        out = hf(input_ids=inputs["tokens"], attention_mask=mask, token_type_ids=inputs["tokentype_ids"],  # run in this process
                 position_ids=torch.arange(s)[None].expand(b, -1))
    return out.prediction_logits.float(), mask.bool()
