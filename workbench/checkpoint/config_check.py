"""A checkpoint's recorded config, as data, and whether it describes the tensors it stores.  Torch-free.

:func:`recorded_config` turns the config ``workbench.json`` records into a ``RunConfig`` with its hooks cleared
(:data:`HOOK_FIELDS`: reading a checkpoint never imports a module it names).

``workbench.json`` records the run's config; ``.metadata`` indexes the stored tensors with their global shapes.
When the two disagree (a ``workbench.json`` edited, or copied from another checkpoint) every model built from the
config fails to load the tensors, in each rank, as a traceback.  :func:`config_mismatch` compares them from the
files alone: the layer count of each stacked ``encoder.layers.*`` / ``decoder.layers.*`` tensor, the word
embedding's (padded vocabulary, hidden size), and the parameter count the config implies
(:func:`workbench.config.derive`, the planner's) against the stored one.
:func:`~workbench.checkpoint.integrity.verify_checkpoint` refuses a mismatch, so every command that reads a checkpoint
(inspect, convert, verify, generate, a launch that loads one) says the same thing, before any process starts.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from workbench.checkpoint.names import METADATA_FILE
from workbench.config import ConfigError, RunConfig

__all__ = ["HOOK_FIELDS", "recorded_config", "stored_shapes", "config_mismatch"]

#: the config fields that name code (``train.<field>``: 'package.module:function'); a checkpoint records them as text
HOOK_FIELDS = ("forward_step", "loss_func")


def recorded_config(config: Any, where: Any = None) -> Any:
    """The ``RunConfig`` of a checkpoint's recorded config dict, as data: its hooks (``train.forward_step``,
    ``train.loss_func`` and their ``hook_kwargs``) cleared, so validating, building or converting from it never
    imports a module the checkpoint names."""
    data = dict(config or {})
    if isinstance(data.get("train"), dict):
        # the hooks (never imported by a reader) and the TensorBoard log (a package this machine may lack) cleared:
        # neither changes what the checkpoint holds
        data["train"] = {**data["train"], **{k: None for k in HOOK_FIELDS}, "hook_kwargs": {}, "tensorboard": False}
    return RunConfig.from_dict(data, source=None if where is None else str(where))


_STACKED = re.compile(r"^(encoder|decoder)\.layers\.[A-Za-z_]")
_WORD = "embedding.word_embeddings.weight"


def stored_shapes(md: Any) -> dict[str, tuple[int, ...]]:
    """{key: global shape} of the model tensors a ``.metadata`` (parsed with or without torch) indexes; the optimizer's
    state is left out."""
    out = {}
    for key, v in (getattr(md, "state_dict_metadata", None) or {}).items():
        size = getattr(v, "size", None)  # a torch.Size, or its stand-in holding the tuple it was made from
        if size is None or str(key).startswith("optimizer."):
            continue
        dims = size._args[0] if hasattr(size, "_args") else tuple(size)
        try:
            out[str(key)] = tuple(int(x) for x in dims)
        except (TypeError, ValueError):
            continue
    return out


def _config(d: Path) -> Any:
    """The checkpoint's config as a ``RunConfig`` (hooks cleared), None when this version cannot read it."""
    try:
        data = json.loads((d / METADATA_FILE).read_text())
        cfg = recorded_config(data.get("config"), d)
        if cfg.validate():
            return None  # an invalid config: what it implies is not defined (the loaders name its problems)
        return cfg
    except (OSError, ValueError, TypeError, KeyError, AttributeError, ConfigError):
        return None


def _layers(cfg: Any) -> dict[str, tuple[int, str]]:
    """{stack: (layers the config gives it, the field that says so)}: a family with a decoder size of its own
    (``model.decoder_num_layers``) sizes ``decoder.layers.*`` by it; ``model.num_layers`` otherwise."""
    m = cfg.model
    own = getattr(m, "decoder_num_layers", None)
    return {"encoder": (m.num_layers, "model.num_layers"),
            "decoder": (own, "model.decoder_num_layers") if own else (m.num_layers, "model.num_layers")}


def config_mismatch(d: str | Path, md: Any) -> str | None:
    """Why checkpoint directory ``d``'s config does not describe the tensors its ``.metadata`` (``md``) indexes, or
    None when it does (or when the config is one this version cannot read)."""
    d = Path(d)
    cfg = _config(d)
    shapes = stored_shapes(md)
    if cfg is None or not shapes:
        return None
    try:
        derived = cfg.derived()
    except (ValueError, ZeroDivisionError, TypeError, KeyError):
        return None
    found = []
    layers = _layers(cfg)
    for key, shape in sorted(shapes.items()):
        m = _STACKED.match(key)
        if m and shape and shape[0] != layers[m.group(1)][0]:
            count, field = layers[m.group(1)]
            found.append(f"{m.group(1)}.layers.* hold {shape[0]} layers, the config's {field} is {count}")
            break
    want = (derived.padded_vocab_size, cfg.model.hidden_size)
    if _WORD in shapes and shapes[_WORD] != want:
        found.append(f"{_WORD} is stored as {shapes[_WORD]}, the config implies {want} (model.vocab_size "
                     f"{cfg.model.vocab_size} padded, model.hidden_size {cfg.model.hidden_size})")
    total = sum(math.prod(s) for s in shapes.values())
    if not found and total != derived.params.total:
        found.append(f"the stored tensors hold {total:,} parameters, the config's model {derived.params.total:,}")
    if not found:
        return None
    return (f"checkpoint {d}: the config in its {METADATA_FILE} does not describe its stored tensors ({'; '.join(found)}) -> "
            f"copy the checkpoint again from its source (its {METADATA_FILE} was altered, or belongs to another checkpoint)")
