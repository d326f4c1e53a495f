"""Checkpoint discovery and metadata (``workbench.json``), torch-free.

A workbench checkpoint is a root with ``latest_checkpointed_iteration.txt`` and
``iter_XXXXXXX`` directories, each holding megatron-core's dist checkpoint plus
``workbench.json`` (:class:`CheckpointMeta`).  An iteration counts only once its
``workbench.json`` says ``"complete": true``, so an interrupted save never shadows an
earlier one.  :func:`read_checkpoint` is the one reader of that file: the backend's
checkpointing, generation and the launch checks use it.  :func:`checkpoint_info` and
:func:`load_problems` (the pre-checks of generation and launch) also verify the files
(:func:`workbench.run.integrity.verify_checkpoint`), so a damaged or hostile checkpoint is
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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "TRACKER_FILE", "METADATA_FILE", "CheckpointError", "CheckpointMeta", "CheckpointInfo", "iter_dir_name",
           "list_checkpoints", "find_checkpoint", "read_checkpoint", "read_metadata", "load_problems", "checkpoint_info",
           "special_ids", "remove_stale_partials", "partial_dir_name", "HOOK_FIELDS", "checkpoint_config",
           "recorded_hooks", "hook_note"]

from workbench.run.ckpt_files import (  # noqa: F401  (the tree's names, shared with workbench.run.integrity)
    HOOK_FIELDS, ITER_RE, FORMAT, METADATA_FILE, TRACKER_FILE, CheckpointError, is_complete, iter_dir_name, list_checkpoints,
    recorded_config,
)


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


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a checkpoint ROOT or an ``iter_XXXXXXX`` dir to a complete iteration directory.

    From a root: the iteration named by ``latest_checkpointed_iteration.txt`` if complete,
    else the newest complete ``iter_*`` (an interrupted save never wins).  A newer iteration whose
    ``workbench.json`` is missing or unreadable, or whose folder the tracker names but is gone, raises
    :class:`CheckpointError` naming it: never a silent fall-back to the one before.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint path {p} does not exist -> check the path (a checkpoint root or an iter_XXXXXXX directory)")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {p} is a file, not a directory -> pass the checkpoint root or an iter_XXXXXXX directory")
    if (p / METADATA_FILE).exists() or ITER_RE.match(p.name) or ".tmp-" in p.name:
        if is_complete(p):
            return p
        raise CheckpointError(
            f"{p} is not a complete workbench checkpoint ({METADATA_FILE} missing or not marked complete: "
            "the save was interrupted or this is not a workbench checkpoint) -> use an earlier iteration, "
            "or import foreign checkpoints with `workbench convert`")
    tracked = _tracked_iteration(p)
    if tracked is not None and is_complete(d := p / iter_dir_name(tracked)):
        _refuse_newer_damaged(p, d)
        return d
    complete = list_checkpoints(p)
    if complete:
        _refuse_newer_damaged(p, complete[-1])
        return complete[-1]
    _refuse_newer_damaged(p, None)  # the tracker names an iteration whose folder is gone, and none is older
    inner = _run_dir_checkpoints(p)
    if inner is not None:
        return find_checkpoint(inner)
    partial = sorted(x.name for x in p.iterdir() if x.name.startswith("iter_"))
    legacy = any(x.name.startswith("mp_rank_") for x in p.iterdir()) or any(
        x.is_dir() and any(y.name.startswith("mp_rank_") for y in x.iterdir()) for x in p.iterdir() if x.is_dir())
    run_dir = (p / "config.json").is_file() and ((p / "events").is_dir() or (p / "launch.json").is_file())
    hint = ("this looks like a legacy Megatron-LM checkpoint -> import it with `workbench convert legacy`" if legacy
            else f"this run directory has no checkpoints/ (the run saved none: it saves at the end and every "
                 f"checkpoint.save_interval steps unless checkpoint.save_on_exit is false) -> pass a run that saved one"
            if run_dir else "train with a save_dir, or convert a model with `workbench convert hf-to-megatron`")
    raise CheckpointError(
        f"no complete checkpoint under {p}" + (f" (incomplete: {', '.join(partial)})" if partial else "") + f" -> {hint}")


def _tracked_iteration(root: Path) -> int | None:
    """The iteration ``root``'s tracker (``latest_checkpointed_iteration.txt``, megatron's name) says is the latest;
    None without one, or for one that names no iteration (megatron's ``release``)."""
    try:
        text = (root / TRACKER_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if re.fullmatch(r"[0-9]+", text) else None  # (str.isdigit takes '²')


def _unreadable_metadata(d: Path) -> str | None:
    """What is wrong with ``d``'s ``workbench.json`` ("is missing (...)", "is damaged (...)"), None when it reads as a
    JSON object.  A save writes that file before it renames ``iter_N.tmp-*`` to ``iter_N``, and the tracker after,
    so an ``iter_N`` without one, or with one that does not read, or the tracker's ``iter_N`` that is not there at
    all, was damaged, altered or deleted afterwards, never interrupted."""
    f = d / METADATA_FILE
    if not d.exists():
        return (f"is missing ({d.name} is gone, yet {d.parent / TRACKER_FILE} names it the latest: it was deleted or "
                "moved after its save)")
    if not f.is_file():
        return ("is missing (a save renames an iteration into place only after writing it, so this one lost it "
                "afterwards)")
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is damaged ({type(e).__name__}: {e})"
    if not isinstance(data, dict):
        return f"is damaged (a JSON {type(data).__name__}, not an object)"
    return None  # read (one marked incomplete says so itself: skipped, as its writer asked)


def _refuse_newer_damaged(root: Path, chosen: Path | None) -> None:
    """An ``iter_N`` newer than ``chosen`` (None: no complete one) whose ``workbench.json`` is missing or unreadable,
    or that the tracker names but is gone, is a damaged save (a save renames its directory into place only after
    writing that file, and writes the tracker last), never an interrupted one: loading the older iteration instead
    would lose training silently, so it is refused, naming both."""
    m = ITER_RE.match(chosen.name) if chosen is not None else None
    floor = int(m.group(1)) if m else -1
    newer = {} if chosen is None else {int(x.group(1)): d for d in root.iterdir()
                                       if (x := ITER_RE.match(d.name)) and d.is_dir() and int(x.group(1)) > floor}
    tracked = _tracked_iteration(root)
    if tracked is not None and tracked > floor and not (root / iter_dir_name(tracked)).exists():
        newer[tracked] = root / iter_dir_name(tracked)
    for n in sorted(newer, reverse=True):
        d = newer[n]
        why = _unreadable_metadata(d)
        if why:
            raise CheckpointError(
                f"{'a newer' if chosen else 'the latest'} checkpoint {d} cannot be read: {d / METADATA_FILE} {why} -> "
                "copy the checkpoint again from its source"
                + (f", or load the older iteration explicitly: point at {chosen}" if chosen else ""))


def _run_dir_checkpoints(p: Path) -> Path | None:
    """The checkpoint root of run directory ``p``: its config's ``checkpoint.save_dir``, else
    ``p/checkpoints`` (where the backend saves by default); None when neither holds an iteration."""
    roots = []
    try:
        saved = json.loads((p / "config.json").read_text())
        save_dir = ((saved.get("checkpoint") or {}).get("save_dir")) if isinstance(saved, dict) else None
        if save_dir:
            roots.append(Path(save_dir).expanduser())
    except (OSError, ValueError, AttributeError):
        pass
    roots.append(p / "checkpoints")
    for root in roots:
        if root.is_dir() and root != p and ((root / TRACKER_FILE).is_file() or any(ITER_RE.match(x.name) for x in root.iterdir())):
            return root
    return None


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
    from workbench.config import ConfigError, Problem, pad_vocab_size

    c = cfg.checkpoint
    if not c.load_dir:
        return []
    try:
        meta = read_checkpoint(c.load_dir)
        from workbench.run.integrity import verify_checkpoint

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
    ``hashes=False``: every check of :func:`~workbench.run.integrity.verify_checkpoint` but the checksums, for a
    reader that checks them as it reads (:class:`~workbench.run.integrity.ChecksummedReads`)."""
    from workbench.config import ConfigError, Problem

    try:
        meta = read_checkpoint(ckpt)
        from workbench.run.integrity import verify_checkpoint

        verify_checkpoint(meta.path, hashes=hashes)  # damaged or hostile files: refused here, before any process starts
    except CheckpointError as e:
        rule, _, fix = str(e).partition(" -> ")
        raise ConfigError([Problem("ckpt", rule, fix or "point ckpt at a checkpoint root or an iter_XXXXXXX directory")]) from None
    return CheckpointInfo(path=meta.path, config=checkpoint_config(meta), meta=meta.to_dict())


def tokenizer_size(tok: Any) -> int | None:
    """How many ids a workbench or HF tokenizer can decode (None when unknown)."""
    if tok is None:
        return None
    try:
        return int(tok.vocab_size) if hasattr(tok, "has_eod") else len(tok)
    except (TypeError, AttributeError):
        return getattr(tok, "vocab_size", None)


def decode_visible(tok: Any, ids: list[int]) -> str:
    """Text of ``ids``; an id the tokenizer has no token for shows as ``<id:N>``, never as nothing
    (a model whose vocabulary is larger than its tokenizer's would otherwise print empty text)."""
    n = tokenizer_size(tok)
    if n is None or all(i < n for i in ids):
        return tok.decode(ids)
    out: list[str] = []
    run: list[int] = []
    for i in ids:
        if i < n:
            run.append(i)
            continue
        if run:
            out.append(tok.decode(run))
            run = []
        out.append(f"<id:{i}>")
    if run:
        out.append(tok.decode(run))
    return "".join(out)


def special_ids(tok: Any) -> dict[str, int | None]:
    """EOS / BOS / PAD ids of a workbench or HF tokenizer (None when absent)."""
    if tok is None:
        return {"eos": None, "bos": None, "pad": None}
    if hasattr(tok, "has_eod"):  # workbench.data.tokenizer.Tokenizer
        eos = tok.eod if tok.has_eod else None
        return {"eos": eos, "bos": tok.bos, "pad": tok.pad}
    return {"eos": getattr(tok, "eos_token_id", None), "bos": getattr(tok, "bos_token_id", None),
            "pad": getattr(tok, "pad_token_id", None)}


_PARTIAL_RE = re.compile(r"^(iter_\d{7})\.(tmp|old)-(?:(.+)-)?(\d+)$")


def _this_host() -> str:
    from workbench.run.nodes import host_name

    return re.sub(r"[^A-Za-z0-9._-]", "_", host_name())


def partial_dir_name(final_name: str, kind: str) -> str:
    """``iter_N.tmp-<host>-<pid>`` (a save under way) or ``iter_N.old-<host>-<pid>`` (the copy a re-save
    moves aside): the host, because a checkpoint root on a shared filesystem is written from several
    machines and a PID means something only on its own."""
    import os

    return f"{final_name}.{kind}-{_this_host()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _may_be_saving(pid: int, folder: Path) -> bool:
    """Whether live process ``pid`` may be the save that made ``folder``: a process that started after the folder was
    last written (its PID given anew, say after a restart) cannot have made it."""
    try:
        import psutil

        return psutil.Process(pid).create_time() <= folder.stat().st_mtime + 1.0
    except ImportError:
        return True
    except (psutil.NoSuchProcess, OSError):
        return False
    except psutil.AccessDenied:
        return True


def remove_stale_partials(root: str | Path) -> list[str]:
    """Tidy what a save killed half-way left in a checkpoint ROOT; returns what was done, a line each.

    Only this host's leftovers (named by :func:`partial_dir_name`) whose process is gone (or whose PID now belongs
    to a process started after the leftover was written) are touched; another host's (a shared filesystem), and
    one whose live process may still be saving, are only reported.
    ``iter_N.tmp-...`` (a save that never completed) is removed.  ``iter_N.old-...`` (the previous copy
    of an iteration being re-saved) is removed when ``iter_N`` is complete again, and moved back into
    place when the kill came between the two renames and ``iter_N`` is missing.  Called by rank 0
    before each save.
    """
    import os
    import shutil

    root = Path(root)
    done: list[str] = []
    if not root.is_dir():
        return done
    here = _this_host()
    for p in sorted(root.iterdir()):
        m = _PARTIAL_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        host, pid = m.group(3), int(m.group(4))
        if host is not None and host != here:
            done.append(f"left {p.name}: an unfinished save from host {host} (remove it once that job is gone)")
            continue
        if _pid_alive(pid) and _may_be_saving(pid, p):  # a save in progress here, perhaps: said, left alone
            done.append(f"left {p.name}: process {pid} is alive and may still be saving it (remove it once that process "
                        "is gone)")
            continue
        final = root / m.group(1)
        gone = "which is gone" if not _pid_alive(pid) else "which is gone: that PID is now a process started later"
        if m.group(2) == "tmp":
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name} (an unfinished save of process {pid}, {gone})")
        elif final.exists() and is_complete(final):
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name} ({final.name} is complete)")
        elif not final.exists():
            os.replace(p, final)
            done.append(f"restored {final.name} from {p.name} (its re-save was killed between the renames)")
    return done
