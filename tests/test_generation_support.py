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


def gpt2_run_config(tp: int = 1, pp: int = 1, **overrides):
    """The workbench RunConfig of the test GPT-2 (CPU, fp32)."""
    from workbench.config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig

    cfg = RunConfig(
        name="gen-test",
        model=ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=128, max_position_embeddings=POSITIONS, seq_length=64,
                          attention_backend="sdpa"),
        parallel=ParallelConfig(device="cpu", tensor_parallel=tp, pipeline_parallel=pp, nproc_per_node=tp * pp),
        train=TrainConfig(precision="fp32", compile_kernels=False, micro_batch_size=1, global_batch_size=1),
        data=DataConfig(source="synthetic", tokenizer="demo"),
    )
    return cfg.replace(**overrides) if overrides else cfg


def init_single_process(cfg) -> bool:
    """1-process gloo world + megatron parallel state via the backend's test initialiser.

    Returns whether cpu_mode was already enabled (so teardown leaves it as found)."""
    from workbench.backend import cpu_mode, distributed

    was = cpu_mode.enabled()
    distributed.destroy()
    distributed.initialize_for_tests(cfg, port=free_port())
    return was


def teardown_single_process(cpu_mode_was_enabled: bool) -> None:
    from workbench.backend import cpu_mode, distributed

    distributed.destroy()
    if not cpu_mode_was_enabled:
        cpu_mode.disable()


def hf_gpt2(seed: int = 0, init_range: float = 0.2):
    """A random GPT-2 (exact-erf GELU, as mcore's default) with peaky logits so argmax ties are rare."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     initializer_range=init_range, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(cfg).eval()
    return model


def workbench_gpt(cfg, pre_process: bool = True, post_process: bool = True):
    """The model the workbench trains (its layer spec, SDPA core attention), built for this rank."""
    from workbench.backend.model import build_model

    return build_model(cfg, pre_process=pre_process, post_process=post_process).eval()


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
