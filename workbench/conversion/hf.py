"""Hugging Face <-> megatron-core: configs and full (unsharded) state dicts, for every model family.

The model-specific parts (HF config fields, tensor names) are each family's ``hf`` adapter
(``workbench/models/<family>/hf.py``); this module reads and writes HF directories, pads
vocabularies and dispatches to the adapter of an HF ``model_type``.

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

from workbench.config import ModelConfig, RunConfig
from workbench.models import FAMILIES, family_for_hf, family_of

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

#: HF model_type -> the HF class, over every family's adapter
SUPPORTED_MODEL_TYPES = {mt: cls for f in FAMILIES.values() for mt, cls in f.supports.hf_classes}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")


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
    refused = {t: why for f in FAMILIES.values() for t, why in f.supports.hf_refused}
    if mt in refused:
        raise ConversionError(f"{cfg}: model_type {mt!r} is refused: {refused[mt]}")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"{cfg}: model_type {mt!r} is not supported -> supported: {', '.join(f'{k} ({v})' for k, v in SUPPORTED_MODEL_TYPES.items())}")
    return data


def run_config_from_hf(hf: dict[str, Any], base: RunConfig | None = None, tp: int = 1, pp: int = 1,
                       vpp: int | None = None, dtype: str | None = None,
                       make_vocab_size_divisible_by: int | None = None) -> RunConfig:
    """The workbench RunConfig implied by an HF config, with the requested layout (not yet validated)."""
    mt = hf.get("model_type")
    d = (base or RunConfig(name=f"{mt}-converted")).to_dict()
    m = d["model"]
    fam = family_for_hf(mt or "")
    if fam is None:
        raise ConversionError(f"model_type {mt!r} is not supported -> one of {sorted(SUPPORTED_MODEL_TYPES)}")
    m["arch"] = fam.name
    fam.part("hf").model_fields(hf, m)
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



def _adapter(model_type: str) -> Any:
    fam = family_for_hf(model_type)
    if fam is None:
        raise ConversionError(f"model_type {model_type!r} is not supported -> one of {sorted(SUPPORTED_MODEL_TYPES)}")
    return fam.part("hf")


def infer_model_type(m: ModelConfig) -> str:
    """Which HF architecture a workbench model maps onto (its family's adapter decides), or a clear refusal."""
    if not family_of(m.arch).supports.hf_model_types:
        raise ConversionError(f"model.arch {m.arch!r} has no Hugging Face adapter")
    return family_of(m.arch).part("hf").infer_model_type(m)


def hf_config_dict_from_run(cfg: RunConfig, model_type: str, hf_extra: dict | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json content for the exported HF model (token ids etc. kept from the imported config when known)."""
    return _adapter(model_type).hf_config_dict_from_run(cfg, model_type, hf_extra, dtype)


def hf_to_mcore(hf_sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Map an HF state dict to the full TP=1 megatron-core state dict (vocab padded per ``derive(cfg)``)."""
    return _adapter(model_type).hf_to_mcore(hf_sd, cfg, model_type, dtype, progress)


def mcore_to_hf(sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Map a full TP=1 megatron-core state dict to HF names (vocab padding stripped)."""
    return _adapter(model_type).mcore_to_hf(sd, cfg, model_type, dtype, progress)


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


def qkv_to_mcore(q: Any, k: Any, v: Any, heads: int, groups: int, d: int) -> Any:
    import torch

    tail = q.shape[1:]
    q = q.reshape(groups, heads // groups * d, *tail)
    k = k.reshape(groups, d, *tail)
    v = v.reshape(groups, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()


def qkv_from_mcore(qkv: Any, heads: int, groups: int, d: int) -> tuple[Any, Any, Any]:
    tail = qkv.shape[1:]
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *tail)
    q = x[:, : per * d].reshape(heads * d, *tail).contiguous()
    k = x[:, per * d: (per + 1) * d].reshape(groups * d, *tail).contiguous()
    v = x[:, (per + 1) * d:].reshape(groups * d, *tail).contiguous()
    return q, k, v


def take(sd: dict, key: str, src: str) -> Any:
    if key not in sd:
        raise ConversionError(f"{src}: tensor {key!r} is missing -> is this a complete {src} checkpoint of the configured architecture?")
    return sd[key]


def take_vocab(sd: dict, key: str, src: str, vocab_size: int) -> Any:
    """:func:`take` a vocabulary-indexed tensor (word embeddings, an output head), refusing one whose row count
    is not the config's ``vocab_size``."""
    t = take(sd, key, src)
    if t.shape[0] != vocab_size:
        name = key.split(".")[-2] if "." in key else key
        raise ConversionError(f"{src}: {name} has {t.shape[0]} rows but config vocab_size is {vocab_size}")
    return t


# --------------------------------------------------------------------------- HF files


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, Any]:
    """All tensors of a local HF checkpoint: (sharded) safetensors, else (sharded) pytorch_model.bin through
    :func:`workbench.run.integrity.safe_torch_load` (tensors only, whatever the environment says)."""
    from workbench.run.integrity import safe_torch_load

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
            sd = safe_torch_load(str(f), source=str(f), error=ConversionError,
                                 fix="it was not loaded: unpickling it could run code -> use the model's safetensors "
                                     "weights, or re-save it as safetensors from a copy you trust")
            if not isinstance(sd, dict):
                raise ConversionError(f"{f}: holds a {type(sd).__name__}, not a state dict -> save the model with save_pretrained")
            out.update(sd)
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
