"""HF Mixtral and Qwen3-MoE <-> megatron-core GPT with MoE layers: config fields and the MoE MLP's tensors.

Both are Llama's decoder (attention and norms convert by :mod:`workbench.models.gpt.hf`'s Llama rules) whose MLP is
a sparse MoE block: HF (transformers 5) holds the router ``mlp.gate.weight [E, h]`` and the experts fused,
``mlp.experts.gate_up_proj [E, 2f, h]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, h, f]``; older
checkpoints hold Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1 / w3 / w2``, or Qwen's
``mlp.gate`` and ``mlp.experts.<e>.gate_proj / up_proj / down_proj`` (the published Qwen3-MoE files; read too).  In
megatron-core the router is ``mlp.router.weight`` and expert ``e`` is ``mlp.experts.local_experts.<e>.linear_fc1``
(``[gate; up]``, megatron's GLU order) and ``linear_fc2``: the full, TP=1 / EP=1 names, which megatron's
distributed checkpoint reshards to any TP / EP / PP on load.  Mixtral's router (softmax, top-k, renormalised) is
megatron's softmax over the top-k scores (``router_pre_softmax: false``); Qwen3-MoE's is that with
``norm_topk_prob: true`` and the softmax over all experts, top-k kept as they are (``router_pre_softmax: true``),
without.

Qwen3-MoE also normalises each query and key head (``self_attn.q_norm`` / ``k_norm``, head_dim wide, before RoPE):
megatron's ``qk_layernorm`` (``model.qk_layernorm``; ``self_attention.q_layernorm`` / ``k_layernorm``), and sizes
its experts by ``moe_intermediate_size`` and its heads by ``head_dim``.  OLMoE's q/k norms span all heads at once
(``q_norm`` over the whole query projection, hidden = num_heads x head_dim wide; ``k_norm`` over the whole key
projection, num_kv_heads x head_dim): ``qk_layernorm`` with ``model.qk_norm_scope: all_heads``
(:mod:`workbench.backend.qk_norms`), the weights copied as they are (megatron's query heads are HF's, in order).  Its
router is Qwen3-MoE's (softmax over all experts, top-k, renormalised where ``norm_topk_prob``), its experts are sized
by ``intermediate_size``, its heads are hidden / heads wide; ``clip_qkv`` (a clamp of q, k, v) and linear biases
have no megatron equivalent and are refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from workbench.families.common import moe
from workbench.models.common.conversion_rules import ConversionError, Rule, copy_rule

__all__ = ["MODEL_TYPES", "model_fields", "is_moe_layer", "experts_to_mcore_rules", "experts_from_mcore_rules",
           "hf_config_fields", "make_random_mixtral", "make_random_qwen3_moe", "make_random_olmoe", "qk_norm_widths"]

MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe")


def model_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    """The MoE part of a Mixtral / Qwen3-MoE / OLMoE config (the Llama part is filled by the caller)."""
    if hf.get("model_type") == "qwen3_moe":
        _qwen3_moe_fields(hf, m)
        return
    if hf.get("model_type") == "olmoe":
        _olmoe_fields(hf, m)
        return
    if hf.get("sliding_window"):
        raise ConversionError(f"config.json: sliding_window {hf['sliding_window']} -> the workbench model attends to the "
                              "whole sequence; only Mixtral configs with sliding_window null convert")
    m["moe"] = dict(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                    ffn_hidden_size=int(hf["intermediate_size"]), router_pre_softmax=False,
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)))


def _qwen3_moe_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    if hf.get("use_sliding_window"):
        raise ConversionError("config.json: use_sliding_window true -> the workbench model attends to the whole sequence; "
                              "only Qwen3-MoE configs with use_sliding_window false convert")
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ConversionError(f"config.json: decoder_sparse_step {hf.get('decoder_sparse_step')} / mlp_only_layers "
                              f"{hf.get('mlp_only_layers')} -> only Qwen3-MoE configs with experts on every layer convert "
                              "(decoder_sparse_step 1, mlp_only_layers [])")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None:
        raise ConversionError("config.json: Qwen3-MoE config without num_experts -> a complete Qwen3MoeConfig")
    m["moe"] = dict(num_experts=int(experts), top_k=int(hf["num_experts_per_tok"]),
                    ffn_hidden_size=int(hf["moe_intermediate_size"]), router_pre_softmax=not hf.get("norm_topk_prob", False),
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))
    m["qk_layernorm"] = True


_OLMOE_NEEDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "max_position_embeddings", "num_experts", "num_experts_per_tok", "rms_norm_eps")


def _olmoe_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    missing = [k for k in _OLMOE_NEEDS if hf.get(k) is None and not (k == "num_experts" and hf.get("num_local_experts"))]
    if missing:
        raise ConversionError(f"config.json: OLMoE config without {', '.join(missing)} -> a complete OlmoeConfig "
                              "(save the model with save_pretrained)")
    if hf.get("clip_qkv") is not None:
        raise ConversionError(f"config.json: clip_qkv {hf['clip_qkv']} -> megatron-core's attention does not clamp q, k and v; "
                              "only OLMoE configs with clip_qkv null convert")
    if hf.get("attention_bias"):
        raise ConversionError("config.json: attention_bias true -> OLMoE's experts have no biases and the workbench model has "
                              "one add_bias_linear switch; only OLMoE configs with attention_bias false convert")
    h, a = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if h % a or int(hf.get("head_dim") or h // a) * a != h:
        raise ConversionError(f"config.json: hidden_size {h} is not num_attention_heads {a} x head_dim -> OLMoE's q_norm "
                              "is hidden_size wide over all heads; only configs with head_dim = hidden_size / heads convert")
    m["moe"] = dict(num_experts=int(hf.get("num_experts") or hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                    ffn_hidden_size=int(hf["intermediate_size"]), router_pre_softmax=not hf.get("norm_topk_prob", False),
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    m["qk_layernorm"], m["qk_norm_scope"] = True, "all_heads"


def qk_norm_widths(m: Any) -> tuple[int, int]:
    """The q and k norms' widths of model section ``m``: head_dim each (per-head, Qwen3's), or all query heads' and all
    KV heads' (``qk_norm_scope: all_heads``, OLMoE's)."""
    if getattr(m, "qk_norm_scope", "head") == "all_heads":
        return m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    return m.head_dim, m.head_dim


def is_moe_layer(cfg: Any, i: int) -> bool:
    """Whether layer ``i`` of the megatron model is an MoE layer."""
    return moe.moe_layers(cfg)[i]


def experts_to_mcore_rules(infos: Mapping[str, Any], s: str, o: str, cfg: Any) -> list[Rule]:
    """One MoE layer's router and experts as conversion rules: HF prefix ``s`` (``model.layers.<i>.``) -> megatron
    prefix ``o``.  transformers 5's fused experts are one source each (the largest single tensors of the checkpoint);
    the older per-expert names (Mixtral's ``w1 / w3 / w2``, Qwen's ``gate_proj / up_proj / down_proj``) convert expert
    by expert."""
    import torch

    E = cfg.model.moe.num_experts
    fc1 = tuple(o + f"mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(E))
    fc2 = tuple(o + f"mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(E))
    if s + "mlp.experts.0.gate_proj.weight" in infos:
        router = s + "mlp.gate.weight"
        names = [tuple(s + f"mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")) for e in range(E)]
    elif s + "block_sparse_moe.gate.weight" in infos:
        b = s + "block_sparse_moe."
        router, names = b + "gate.weight", [tuple(b + f"experts.{e}.{n}.weight" for n in ("w1", "w3", "w2")) for e in range(E)]
    else:
        return [copy_rule(o + "mlp.router.weight", s + "mlp.gate.weight"),
                Rule(fc1, (s + "mlp.experts.gate_up_proj",), _unstack),
                Rule(fc2, (s + "mlp.experts.down_proj",), _unstack)]
    rules = [copy_rule(o + "mlp.router.weight", router)]
    for e, (gate, up, down) in enumerate(names):
        rules += [Rule((fc1[e],), (gate, up), lambda g, u: torch.cat([g, u], dim=0)), copy_rule(fc2[e], down)]
    return rules


def experts_from_mcore_rules(s: str, o: str, cfg: Any) -> list[Rule]:
    """Inverse of :func:`experts_to_mcore_rules` (transformers 5's fused names): megatron prefix ``s`` -> HF prefix
    ``o``."""
    E = cfg.model.moe.num_experts
    fc1 = tuple(s + f"mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(E))
    fc2 = tuple(s + f"mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(E))
    return [copy_rule(o + "mlp.gate.weight", s + "mlp.router.weight"),
            Rule((o + "mlp.experts.gate_up_proj",), fc1, _stack),
            Rule((o + "mlp.experts.down_proj",), fc2, _stack)]


def _unstack(t: Any) -> tuple[Any, ...]:
    return tuple(t[e] for e in range(t.shape[0]))


def _stack(*ts: Any) -> Any:
    import torch

    return torch.stack(ts)


def hf_config_fields(cfg: Any, model_type: str = "mixtral") -> dict[str, Any]:
    """The Mixtral / Qwen3-MoE / OLMoE fields of an exported ``config.json`` (over the Llama ones)."""
    m = cfg.model
    mo = m.moe
    if model_type == "olmoe":
        return _olmoe_config_fields(cfg)
    if model_type == "qwen3_moe":
        if mo.shared_experts or mo.layer_freq != 1 or not m.qk_layernorm or m.qk_norm_scope != "head":
            raise ConversionError("model: HF Qwen3-MoE routes every layer, has no shared experts and normalises q/k per head "
                                  "-> shared_experts 0, layer_freq 1, qk_layernorm true, qk_norm_scope head export to Qwen3-MoE")
        return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": mo.num_experts,
                "num_experts_per_tok": mo.top_k, "moe_intermediate_size": moe.expert_ffn(cfg),
                "norm_topk_prob": not mo.router_pre_softmax, "router_aux_loss_coef": mo.aux_loss_coeff,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
                "output_router_logits": False}
    if mo.router_pre_softmax or mo.shared_experts or mo.layer_freq != 1 or m.qk_layernorm:
        raise ConversionError("model.moe: HF Mixtral routes every layer with a renormalised top-k, no shared experts and "
                              "no q/k norms -> router_pre_softmax false, shared_experts 0, layer_freq 1, qk_layernorm "
                              "false export to Mixtral")
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": mo.num_experts,
            "num_experts_per_tok": mo.top_k, "intermediate_size": moe.expert_ffn(cfg), "router_aux_loss_coef": mo.aux_loss_coeff,
            "sliding_window": None, "output_router_logits": False}


def _olmoe_config_fields(cfg: Any) -> dict[str, Any]:
    m, mo = cfg.model, cfg.model.moe
    if mo.shared_experts or mo.layer_freq != 1 or not m.qk_layernorm or m.qk_norm_scope != "all_heads" or m.add_bias_linear:
        raise ConversionError("model: HF OLMoE routes every layer, has no shared experts and no biases and normalises q/k "
                              "over all heads -> shared_experts 0, layer_freq 1, add_bias_linear false, qk_layernorm true, "
                              "qk_norm_scope all_heads export to OLMoE")
    if m.head_dim * m.num_attention_heads != m.hidden_size:
        raise ConversionError(f"model.kv_channels {m.kv_channels}: HF OLMoE's heads are hidden_size / num_attention_heads "
                              "wide -> kv_channels null (or hidden_size / num_attention_heads) exports to OLMoE")
    return {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "num_experts": mo.num_experts,
            "num_experts_per_tok": mo.top_k, "intermediate_size": moe.expert_ffn(cfg),
            "norm_topk_prob": not mo.router_pre_softmax, "router_aux_loss_coef": mo.aux_loss_coeff, "clip_qkv": None,
            "output_router_logits": False}


def make_random_mixtral(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int, tied: bool,
                        experts: int = 4, top_k: int = 2, ffn: int | None = None) -> Any:
    """A small randomly initialised HF Mixtral (tests, demos)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, intermediate_size=ffn or 2 * hidden,
                                            vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=tied,
                                            num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
                                            bos_token_id=1, eos_token_id=2))


