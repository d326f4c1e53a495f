"""Legacy Megatron-LM GPT checkpoints (``mp_rank_XX[_YYY]/model_optim_rng.pt``) -> full mcore state dict.

The pre-mcore format (e.g. NVIDIA's NGC ``megatron_gpt2_345m`` release) keeps
``model.language_model.{embedding, encoder|transformer[, output_layer]}`` per tensor-parallel
rank (``mp_rank_XX``) and pipeline stage (``mp_rank_XX_YYY``), with stage-local layer
numbers.  Merging rules: vocab-parallel embeddings and column-parallel weights concatenate
along dim 0, row-parallel weights along dim 1, replicated tensors come from rank 0.  The fused
``query_key_value`` rows depend on ``checkpoint_version``: 0 = ``[3, heads, d]``,
1.0 = ``[heads, d, 3]``, >= 2.0 = ``[heads, 3, d]`` (= mcore's per-group layout with one
head per group); each TP shard is reordered before concatenation.

Files are read with ``torch.load(weights_only=True)``; the ``args`` Namespace (and numpy
RNG states) that Megatron-LM pickles are allowlisted explicitly instead of unpickling
arbitrary objects.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.config import RunConfig
from workbench.models.common.conversion_rules import ConversionError, pad_vocab_rows

__all__ = ["LegacyCheckpoint", "find_legacy_files", "load_legacy", "legacy_to_mcore", "safe_torch_load", "lm_tensors"]

_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def safe_torch_load(path: Path) -> Any:
    """:func:`workbench.checkpoint.safe_torch_load` with only argparse.Namespace (and numpy arrays) admitted
    beyond tensors and plain data."""
    from workbench.checkpoint import safe_torch_load as load

    safe: list[Any] = [argparse.Namespace]
    try:
        import numpy as np

        safe += [np.ndarray, np.dtype, np.core.multiarray._reconstruct, type(np.dtype(np.uint32))]
        safe += [type(np.dtype(t)) for t in (np.float32, np.float64, np.int64, np.int32, np.uint8)]
    except Exception:
        pass
    return load(str(path), source=str(path), allow=tuple(safe), error=ConversionError,
                fix="it was not loaded: unpickling it could run code (it pickles objects other than tensors and "
                    "argparse.Namespace) -> re-save its state dict (torch.save(ckpt['model'], ...)) in a trusted environment")


def find_legacy_files(path: str | Path) -> dict[tuple[int, int], Path]:
    """{(tp_rank, pp_rank): model_optim_rng.pt} under a legacy root, iteration dir, or single file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConversionError(f"legacy checkpoint {p} does not exist -> check the path")
    if p.is_file():
        return {(0, 0): p}
    tracker = p / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        t = tracker.read_text(errors="replace").strip()
        if t != "release" and not re.fullmatch(r"[0-9]+", t):  # (str.isdigit takes '²')
            raise ConversionError(f"{tracker} holds {t[:40]!r}, not an iteration number or 'release' -> point at the "
                                  "iteration directory (iter_XXXXXXX) to convert")
        sub = p / ("release" if t == "release" else f"iter_{int(t):07d}")
        if not sub.is_dir():  # the latest save, deleted or moved: never an older iteration in its place
            raise ConversionError(f"{tracker} names {sub.name}, but {sub} is not there (deleted or moved after its save) "
                                  "-> copy the checkpoint again from its source, or point at an iteration directory that is")
        p = sub
    elif not any(_RANK_RE.match(x.name) for x in p.iterdir()):
        subs = sorted(x for x in p.iterdir() if x.is_dir() and (x.name == "release" or x.name.startswith("iter_")))
        if subs:
            p = subs[-1]
    files: dict[tuple[int, int], Path] = {}
    for d in p.iterdir():
        m = _RANK_RE.match(d.name)
        if m and d.is_dir():
            f = d / "model_optim_rng.pt"
            if not f.is_file():
                cands = sorted(d.glob("*.pt"))
                if not cands:
                    raise ConversionError(f"{d}: no model_optim_rng.pt -> the checkpoint copy is incomplete")
                f = cands[0]
            files[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not files:
        raise ConversionError(f"{p}: no mp_rank_XX[_YYY]/model_optim_rng.pt -> point at a Megatron-LM checkpoint "
                              "(root with latest_checkpointed_iteration.txt, an iter_/release dir, or the .pt file)")
    tps = sorted({k[0] for k in files})
    pps = sorted({k[1] for k in files})
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(files) != len(tps) * len(pps):
        raise ConversionError(f"{p}: rank directories are incomplete (tp ranks {tps}, pp ranks {pps}) -> copy every mp_rank_* directory")
    return files


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


@dataclass
class LegacyCheckpoint:
    """Merged view of a legacy checkpoint: full tensors by legacy name (global layer numbers) + args."""

    tensors: dict[str, Any]
    args: Any
    checkpoint_version: float
    tp: int
    pp: int
    iteration: int


def lm_tensors(ckpt: dict, f: Path) -> dict[str, Any]:
    model = ckpt.get("model", ckpt)
    flat = _flatten(model)
    lm = {k.split("language_model.", 1)[1]: v for k, v in flat.items() if "language_model." in k}
    if not lm:
        raise ConversionError(f"{f}: no 'language_model.*' tensors -> not a legacy Megatron-LM GPT checkpoint")
    # normalise names: 'transformer.' (oldest) -> 'encoder.'; 'attention.' vs 'self_attention.'
    out = {}
    for k, v in lm.items():
        k = re.sub(r"^transformer\.", "encoder.", k)
        k = k.replace(".self_attention.", ".attention.")
        out[k] = v
    return out


def _qkv_per_head(t: Any, heads: int, version: float) -> Any:
    """A TP shard of query_key_value (``heads`` local heads) -> [heads, 3, d] layout (flattened rows)."""
    tail = t.shape[1:]
    d = t.shape[0] // (3 * heads)
    if version >= 2.0:
        return t
    if version >= 1.0:  # [heads, d, 3]
        x = t.reshape(heads, d, 3, *tail).transpose(1, 2)
    else:  # [3, heads, d]
        x = t.reshape(3, heads, d, *tail).transpose(0, 1)
    return x.reshape(-1, *tail).contiguous()


def load_legacy(path: str | Path, num_attention_heads: int | None = None) -> LegacyCheckpoint:
    """Read and merge every TP shard / PP stage into full tensors with global layer numbers."""
    import torch

    files = find_legacy_files(path)
    tp = max(k[0] for k in files) + 1
    pp = max(k[1] for k in files) + 1
    first = safe_torch_load(files[(0, 0)])
    args = first.get("args") if isinstance(first, dict) else None
    version = float(first.get("checkpoint_version", 0.0) or 0.0) if isinstance(first, dict) else 0.0
    iteration = int(first.get("iteration", 0) or 0) if isinstance(first, dict) else 0
    heads = num_attention_heads or getattr(args, "num_attention_heads", None)
    if not heads:
        raise ConversionError(f"{files[(0, 0)]}: no 'args' with num_attention_heads in the checkpoint -> pass --num-attention-heads")
    if heads % tp:
        raise ConversionError(f"num_attention_heads {heads} is not divisible by the checkpoint's {tp} tensor-parallel shards")
    local_heads = heads // tp

    # per stage: {name: [shard tensors over tp]}
    stages: list[dict[str, list[Any]]] = []
    for s in range(pp):
        per: dict[str, list[Any]] = {}
        for r in range(tp):
            ck = first if (r, s) == (0, 0) else safe_torch_load(files[(r, s)])
            for k, v in lm_tensors(ck, files[(r, s)]).items():
                if torch.is_tensor(v):
                    per.setdefault(k, []).append(v)
        stages.append(per)

    def merge(name: str, shards: list[Any]) -> Any:
        if len(shards) == 1:
            return shards[0]
        if "query_key_value" in name:
            return torch.cat([_qkv_per_head(x, local_heads, version) for x in shards], dim=0)
        if name.endswith("word_embeddings.weight") or name.startswith("output_layer.") or "dense_h_to_4h" in name:
            return torch.cat(shards, dim=0)
        if name.endswith((".dense.weight", "dense_4h_to_h.weight")):
            return torch.cat(shards, dim=1)
        return shards[0]  # replicated: layernorms, row-parallel biases, position embeddings

    tensors: dict[str, Any] = {}
    offset = 0
    for s, per in enumerate(stages):
        layer_ids = sorted({int(m.group(1)) for k in per for m in [re.match(r"encoder\.layers\.(\d+)\.", k)] if m})
        for k, shards in per.items():
            v = merge(k, shards)
            if tp == 1 and "query_key_value" in k:
                v = _qkv_per_head(v, local_heads, version)
            m = re.match(r"encoder\.layers\.(\d+)\.(.*)$", k)
            if m:
                k = f"encoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
            elif k.startswith("word_embeddings_for_head") or (s > 0 and k.startswith("embedding.")):
                continue  # last-stage copy of tied embeddings
            tensors[k] = v
        offset += len(layer_ids)
    return LegacyCheckpoint(tensors, args, version, tp, pp, iteration)


def run_config_from_legacy(ck: LegacyCheckpoint, vocab_size: int | None = None, num_attention_heads: int | None = None,
                           tp: int = 1, pp: int = 1, vpp: int | None = None, dtype: str | None = None,
                           make_vocab_size_divisible_by: int | None = None, base: RunConfig | None = None) -> RunConfig:
    """The workbench config of a legacy GPT checkpoint (from its args, shapes where args are missing)."""
    t, a = ck.tensors, ck.args
    emb = t.get("embedding.word_embeddings.weight")
    if emb is None:
        raise ConversionError("legacy checkpoint has no embedding.word_embeddings.weight")
    layers = sorted({int(m.group(1)) for k in t for m in [re.match(r"encoder\.layers\.(\d+)\.", k)] if m})
    h = emb.shape[1]
    fc1 = t.get(f"encoder.layers.{layers[0]}.mlp.dense_h_to_4h.weight") if layers else None
    heads = num_attention_heads or getattr(a, "num_attention_heads", None)
    pos = t.get("embedding.position_embeddings.weight")
    if pos is None:
        raise ConversionError("legacy checkpoint has no learned position embeddings: only GPT-2 style legacy models are supported")
    if fc1 is not None and fc1.shape[0] != (getattr(a, "ffn_hidden_size", None) or fc1.shape[0]):
        raise ConversionError("legacy checkpoint's dense_h_to_4h does not match args.ffn_hidden_size (SwiGLU legacy models are not supported)")
    if getattr(a, "swiglu", False):
        raise ConversionError("legacy SwiGLU checkpoints are not supported; only GPT-2 style (GELU) legacy models")
    V = int(vocab_size or emb.shape[0])
    if V > emb.shape[0]:
        raise ConversionError(f"--vocab-size {V} is larger than the checkpoint's {emb.shape[0]} embedding rows")
    gelu_tanh = bool(getattr(a, "openai_gelu", False) or getattr(a, "bias_gelu_fusion", True))
    d = (base or RunConfig(name="megatron-lm-import")).to_dict()
    d["model"].update(
        num_layers=len(layers), hidden_size=int(h), num_attention_heads=int(heads), attention_type="multihead",
        num_query_groups=None, ffn_hidden_size=int(fc1.shape[0]) if fc1 is not None else 4 * h, kv_channels=None,
        vocab_size=V, max_position_embeddings=int(pos.shape[0]),
        seq_length=min(int(getattr(a, "seq_length", None) or pos.shape[0]), int(pos.shape[0])),
        position_embedding="learned", normalization="layernorm",
        norm_epsilon=float(getattr(a, "layernorm_epsilon", 1e-5)), activation="gelu",
        gelu_approximate="tanh" if gelu_tanh else "none", add_bias_linear=True,
        hidden_dropout=0.0, attention_dropout=0.0,
        tie_embeddings="output_layer.weight" not in t,
    )
    if make_vocab_size_divisible_by:
        d["model"]["make_vocab_size_divisible_by"] = int(make_vocab_size_divisible_by)
    d["parallel"].update(tensor_parallel=tp, pipeline_parallel=pp, virtual_pipeline_parallel=vpp if vpp and vpp > 1 else None,
                         nnodes=1, nproc_per_node=tp * pp)
    if dtype:
        d["train"]["precision"] = dtype
    return RunConfig.from_dict(d)


def legacy_to_mcore(ck: LegacyCheckpoint, cfg: RunConfig, padded_vocab: int) -> dict[str, Any]:
    """Legacy names -> stock mcore names (full TP=1 state dict; vocab re-padded for the target)."""
    t = ck.tensors
    V = cfg.model.vocab_size

    def need(k: str) -> Any:
        if k not in t:
            raise ConversionError(f"legacy checkpoint: tensor language_model.{k} is missing")
        return t[k]

    out = {
        "embedding.word_embeddings.weight": pad_vocab_rows(need("embedding.word_embeddings.weight")[:V], padded_vocab),
        "embedding.position_embeddings.weight": need("embedding.position_embeddings.weight"),
        "decoder.final_layernorm.weight": need("encoder.final_layernorm.weight"),
        "decoder.final_layernorm.bias": need("encoder.final_layernorm.bias"),
    }
    names = {
        "input_layernorm.weight": "input_layernorm.weight", "input_layernorm.bias": "input_layernorm.bias",
        "attention.query_key_value.weight": "self_attention.linear_qkv.weight",
        "attention.query_key_value.bias": "self_attention.linear_qkv.bias",
        "attention.dense.weight": "self_attention.linear_proj.weight", "attention.dense.bias": "self_attention.linear_proj.bias",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight", "post_attention_layernorm.bias": "pre_mlp_layernorm.bias",
        "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight", "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
        "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight", "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
    }
    for i in range(cfg.model.num_layers):
        for src, dst in names.items():
            out[f"decoder.layers.{i}.{dst}"] = need(f"encoder.layers.{i}.{src}")
    if not cfg.model.tie_embeddings:
        out["output_layer.weight"] = pad_vocab_rows(need("output_layer.weight")[:V], padded_vocab)
    return {k: v.contiguous() for k, v in out.items()}
