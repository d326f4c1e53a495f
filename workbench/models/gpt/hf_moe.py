"""HF Mixtral <-> megatron-core GPT with MoE layers: config fields and the MoE MLP's tensors.

Mixtral is Llama's decoder (its attention and norms convert by :mod:`workbench.models.gpt.hf`'s Llama rules) whose
MLP is a sparse MoE block: HF (transformers 5) holds the router ``mlp.gate.weight [E, h]`` and the experts fused,
``mlp.experts.gate_up_proj [E, 2f, h]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, h, f]``; older
checkpoints hold ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.<e>.w1 / w3 / w2`` (read too).  In
megatron-core the router is ``mlp.router.weight`` and expert ``e`` is ``mlp.experts.local_experts.<e>.linear_fc1``
(``[gate; up]``, megatron's GLU order) and ``linear_fc2``: the full, TP=1 / EP=1 names, which megatron's
distributed checkpoint reshards to any TP / EP / PP on load.  Mixtral's router (softmax, top-k, renormalised) is
megatron's softmax over the top-k scores (``router_pre_softmax: false``).

Qwen3-MoE and OLMoE are refused (GPT's ``Supports.hf_refused``): both normalise queries and keys (Qwen3 per head,
OLMoE over all heads), which the workbench model does not have yet.
"""

from __future__ import annotations

from typing import Any, Mapping

from workbench.conversion.errors import ConversionError
from workbench.conversion.rules import Rule, copy_rule
from workbench.models.common import moe

__all__ = ["MODEL_TYPES", "model_fields", "is_moe_layer", "experts_to_mcore_rules", "experts_from_mcore_rules",
           "hf_config_fields", "make_random_mixtral"]

MODEL_TYPES = ("mixtral",)


def model_fields(hf: dict[str, Any], m: dict[str, Any]) -> None:
    """The MoE part of a Mixtral config (the Llama part is filled by the caller)."""
    if hf.get("sliding_window"):
        raise ConversionError(f"config.json: sliding_window {hf['sliding_window']} -> the workbench model attends to the "
                              "whole sequence; only Mixtral configs with sliding_window null convert")
    m["moe"] = dict(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                    ffn_hidden_size=int(hf["intermediate_size"]), router_pre_softmax=False,
                    aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.02)))


def is_moe_layer(cfg: Any, i: int) -> bool:
    """Whether layer ``i`` of the megatron model is an MoE layer."""
    return moe.moe_layers(cfg)[i]


def experts_to_mcore_rules(infos: Mapping[str, Any], s: str, o: str, cfg: Any) -> list[Rule]:
    """One MoE layer's router and experts as conversion rules: HF prefix ``s`` (``model.layers.<i>.``) -> megatron
    prefix ``o``.  transformers 5's fused experts are one source each (the largest single tensors of the checkpoint);
    the older per-expert names convert expert by expert."""
    import torch

    E = cfg.model.moe.num_experts
    fc1 = tuple(o + f"mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(E))
    fc2 = tuple(o + f"mlp.experts.local_experts.{e}.linear_fc2.weight" for e in range(E))
    if s + "mlp.gate.weight" in infos:
        return [copy_rule(o + "mlp.router.weight", s + "mlp.gate.weight"),
                Rule(fc1, (s + "mlp.experts.gate_up_proj",), _unstack),
                Rule(fc2, (s + "mlp.experts.down_proj",), _unstack)]
    b = s + "block_sparse_moe."
    rules = [copy_rule(o + "mlp.router.weight", b + "gate.weight")]
    for e in range(E):
        rules += [Rule((fc1[e],), (b + f"experts.{e}.w1.weight", b + f"experts.{e}.w3.weight"),
                       lambda w1, w3: torch.cat([w1, w3], dim=0)),
                  copy_rule(fc2[e], b + f"experts.{e}.w2.weight")]
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


def hf_config_fields(cfg: Any) -> dict[str, Any]:
    """The Mixtral fields of an exported ``config.json`` (over the Llama ones)."""
    m = cfg.model
    mo = m.moe
    if mo.router_pre_softmax or mo.shared_experts or mo.layer_freq != 1:
        raise ConversionError("model.moe: HF Mixtral routes every layer with a renormalised top-k and no shared experts -> "
                              "router_pre_softmax false, shared_experts 0, layer_freq 1 export to Mixtral")
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": mo.num_experts,
            "num_experts_per_tok": mo.top_k, "intermediate_size": moe.expert_ffn(cfg), "router_aux_loss_coef": mo.aux_loss_coeff,
            "sliding_window": None, "output_router_logits": False}


def make_random_mixtral(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, positions: int, tied: bool,
                        experts: int = 4, top_k: int = 2, ffn: int | None = None) -> Any:
    """A small randomly initialised HF Mixtral (tests, demos)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                            num_key_value_heads=kv_heads, intermediate_size=ffn or 2 * hidden,
                                            vocab_size=vocab, max_position_embeddings=positions, tie_word_embeddings=tied,
                                            num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
                                            bos_token_id=1, eos_token_id=2))
