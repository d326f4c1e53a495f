"""Checkpoint metadata (``workbench.json``) and the checks before a checkpoint is loaded, torch-free.

A workbench checkpoint is a root with ``latest_checkpointed_iteration.txt`` and
``iter_XXXXXXX`` directories, each holding megatron-core's dist checkpoint plus
``workbench.json`` (:class:`CheckpointMeta`).  An iteration counts only once its
``workbench.json`` says ``"complete": true``, so an interrupted save never shadows an
earlier one (discovery: :mod:`workbench.checkpoint.tree`).  :func:`read_checkpoint` is the one reader of that
file: the ranks' save and load, generation and the launch checks use it.  :func:`checkpoint_info` and
:func:`load_problems` (the pre-checks of generation and launch) also verify the files
(:func:`workbench.checkpoint.integrity.verify_checkpoint`), so a damaged or hostile checkpoint is
refused before any process starts.

A checkpoint's config is data.  It records the run's ``train.forward_step`` / ``train.loss_func``
(dotted paths to code), but :func:`checkpoint_config`, the one way to turn the recorded config into a
``RunConfig``, clears them: generating, converting, inspecting or verifying a checkpoint never imports
a module that a checkpoint names.  A training run imports only the hooks of its own config;
:func:`hook_note` says when those differ from the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.checkpoint.config_check import HOOK_FIELDS, recorded_config
from workbench.checkpoint.names import METADATA_FILE, CheckpointError
from workbench.checkpoint.tree import find_checkpoint
from workbench.config import ConfigError, Problem, pad_vocab_size

__all__ = ["CheckpointMeta", "CheckpointInfo", "read_checkpoint", "read_metadata", "load_problems", "checkpoint_info",
           "checkpoint_config", "recorded_hooks", "hook_note"]


@dataclass(kw_only=True)
class CheckpointMeta:
    """``workbench.json`` of one saved iteration; ``path`` is that ``iter_XXXXXXX`` directory."""

    path: Path
    format: str | None = None
    iteration: int | None = None
    complete: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    has_optimizer: bool = False
    has_scheduler: bool = False
    #: every rank's random states are stored (a training run's save; a resume under dropout repeats the straight run)
    has_rng: bool = False
    tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path) -> "CheckpointMeta":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "path"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names and k != "path"}
        if known.get("config") is None:
            known["config"] = {}
        return cls(path=Path(path), **known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object plus ``path`` (a string), as :func:`read_metadata` returns it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "path")}
        out.update(self.extra)
        out["path"] = str(self.path)
        return out


def recorded_hooks(config: dict[str, Any] | None) -> dict[str, str]:
    """{``train.forward_step`` / ``train.loss_func``: the dotted path} that a recorded config names (empty: none)."""
    train = (config or {}).get("train") if isinstance(config, dict) else None
    if not isinstance(train, dict):
        return {}
    return {f"train.{k}": str(train[k]) for k in HOOK_FIELDS if train.get(k)}


def checkpoint_config(meta: "CheckpointMeta | dict[str, Any]") -> Any:
    """The ``RunConfig`` a checkpoint records, as data: its hooks (``train.forward_step``, ``train.loss_func``
    and their ``hook_kwargs``) are cleared, so validating, building or converting from it never imports a
    module that the checkpoint's ``workbench.json`` names.  ``meta``: a :class:`CheckpointMeta` or the dict
    of :func:`read_metadata`."""
    if isinstance(meta, CheckpointMeta):
        return recorded_config(meta.config, meta.path)
    return recorded_config(meta.get("config"), meta.get("path"))


def hook_note(cfg: Any, meta: "CheckpointMeta | dict[str, Any]") -> str | None:
    """A line saying which hooks a run that loads ``meta`` imports (those of its own config ``cfg``) when they
    differ from the ones the checkpoint recorded, which are never imported; None when they agree."""
    saved = recorded_hooks(meta.config if isinstance(meta, CheckpointMeta) else meta.get("config"))
    own = {f"train.{k}": str(getattr(cfg.train, k)) for k in HOOK_FIELDS if getattr(cfg.train, k)}
    if saved == own:
        return None
    where = meta.path if isinstance(meta, CheckpointMeta) else meta.get("path")
    parts = [f"{k}: this run's {own[k]!r}" if k in own else f"{k}: none in this run's config" for k in sorted(set(saved) | set(own))]
    was = ", ".join(f"{k} {v!r}" for k, v in sorted(saved.items())) or "no hooks"
    return (f"hooks differ from checkpoint {where} ({was}, not imported): " + "; ".join(parts) +
            " -> the run imports only its own config's hooks; set train.forward_step / train.loss_func there to use others")


def read_checkpoint(path: str | Path) -> CheckpointMeta:
    """The metadata of the checkpoint at ``path`` (root or iter dir); :class:`CheckpointError` if there is none."""
    d = find_checkpoint(path)
    try:
        data = json.loads((d / METADATA_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d / METADATA_FILE} cannot be read ({type(e).__name__}: {e}) -> "
                              "copy the checkpoint again from its source, or load an earlier iteration") from None
    return CheckpointMeta.from_dict(data, d)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """:func:`read_checkpoint` as the plain dict of ``workbench.json`` plus ``path``."""
    return read_checkpoint(path).to_dict()


# --------------------------------------------------------------------------- launch checks


#: Model fields that fix the shapes of stored weights, and the config field a user sets for each;
#: the sizes derived from others (head dim, FFN width, KV groups) are compared only once those agree.
_WEIGHT_SHAPE_FIELDS = {
    "num_layers": "model.num_layers", "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads", "vocab_size": "model.vocab_size",
    "position_embedding": "model.position_embedding", "normalization": "model.normalization",
    "activation": "model.activation", "add_bias_linear": "model.add_bias_linear", "tie_embeddings": "model.tie_embeddings",
}
_DERIVED_SHAPE_FIELDS = {"query_groups": "model.num_query_groups", "head_dim": "model.kv_channels", "ffn_size": "model.ffn_hidden_size"}


def load_problems(cfg: Any, *, hashes: bool = True) -> list:
    """Why ``cfg.checkpoint.load_dir`` would not load into ``cfg``, from the checkpoint's
    ``workbench.json`` alone (no process, no megatron-core), so a launch is refused with the
    field and the fix before any rank starts: a missing or incomplete checkpoint, another
    architecture, and for a resume (not ``finetune``) a ``train.train_iters`` the checkpoint has already reached
    (0 steps to train) and missing or differently sharded optimizer state.  ``hashes=False``: every check but the
    files' checksums (the backend's ranks, whose load verifies those as it reads).
    """
    c = cfg.checkpoint
    if not c.load_dir:
        return []
    try:
        meta = read_checkpoint(c.load_dir)
        from workbench.checkpoint.integrity import verify_checkpoint

        verify_checkpoint(meta.path, hashes=hashes)  # damaged or hostile files: refused here, before any rank starts
        saved = checkpoint_config(meta)
    except CheckpointError as e:
        rule, _, fix = str(e).partition(" -> ")
        return [Problem("checkpoint.load_dir", rule, fix or "point load_dir at a checkpoint root or an iter_XXXXXXX directory")]
    except ConfigError:
        return []  # a config this version cannot read (an older run's): the load itself will tell
    except (OSError, ValueError) as e:  # unreadable metadata
        return [Problem("checkpoint.load_dir", f"cannot read the checkpoint's metadata: {e}", "point load_dir at a workbench checkpoint")]
    where = str(meta.path)
    out = []
    shape_fields = dict(_WEIGHT_SHAPE_FIELDS)
    if cfg.model.position_embedding == saved.model.position_embedding == "learned":
        shape_fields["max_position_embeddings"] = "model.max_position_embeddings"
    for fields in (shape_fields, _DERIVED_SHAPE_FIELDS):
        for attr, field in fields.items():
            have, want = getattr(cfg.model, attr), getattr(saved.model, attr)
            if have != want:
                out.append(Problem(field, f"is {have!r} here but {want!r} in checkpoint {where}",
                                   f"set {field}: {want!r} to load it, or drop checkpoint.load_dir to train from scratch"))
        if out:
            break
    if not c.finetune and not out and meta.iteration is not None and cfg.train.train_iters <= int(meta.iteration):
        out.append(Problem("train.train_iters",
                           f"is {cfg.train.train_iters}, but checkpoint {where} is already at iteration {meta.iteration}: "
                           "the resumed run would train 0 steps and report 'finished'",
                           f"set train.train_iters above {meta.iteration} to train further, or checkpoint.finetune: true "
                           "to start a new run (iteration 0) from these weights"))
    if not c.finetune and not out:
        padded = [pad_vocab_size(x.model.vocab_size, x.model.make_vocab_size_divisible_by, x.parallel.tensor_parallel) for x in (cfg, saved)]
        if not meta.has_optimizer:
            out.append(Problem("checkpoint.finetune", f"checkpoint {where} holds no optimizer state, so it cannot be resumed",
                               "set checkpoint.finetune: true to start from its weights with a fresh optimizer"))
        elif saved.parallel.distributed_optimizer != cfg.parallel.distributed_optimizer:
            want = saved.parallel.distributed_optimizer
            out.append(Problem("parallel.distributed_optimizer",
                               f"checkpoint {where} was saved with distributed_optimizer: {str(want).lower()}",
                               f"set parallel.distributed_optimizer: {str(want).lower()} to resume it, "
                               "or checkpoint.finetune: true to load its weights with a fresh optimizer"))
        elif padded[0] != padded[1]:  # the embedding rows are re-padded on load; Adam's state for them cannot be
            out.append(Problem("parallel.tensor_parallel",
                               f"pads the vocabulary to {padded[0]} rows, but checkpoint {where} (tensor_parallel "
                               f"{saved.parallel.tensor_parallel}) stored {padded[1]}; its optimizer state cannot be re-padded",
                               f"resume at tensor_parallel {saved.parallel.tensor_parallel}, set model.make_vocab_size_divisible_by so "
                               "both pad alike, or checkpoint.finetune: true for a fresh optimizer"))
    return out


# --------------------------------------------------------------------------- what generation needs


@dataclass
class CheckpointInfo:
    """What generation needs to know about a checkpoint without loading it."""

    path: Path  # the iter_XXXXXXX directory
    config: Any  # workbench.config.RunConfig
    meta: dict[str, Any]


def checkpoint_info(ckpt: str | Path, *, hashes: bool = True) -> CheckpointInfo:
    """Resolve ``ckpt`` (root or iter dir) and read its ``workbench.json``; ConfigError naming ``ckpt`` if there is none.
    ``hashes=False``: every check of :func:`~workbench.checkpoint.integrity.verify_checkpoint` but the checksums, for a
    reader that checks them as it reads (:class:`~workbench.checkpoint.checksum_reads.ChecksummedReads`)."""
    try:
        meta = read_checkpoint(ckpt)
        from workbench.checkpoint.integrity import verify_checkpoint

        verify_checkpoint(meta.path, hashes=hashes)  # damaged or hostile files: refused here, before any process starts
    except CheckpointError as e:
        rule, _, fix = str(e).partition(" -> ")
        raise ConfigError([Problem("ckpt", rule, fix or "point ckpt at a checkpoint root or an iter_XXXXXXX directory")]) from None
    return CheckpointInfo(path=meta.path, config=checkpoint_config(meta), meta=meta.to_dict())
