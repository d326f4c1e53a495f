"""Hugging Face <-> megatron-core: configs and per-tensor conversion rules, for every model family.

The model-specific parts (HF config fields, tensor names) are each family's ``hf`` adapter
(:meth:`workbench.models.parts.FamilyParts.hf`, built from :mod:`workbench.models.common.conversion_rules`);
this module reads and writes HF directories and dispatches to the adapter of an HF ``model_type``.

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
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from workbench.config import ModelConfig, RunConfig
from workbench.families import FAMILIES, Family, family_for_hf, family_of
from workbench.families.family import HfPart
from workbench.models.common.conversion_rules import (ConversionError, TensorInfo, infos_of, run_rules,
                                                      strip_module_prefix)
from workbench.models.parts import parts_of

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "read_hf_config",
    "run_config_from_hf",
    "hf_config_dict_from_run",
    "infer_model_type",
    "hf_to_mcore",
    "mcore_to_hf",
    "hf_to_mcore_rules",
    "mcore_to_hf_rules",
    "load_hf_state_dict",
    "save_hf_state_dict",
    "parse_size",
    "hf_adapter",
    "TOKENIZER_FILES",
]

#: HF model_type -> the HF class, over every family's adapter
SUPPORTED_MODEL_TYPES = {mt: cls for f in FAMILIES.values() for mt, cls in f.supports.hf_classes}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json")


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
    _hf_of(fam).model_fields(hf, m)
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



def _hf_of(fam: Family) -> HfPart:
    hf = parts_of(fam).hf()
    if hf is None:
        raise ConversionError(f"model.arch {fam.name!r} has no Hugging Face adapter")
    return hf


def hf_adapter(model_type: str) -> HfPart:
    """The HF adapter of the family that converts ``model_type`` (:class:`workbench.families.family.HfPart`)."""
    fam = family_for_hf(model_type)
    if fam is None:
        raise ConversionError(f"model_type {model_type!r} is not supported -> one of {sorted(SUPPORTED_MODEL_TYPES)}")
    return _hf_of(fam)


def infer_model_type(m: ModelConfig) -> str:
    """Which HF architecture a workbench model maps onto (its family's adapter decides), or a clear refusal."""
    if not family_of(m.arch).supports.hf_model_types:
        raise ConversionError(f"model.arch {m.arch!r} has no Hugging Face adapter")
    return _hf_of(family_of(m.arch)).infer_model_type(m)


def hf_config_dict_from_run(cfg: RunConfig, model_type: str, hf_extra: dict | None = None, dtype: str = "float32") -> dict[str, Any]:
    """config.json content for the exported HF model (token ids etc. kept from the imported config when known)."""
    return hf_adapter(model_type).hf_config_dict_from_run(cfg, model_type, hf_extra, dtype)


def hf_to_mcore(hf_sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Map an HF state dict to the full TP=1 megatron-core state dict (vocab padded per ``derive(cfg)``):
    :func:`hf_to_mcore_rules` run on the dict."""
    sd = {strip_module_prefix(k): v for k, v in hf_sd.items()}
    return run_rules(hf_to_mcore_rules(infos_of(sd), cfg, model_type), sd, dtype, progress)


def hf_to_mcore_rules(infos: Mapping[str, Any], cfg: RunConfig, model_type: str) -> list[Any]:
    """The per-tensor rules (:class:`workbench.models.common.conversion_rules.Rule`) mapping an HF checkpoint's
    tensors (``infos``: name -> :class:`~workbench.models.common.conversion_rules.TensorInfo`) to the full TP=1
    megatron-core state dict; a missing tensor or a wrong vocabulary is a ConversionError before any data is read."""
    return hf_adapter(model_type).hf_to_mcore_rules(infos, cfg, model_type)


def mcore_to_hf_rules(infos: Mapping[str, Any], cfg: RunConfig, model_type: str,
                      read: Callable[[str], Any] | None = None) -> list[Any]:
    """The per-tensor rules mapping the full TP=1 megatron-core state dict (``infos``) to HF names (vocab padding
    stripped); ``read`` (a tensor by name) for the decisions that look at values (T5: an untied head equal to the
    embeddings is left out, as ``save_pretrained`` does)."""
    return hf_adapter(model_type).mcore_to_hf_rules(infos, cfg, model_type, read=read)


def mcore_to_hf(sd: dict[str, Any], cfg: RunConfig, model_type: str, dtype: Any = None,
                progress: Callable[[Iterable], Iterable] | None = None) -> dict[str, Any]:
    """Map a full TP=1 megatron-core state dict to HF names (vocab padding stripped; what HF's ``save_pretrained``
    leaves out, left out): :func:`mcore_to_hf_rules` run on the dict."""
    return run_rules(mcore_to_hf_rules(infos_of(sd), cfg, model_type, read=sd.__getitem__), sd, dtype, progress)


# --------------------------------------------------------------------------- HF files


def load_hf_state_dict(hf_dir: str | Path) -> dict[str, Any]:
    """All tensors of a local HF checkpoint in memory: (sharded) safetensors, else (sharded) pytorch_model.bin through
    :func:`workbench.checkpoint.safe_torch_load` (tensors only, whatever the environment says).  The conversions
    read one tensor at a time instead (:class:`workbench.conversion.hf_files.HFReader`)."""
    from workbench.conversion.hf_files import load_bin, weight_files

    out: dict[str, Any] = {}
    for f in weight_files(hf_dir):
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            out.update(load_file(str(f)))
        else:
            out.update(load_bin(f))
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
    """Write safetensors shards (+ index when more than one) like ``save_pretrained`` does
    (:class:`workbench.conversion.hf_files.SafetensorsWriter`, tensor by tensor)."""
    from workbench.conversion.hf_files import SafetensorsWriter

    writer = SafetensorsWriter(out_dir, {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in sd.items()}, max_shard_size)
    for k, t in sd.items():
        writer.write(k, t)
    return writer.close()
