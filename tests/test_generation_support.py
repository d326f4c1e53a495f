"""Shared fixtures for the generation tests: a random HF GPT-2 and the same weights in mcore.

Test-only: the HF->mcore mapping below is the minimal one the parity tests need; the
product mapping lives in ``workbench.conversion`` (used when it is importable).
"""

from __future__ import annotations

import os
import socket

import torch

VOCAB = 1000          # tokenizer vocabulary (HF model size)
PADDED_VOCAB = 1024   # mcore embedding rows (Megatron pads the vocabulary)
HIDDEN, HEADS, LAYERS, POSITIONS = 64, 4, 2, 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model_parallel(tp: int = 1, pp: int = 1) -> bool:
    """Initialise a 1-process gloo world + megatron model parallel; True if we did it."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        created = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return created


def teardown_model_parallel() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def hf_gpt2(seed: int = 0, init_range: float = 0.2):
    """A random GPT-2 (exact-erf GELU, as mcore's default) with peaky logits so argmax ties are rare."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     initializer_range=init_range, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(cfg).eval()
    return model


def mcore_gpt(pre_process: bool = True, post_process: bool = True):
    """A stock megatron-core GPTModel (local spec, CPU init) with GPT-2's layout."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            layernorm_epsilon=1e-5, params_dtype=torch.float32)
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB, max_sequence_length=POSITIONS,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute").eval()


def hf_to_mcore_state(hf_model) -> dict[str, torch.Tensor]:
    """GPT-2 HF state dict -> full (TP=1) mcore names. Conv1D weights are [in, out]: transpose."""
    sd = hf_model.state_dict()
    out: dict[str, torch.Tensor] = {}
    wte = sd["transformer.wte.weight"]
    emb = torch.zeros(PADDED_VOCAB, HIDDEN)
    emb[: wte.shape[0]] = wte
    out["embedding.word_embeddings.weight"] = emb
    out["embedding.position_embeddings.weight"] = sd["transformer.wpe.weight"].clone()
    hn = HIDDEN // HEADS
    for i in range(LAYERS):
        p, q = f"transformer.h.{i}.", f"decoder.layers.{i}."
        out[q + "input_layernorm.weight"] = sd[p + "ln_1.weight"]
        out[q + "input_layernorm.bias"] = sd[p + "ln_1.bias"]
        w = sd[p + "attn.c_attn.weight"].t()  # [3h, h], rows: all Q, all K, all V
        b = sd[p + "attn.c_attn.bias"]
        # mcore interleaves per head: [q_h, k_h, v_h] for each head
        out[q + "self_attention.linear_qkv.weight"] = w.view(3, HEADS, hn, HIDDEN).transpose(0, 1).reshape(3 * HIDDEN, HIDDEN)
        out[q + "self_attention.linear_qkv.bias"] = b.view(3, HEADS, hn).transpose(0, 1).reshape(3 * HIDDEN)
        out[q + "self_attention.linear_proj.weight"] = sd[p + "attn.c_proj.weight"].t()
        out[q + "self_attention.linear_proj.bias"] = sd[p + "attn.c_proj.bias"]
        out[q + "pre_mlp_layernorm.weight"] = sd[p + "ln_2.weight"]
        out[q + "pre_mlp_layernorm.bias"] = sd[p + "ln_2.bias"]
        out[q + "mlp.linear_fc1.weight"] = sd[p + "mlp.c_fc.weight"].t()
        out[q + "mlp.linear_fc1.bias"] = sd[p + "mlp.c_fc.bias"]
        out[q + "mlp.linear_fc2.weight"] = sd[p + "mlp.c_proj.weight"].t()
        out[q + "mlp.linear_fc2.bias"] = sd[p + "mlp.c_proj.bias"]
    out["decoder.final_layernorm.weight"] = sd["transformer.ln_f.weight"]
    out["decoder.final_layernorm.bias"] = sd["transformer.ln_f.bias"]
    return {k: v.contiguous().clone() for k, v in out.items()}


def load_into(model, full_state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly TP-sharded, possibly one-stage) mcore model."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    layer_offset = 0
    if ps.get_pipeline_model_parallel_world_size() > 1:
        per = LAYERS // ps.get_pipeline_model_parallel_world_size()
        layer_offset = per * ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + layer_offset)
                key = ".".join(parts)
            if key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            full = full_state[key]
            if full.shape != p.shape:
                dim = 0 if full.shape[0] != p.shape[0] else 1
                full = full.chunk(tp, dim=dim)[rank]
            p.copy_(full)