def make_random_qwen3_moe(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int, tied: bool,
                          experts: int = 4, top_k: int = 2, ffn: int | None = None, head_dim: int | None = None,
                          norm_topk_prob: bool = True) -> Any:
    """A small randomly initialised HF Qwen3-MoE (tests, demos); ``head_dim`` defaults to twice hidden / heads (as
    Qwen3's own shapes: head_dim is not hidden / heads)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                              num_key_value_heads=kv_heads, head_dim=head_dim or 2 * hidden // heads,
                                              intermediate_size=2 * hidden, moe_intermediate_size=ffn or hidden,
                                              num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                                              vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=tied,
                                              bos_token_id=1, eos_token_id=2))


def make_random_olmoe(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int, tied: bool,
                      experts: int = 4, top_k: int = 2, ffn: int | None = None, norm_topk_prob: bool = False) -> Any:
    """A small randomly initialised HF OLMoE (tests, demos): q/k norms over all heads, ``norm_topk_prob`` false as
    the published OLMoE-1B-7B."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    return OlmoeForCausalLM(OlmoeConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads, intermediate_size=ffn or hidden, num_experts=experts,
                                        num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob, vocab_size=vocab,
                                        max_position_embeddings=positions, tie_word_embeddings=tied, pad_token_id=0,
                                        bos_token_id=1, eos_token_id=2))
