"""Shared fixtures for the generation tests: a random HF GPT-2 and the same weights in the
workbench's mcore model (config and weight mapping from ``workbench.conversion``)."""

from __future__ import annotations

import os
import socket

import torch

VOCAB = 1000          # tokenizer vocabulary (HF model size; mcore pads it to 1024)
HIDDEN, HEADS, LAYERS, POSITIONS = 64, 4, 2, 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpt2_run_config(hf_model, tp: int = 1, pp: int = 1):
    """The workbench RunConfig of an HF GPT-2, from the conversion helper's mapping (CPU, fp32)."""
    from workbench.conversion.hf import run_config_from_hf

    cfg = run_config_from_hf(hf_model.config.to_dict(), tp=tp, pp=pp, dtype="fp32", make_vocab_size_divisible_by=128)
    return cfg.replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": tp * pp, "model.attention_backend": "sdpa",
                          "train.compile_kernels": False, "train.micro_batch_size": 1, "train.global_batch_size": 1,
                          "data.source": "synthetic"})


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
    """A random GPT-2 (stock gelu_new) with peaky logits (init std 0.2) so argmax ties are rare."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     initializer_range=init_range, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(cfg).eval()
    return model


def workbench_gpt(cfg, pre_process: bool = True, post_process: bool = True):
    """The model the workbench trains (its layer spec, SDPA core attention), built for this rank."""
    from workbench.backend.model import build_model

    return build_model(cfg, pre_process=pre_process, post_process=post_process).eval()


def converted_state(hf_model, cfg) -> dict[str, torch.Tensor]:
    """HF GPT-2 weights as the full (TP=1) mcore state dict, via ``workbench.conversion``."""
    from workbench.conversion.hf import hf_to_mcore

    return hf_to_mcore(hf_model.state_dict(), cfg, "gpt2")


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
