"""Conversion entry points (Python API behind ``workbench convert`` and the conversion notebook).

Every writer validates the target first (a layout that cannot hold the model, a missing tensor, a wrong
vocabulary are refused before anything is written), writes into ``OUT.tmp-<pid>`` and renames it to ``OUT``
only when complete, so an interrupted conversion never leaves an output that looks finished.

The conversions stream: a family adapter's per-tensor rules (:mod:`workbench.models.common.conversion_rules`) run
one at a time, reading each source tensor when a rule needs it (HF: :class:`~workbench.conversion.hf_files.HFReader`;
megatron: :class:`~workbench.conversion.megatron_files.CheckpointReader`) and writing each target as it is made
(:class:`~workbench.conversion.hf_files.SafetensorsWriter` shards; a megatron-core checkpoint through
:class:`~workbench.conversion.megatron_files.CheckpointWriter`), so peak memory is a few copies of the largest tensor,
not the model.
Output of the Megatron-side writers is a checkpoint ROOT (``iter_XXXXXXX/`` + tracker, see
:mod:`workbench.checkpoint`) plus ``workbench_config.json`` - the RunConfig it
implies, with ``checkpoint.load_dir`` pointing at it and ``finetune: true`` - and, when the
source had one, a ``tokenizer/`` copy.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from workbench.checkpoint import (CheckpointError, checkpoint_info, checkpoint_tensor_shapes, read_metadata,
                                  recorded_hooks, vocab_keys)
from workbench.config import ConfigError, RunConfig, derive
from workbench.conversion.hf import (
    SUPPORTED_MODEL_TYPES,
    TOKENIZER_FILES,
    hf_adapter,
    hf_config_dict_from_run,
    hf_to_mcore_rules,
    infer_model_type,
    load_hf_state_dict,
    mcore_to_hf_rules,
    parse_size,
    read_hf_config,
    run_config_from_hf,
)
from workbench.data.errors import DataError
from workbench.data.tokenizer import load_tokenizer, tokenizer_spec
from workbench.families import family_for_hf
from workbench.models.common.conversion_rules import (ConversionError, Rule, TensorInfo, infos_of, pad_vocab_rows,
                                                      plan_targets, stream_rules)
from workbench.models.common.one_process import single_process_group

__all__ = [
    "ConversionResult",
    "CONFIG_FILE",
    "hf_to_megatron",
    "megatron_to_hf",
    "reshape",
    "import_legacy",
    "checkpoint_structure",
    "format_structure",
    "make_random_hf_model",
    "compare_hf_dirs",
]

CONFIG_FILE = "workbench_config.json"
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class ConversionResult:
    """What a conversion wrote."""

    output: Path
    checkpoint: Path | None = None  # iteration dir (megatron side)
    config: RunConfig | None = None
    config_path: Path | None = None
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def _progress(total: int, desc: str, enabled: bool):
    from workbench.noise import progress_bar  # a text bar in a notebook kernel, no widget

    def wrap(it):
        return progress_bar(it, total=total, desc=desc, disable=not enabled, leave=False)

    return wrap


def _torch_dtype(name: str | None):
    import torch

    return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


#: the file every conversion leaves in its output: ``--force`` replaces only a directory that holds it (one this tool
#: wrote), never anything else
OUTPUT_MARKER = ".workbench-convert.json"


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` lies strictly inside ``b`` (both resolved)."""
    return b in a.parents


def _out_problem(given: Path, out: Path, force: bool, inputs: dict[str, list[Path]]) -> str | None:
    """Why ``out`` (``given`` as the user wrote it, resolved) may not be written, or None.  ``inputs``: what the
    conversion reads, {"--flag": [paths]} (the first path of each is as given, the others what it resolves to)."""
    for flag, paths in inputs.items():
        shown = paths[0]
        for i, p in enumerate(paths):
            if not p.exists():
                continue
            real = p.resolve()
            if out == real or _inside(real, out):
                what = "is" if out == real else "holds"
                return (f"--out {given} {what} the input {flag} {shown}{f' ({real})' if real != shown else ''}: a conversion "
                        f"never writes over what it reads -> choose an --out outside {shown}")
            # inside an input: refused, but for a run directory given as --ckpt (an export may go there; its
            # checkpoint root, the next path, may not hold one)
            if (i > 0 or len(paths) == 1) and _inside(out, real):
                return (f"--out {given} lies inside the input {flag} {real}: a conversion never writes into what it "
                        f"reads -> choose an --out outside {real}")
    if given.is_symlink() and force and out.is_dir() and any(out.iterdir()):
        return (f"--out {given} is a symbolic link to {out}: --force never replaces a link's target -> pass a new "
                f"directory, or {out} itself once you have checked what it holds")
    if out.exists() and not out.is_dir():
        return f"--out {given} is a file, not a directory -> choose a new directory"
    if out.exists() and any(out.iterdir()):
        if not force:
            return f"--out {out} already exists and is not empty -> choose a new directory (or pass --force to replace it)"
        if not (out / OUTPUT_MARKER).is_file():
            return (f"--out {out} holds files that no conversion wrote (it has no {OUTPUT_MARKER}): --force replaces only an "
                    f"earlier conversion's output -> choose a new directory, or remove {out} yourself if nothing there is needed")
    return None


@contextmanager
def _staged_output(out: str | Path, force: bool = False, need: int = 0, *, inputs: dict[str, list[Any]] | None = None,
                   command: str = "convert") -> Iterator[Path]:
    """Yield a temporary sibling of ``out``; rename it to ``out`` only if the block succeeds.  ``need``: the bytes the
    block writes; refused before anything is written where ``out``'s file system has less free (an output it
    replaces goes only after the new one is complete).  ``force`` replaces only an earlier conversion's output
    (:data:`OUTPUT_MARKER`, which the output gets); an ``out`` that is, holds or lies inside one of ``inputs``
    ({flag: [paths]}), a link whose target it would replace, or a file is a ConversionError naming it."""
    given = Path(out).expanduser().absolute()
    out = given.resolve()
    why = _out_problem(given, out, force, {k: [Path(str(p)).expanduser().absolute() for p in v if p is not None]
                                           for k, v in (inputs or {}).items() if any(p is not None for p in v)})
    if why:
        raise ConversionError(why)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if need and free < need + (64 << 20):
        raise ConversionError(f"--out {out}: {free / 1e9:.2f} GB free on its file system, the output takes "
                              f"{need / 1e9:.2f} GB -> free space there or choose an --out on a larger disk")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        (tmp / OUTPUT_MARKER).write_text(json.dumps({"written_by": f"workbench convert {command}", "pid": os.getpid()}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _nbytes(targets: dict[str, TensorInfo]) -> int:
    """The bytes of the tensors ``targets`` describes (what a conversion writes, less its small files)."""
    return sum(t.nbytes for t in targets.values())


def _check(cfg: RunConfig, what: str) -> None:
    """Refuse a target layout/config before anything is written (model and parallel rules only matter here)."""
    problems = [p for p in cfg.validate() if p.field.startswith(("model.", "parallel."))]
    if problems:
        raise ConfigError(problems, what)


def _finish_config(cfg: RunConfig, out_final: Path, tokenizer_dir: str | None) -> RunConfig:
    over: dict[str, Any] = {"checkpoint.load_dir": str(out_final), "checkpoint.finetune": True}
    if tokenizer_dir:
        over["data.tokenizer"] = tokenizer_dir
    return cfg.replace(**over)


def _has_tokenizer_files(d: Path | None) -> bool:
    return d is not None and d.is_dir() and any((d / n).is_file() for n in TOKENIZER_FILES)


def _ship_tokenizer(spec: str | Path, dst: Path, source: str) -> None:
    """Put the tokenizer ``spec`` names into ``dst``: a directory's tokenizer files are copied, anything else (a
    named tokenizer such as ``demo``, a tokenizer.json, a SentencePiece ``.model``, a directory of other files) is
    saved by the workbench's loader as files ``AutoTokenizer`` loads.  A spec that does not load is a
    :class:`ConversionError` naming it and ``source`` (where it came from)."""
    src = Path(str(spec)).expanduser()
    dst.mkdir(parents=True, exist_ok=True)
    if _has_tokenizer_files(src):
        for n in TOKENIZER_FILES:
            if (src / n).is_file():
                shutil.copy2(src / n, dst / n)
        return
    try:
        load_tokenizer(str(spec)).save(dst)
    except DataError as e:
        relative = not src.is_absolute() and not str(spec).startswith("demo")
        where = f" (a relative path: relative to where the run was launched, and this is {Path.cwd()})" if relative else ""
        raise ConversionError(
            f"{source} names the tokenizer {str(spec)!r}, which cannot be loaded{where}: {e.problem} -> pass the model's "
            "tokenizer with --tokenizer DIR" + (", or run from the directory the run was launched from" if relative else "")) from None


def _write_megatron(tmp: Path, final: Path, cfg: RunConfig, targets: dict[str, TensorInfo], fill: Any, iteration: int,
                    dtype: str | None, source: dict, tokenizer: str | Path | None, tokenizer_from: str) -> ConversionResult:
    """Write the checkpoint, its config and ``tokenizer/`` (the tokenizer ``tokenizer`` names, which
    ``tokenizer_from`` describes: where it came from, or where none was found).  ``targets``: the TP=1 state-dict
    tensors ``fill(write)`` will hand to ``write(name, tensor)`` one at a time; they must be exactly the model's
    (checked before anything is written)."""
    from workbench.conversion.megatron_files import CheckpointWriter, model_layout

    tok_ok = tokenizer is not None
    if tok_ok:
        _ship_tokenizer(tokenizer, tmp / "tokenizer", tokenizer_from)
    tok_spec = str(final / "tokenizer") if tok_ok else None
    notes = _tokenizer_notes(tmp / "tokenizer" if tok_ok else None, tokenizer_from, cfg)
    cfg = _finish_config(cfg, final, tok_spec)
    if not tok_ok:  # never the base config's tokenizer (e.g. the 4,096-token demo) on another model's vocabulary
        cfg = cfg.replace(**{"data.tokenizer": ""})
    with single_process_group():
        layout = model_layout(cfg, dtype)
    missing = sorted(set(layout.infos) - set(targets))
    unexpected = sorted(set(targets) - set(layout.infos))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for k, info in layout.infos.items():
        if tuple(targets[k].shape) != tuple(info.shape):
            raise ValueError(f"{k}: shape {tuple(targets[k].shape)} but the model wants {tuple(info.shape)}")
    writer = CheckpointWriter(tmp, iteration, layout)
    try:
        fill(writer.write)
        ckpt = writer.finish(cfg, extra={"source": source}, tokenizer=tok_spec)
    except BaseException:
        writer.abort()  # no open file into the staging directory the caller removes
        raise
    (tmp / CONFIG_FILE).write_text(cfg.to_json())
    return ConversionResult(output=final, checkpoint=final / ckpt.name, config=cfg, config_path=final / CONFIG_FILE,
                            files=sorted(p.name for p in tmp.iterdir()), notes=notes)


def _tokenizer_notes(tok_dir: Path | None, src: str, cfg: RunConfig, fix: str = "use the model's own tokenizer") -> list[str]:
    """The tokenizer must fit the model (either direction): one with more ids than the model's vocabulary is refused (those
    ids have no embedding row), one with fewer (or none at all) is carried with a loud warning (the CLI prints it)."""
    vocab = cfg.model.vocab_size
    if tok_dir is None:
        return [f"WARNING: {src}: the checkpoint records no tokenizer and data.tokenizer is "
                f"left empty (the model has {vocab} tokens) -> copy the model's tokenizer.json (or vocab.json + "
                f"merges.txt) into <out>/tokenizer/ and set data.tokenizer to it; until then generation needs prompt token ids"]
    try:
        n = load_tokenizer(str(tok_dir)).vocab_size
    except DataError as e:
        raise ConversionError(f"{src}: its tokenizer files cannot be loaded ({e.problem}) -> fix or remove them") from None
    if n > vocab:
        raise ConversionError(f"{src}: the tokenizer has {n} tokens but the model's vocabulary is {vocab}: ids >= {vocab} "
                              f"have no embedding -> {fix}")
    if n < vocab:
        return [f"WARNING: the tokenizer has {n} tokens, the model {vocab}: generated ids >= {n} have no text "
                f"(generation shows them as <id:N>) -> check that this is the model's tokenizer"]
    return []


# --------------------------------------------------------------------------- HF -> megatron


def hf_to_megatron(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   dtype: str | None = None, make_vocab_size_divisible_by: int | None = None,
                   base_config: RunConfig | None = None, device: str | None = None, force: bool = False,
                   progress: bool = True) -> ConversionResult:
    """HF model directory (any family's HF type, :data:`SUPPORTED_MODEL_TYPES`) -> workbench checkpoint + config
    for the given layout.

    ``dtype`` (fp32/bf16/fp16) sets both the stored tensors and ``train.precision``; default:
    the HF config's torch_dtype when it is one of those, else fp32.  ``device`` sets
    ``parallel.device`` of the written config (default: the base config's, i.e. cuda).
    """
    hf_dir = Path(hf_dir).expanduser().resolve()
    hf = read_hf_config(hf_dir)
    if dtype is None:
        dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(str(hf.get("torch_dtype") or hf.get("dtype")), "fp32")
    if dtype not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r} -> one of {', '.join(_DTYPES)}")
    cfg = run_config_from_hf(hf, base=base_config, tp=tp, pp=pp, vpp=vpp, dtype=dtype,
                             make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    if device:
        cfg = cfg.replace(**{"parallel.device": device})
    _check(cfg, f"(target layout for {hf_dir.name})")
    mt = hf["model_type"]
    from workbench.conversion.hf_files import HFReader

    reader = HFReader(hf_dir)
    rules = hf_to_mcore_rules(reader.infos, cfg, mt)  # a missing tensor or a wrong vocabulary: refused here
    tdt = _torch_dtype(dtype)
    targets = plan_targets(rules, reader.infos, tdt)

    def fill(write: Any) -> None:
        stream_rules(rules, reader.read, write, tdt, _progress(len(rules), f"{mt} -> mcore", progress))

    final = Path(out).expanduser().resolve()
    with _staged_output(out, force, _nbytes(targets), inputs={"--hf": [hf_dir]}, command="hf-to-megatron") as tmp:
        res = _write_megatron(tmp, final, cfg, targets, fill, 0, dtype,
                              {"format": "hf", "model_type": mt, "path": str(hf_dir), "hf_config": hf},
                              hf_dir if _has_tokenizer_files(hf_dir) else None,
                              str(hf_dir) if _has_tokenizer_files(hf_dir) else f"no tokenizer files in {hf_dir}")
    res.notes.append(f"padded vocab {cfg.model.vocab_size} -> {derive(cfg).padded_vocab_size} (mean rows; stripped on export)")
    return res


# --------------------------------------------------------------------------- megatron -> HF


def _open_checkpoint(ckpt: str | Path) -> Any:
    """The checkpoint's :class:`~workbench.checkpoint.CheckpointInfo`: files checked (a damaged or hostile one is a
    CheckpointError naming them, before any work) but for their checksums, which the :class:`CheckpointReader` checks
    as it reads them (:meth:`~workbench.conversion.megatron_files.CheckpointReader.finish`, before the output is renamed into
    place); its config read as data (hooks it names are never imported)."""
    try:
        return checkpoint_info(ckpt, hashes=False)
    except ConfigError as e:
        if len(e.problems) == 1 and e.problems[0].field == "ckpt":
            raise CheckpointError(f"{e.problems[0].rule} -> {e.problems[0].fix}") from None
        raise


def _hook_notes(info: Any) -> list[str]:
    """What the written config leaves out: the hooks the source checkpoint's config named (never imported here)."""
    hooks = recorded_hooks(info.meta.get("config"))
    if not hooks:
        return []
    return [f"WARNING: {info.path}'s config names {', '.join(f'{k} {v!r}' for k, v in sorted(hooks.items()))}: code, which a "
            "conversion never imports and the written config does not carry -> set them in your run's config if you "
            "trust that code"]


def _checkpoint_tokenizer(info: Any, tokenizer: str | Path | None) -> tuple[Any, str]:
    """(the tokenizer spec a conversion of ``info`` ships: ``tokenizer`` if given, else the checkpoint's own; its description)."""
    if tokenizer is not None:
        return tokenizer, f"--tokenizer {tokenizer}"
    spec = tokenizer_spec(info)
    return spec, (f"checkpoint {info.path}" if spec is not None else f"checkpoint {info.path} names no tokenizer")


def _checkpoint_inputs(ckpt: str | Path, info: Any, tok: Any, tokenizer: Any) -> dict[str, list[Any]]:
    """What a conversion of checkpoint ``info`` reads, for :func:`_staged_output`: ``ckpt`` as given (a run directory
    may hold the output), the iteration directory and its root; the tokenizer it ships when that is a path."""
    flag = "--tokenizer" if tokenizer is not None else "tokenizer"
    return {"--ckpt": [ckpt, info.path, info.path.parent], flag: [tok if isinstance(tok, (str, Path)) else None]}


def _file_order(rules: list[Rule], reader: Any) -> list[Rule]:
    """``rules`` in the order their sources lie in the checkpoint's files (:meth:`CheckpointReader.position`), so
    the files are read front to back, once."""
    return sorted(rules, key=lambda r: min((reader.position(s) for s in r.sources), default=(0, "")))


def megatron_to_hf(ckpt: str | Path, out: str | Path, max_shard_size: str | int = "2GB", dtype: str | None = None,
                   force: bool = False, progress: bool = True, tokenizer: str | Path | None = None) -> ConversionResult:
    """Workbench checkpoint (root or iter dir, any layout) -> HF directory that ``from_pretrained`` loads.

    The tokenizer files come from ``tokenizer`` when given, else from the checkpoint (files beside it, its recorded
    spec, its config's ``data.tokenizer``); one that does not load or has more ids than the model's vocabulary is
    refused (ConversionError), a smaller one or none at all is a warning."""
    from workbench.conversion.megatron_files import CheckpointReader, model_layout
    from workbench.conversion.hf_files import SafetensorsWriter

    info = _open_checkpoint(ckpt)
    cfg = info.config
    source = ((info.meta.get("extra") or {}).get("source") or {})
    mt = source.get("model_type") if source.get("format") == "hf" else None
    mt = mt or infer_model_type(cfg.model)
    limit = parse_size(max_shard_size)
    if dtype is not None and dtype not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r} -> one of {', '.join(_DTYPES)}")
    tok, tok_from = _checkpoint_tokenizer(info, tokenizer)
    with single_process_group():
        layout = model_layout(cfg)
    reader = CheckpointReader(info.path, layout)  # its stored objects are read (weights-only) here
    rules = _file_order(mcore_to_hf_rules(layout.infos, cfg, mt, read=reader.read), reader)
    tdt = _torch_dtype(dtype)
    targets = plan_targets(rules, layout.infos, tdt)
    out_dtype = _DTYPES[dtype or cfg.train.precision]
    hf_cfg = hf_config_dict_from_run(cfg, mt, source.get("hf_config"), dtype=out_dtype)
    final = Path(out).expanduser().resolve()
    with _staged_output(out, force, _nbytes(targets), inputs=_checkpoint_inputs(ckpt, info, tok, tokenizer),
                        command="megatron-to-hf") as tmp, closing(reader):
        writer = SafetensorsWriter(tmp, targets, limit)
        try:
            stream_rules(rules, reader.read, writer.write, tdt, _progress(len(rules), f"mcore -> {mt}", progress))
            reader.finish()  # the checksums of what was read: a file that differs leaves no output
            files = writer.close()
        except BaseException:
            writer.abort()  # no open shard into the staging directory _staged_output removes
            raise
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2))
        if tok is not None:
            _ship_tokenizer(tok, tmp, tok_from)
            tok_notes = _tokenizer_notes(tmp, tok_from, cfg, "pass the model's own tokenizer with --tokenizer DIR")
        names = sorted(p.name for p in tmp.iterdir())
    res = ConversionResult(output=final, config=cfg, files=names)
    res.notes.append(f"{len(files)} safetensors shard(s), max {limit} bytes; model_type {mt}; dtype {out_dtype}")
    res.notes += tok_notes if tok is not None else [f"WARNING: {tok_from}: the export has no tokenizer files -> copy the "
                                                    f"model's tokenizer into {final} (or pass --tokenizer DIR)"]
    return res


# --------------------------------------------------------------------------- reshape


def reshape(ckpt: str | Path, out: str | Path, tp: int, pp: int, vpp: int | None = None, force: bool = False,
            tokenizer: str | Path | None = None) -> ConversionResult:
    """Re-target a checkpoint's parallel layout (config + vocab padding); weights only (no optimizer state).
    The tokenizer travels as in :func:`megatron_to_hf` (into ``<out>/tokenizer``)."""
    from workbench.conversion.megatron_files import CheckpointReader, model_layout

    info = _open_checkpoint(ckpt)
    src_cfg = info.config
    d = src_cfg.to_dict()
    d["parallel"].update(tensor_parallel=int(tp), pipeline_parallel=int(pp),
                         virtual_pipeline_parallel=int(vpp) if vpp and vpp > 1 else None)
    if d["parallel"]["nnodes"] * d["parallel"]["nproc_per_node"] % (int(tp) * int(pp)):
        d["parallel"].update(nnodes=1, nproc_per_node=int(tp) * int(pp))
    cfg = RunConfig.from_dict(d)
    _check(cfg, f"(reshape target tp={tp} pp={pp}{f' vpp={vpp}' if vpp else ''})")
    V = cfg.model.vocab_size
    padded = derive(cfg).padded_vocab_size
    final = Path(out).expanduser().resolve()
    tok, tok_from = _checkpoint_tokenizer(info, tokenizer)
    with single_process_group():
        layout = model_layout(src_cfg)
    reader = CheckpointReader(info.path, layout)  # its stored objects are read (weights-only) here
    vocab = set(vocab_keys())  # every vocab-sized tensor (BERT's LM head also has a vocab-sized output bias)
    rules = _file_order([Rule((k,), (k,), (lambda t: pad_vocab_rows(t, padded, real=V)) if k in vocab else (lambda t: t))
                         for k in layout.infos], reader)
    targets = plan_targets(rules, layout.infos)

    def fill(write: Any) -> None:
        stream_rules(rules, reader.read, write)
        reader.finish()  # the checksums of what was read: a file that differs leaves no output

    source = dict(reader.extra.get("source") or {})
    source["reshaped_from"] = {"path": str(info.path), "tensor_parallel": src_cfg.parallel.tensor_parallel,
                               "pipeline_parallel": src_cfg.parallel.pipeline_parallel}
    iteration = int(reader.dcp.common.get("iteration", info.meta.get("iteration", 0)))
    with _staged_output(out, force, _nbytes(targets), inputs=_checkpoint_inputs(ckpt, info, tok, tokenizer),
                        command="reshape") as tmp, closing(reader):
        res = _write_megatron(tmp, final, cfg, targets, fill, iteration, cfg.train.precision, source, tok, tok_from)
    if info.meta.get("has_optimizer"):
        res.notes.append("optimizer state was not carried over (reshape writes weights; resume with finetune or a fresh optimizer)")
    res.notes += _hook_notes(info)
    return res


# --------------------------------------------------------------------------- legacy


def import_legacy(path: str | Path, out: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                  dtype: str | None = None, vocab_size: int | None = None, num_attention_heads: int | None = None,
                  make_vocab_size_divisible_by: int | None = None, tokenizer_dir: str | Path | None = None,
                  force: bool = False) -> ConversionResult:
    """Legacy Megatron-LM GPT checkpoint (``mp_rank_XX[_YYY]/model_optim_rng.pt``) -> workbench checkpoint."""
    from workbench.conversion.legacy import legacy_to_mcore, load_legacy, run_config_from_legacy

    ck = load_legacy(path, num_attention_heads)
    dtype = dtype or "fp32"
    if dtype not in _DTYPES:
        raise ConversionError(f"--dtype {dtype!r} -> one of {', '.join(_DTYPES)}")
    cfg = run_config_from_legacy(ck, vocab_size=vocab_size, num_attention_heads=num_attention_heads, tp=tp, pp=pp,
                                 vpp=vpp, dtype=dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    _check(cfg, "(legacy import target)")
    full = legacy_to_mcore(ck, cfg, derive(cfg).padded_vocab_size)
    tdt = _torch_dtype(dtype)
    full = {k: v.to(tdt) for k, v in full.items()}
    final = Path(out).expanduser().resolve()
    source = {"format": "megatron-lm-legacy", "path": str(Path(path).resolve()), "checkpoint_version": ck.checkpoint_version,
              "tensor_parallel": ck.tp, "pipeline_parallel": ck.pp, "iteration": ck.iteration}
    def fill(write: Any) -> None:
        for k in list(full):
            write(k, full.pop(k))

    with _staged_output(out, force, _nbytes(infos_of(full)), inputs={"--load": [path], "--tokenizer": [tokenizer_dir or None]},
                        command="legacy") as tmp:
        res = _write_megatron(tmp, final, cfg, infos_of(full), fill, 0, dtype, source, tokenizer_dir or None,
                              f"--tokenizer {tokenizer_dir}" if tokenizer_dir else f"legacy checkpoint {path} (no --tokenizer given)")
    res.notes.append(f"merged {ck.tp} TP shard(s) x {ck.pp} PP stage(s), checkpoint_version {ck.checkpoint_version}")
    if vocab_size is None:
        res.notes.append(f"vocab_size taken as the checkpoint's {cfg.model.vocab_size} rows (pass --vocab-size to strip padding)")
    return res


# --------------------------------------------------------------------------- inspection


def checkpoint_structure(path: str | Path) -> dict[str, Any]:
    """Tensors (name -> shape, dtype) and metadata of a workbench checkpoint, an HF dir, or a legacy checkpoint."""
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        hf = read_hf_config(p)
        from safetensors import safe_open

        tensors: dict[str, Any] = {}
        files = sorted(p.glob("*.safetensors"))
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    tensors[k] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        if not files:
            tensors = {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in load_hf_state_dict(p).items()}
        return {"kind": "hf", "path": str(p), "model_type": hf["model_type"], "tensors": tensors}
    try:
        meta = read_metadata(p)
    except CheckpointError as e:
        from workbench.conversion.legacy import find_legacy_files

        try:
            find_legacy_files(p)
        except ConversionError:
            if "no complete checkpoint" not in str(e) and "does not exist" not in str(e):
                raise e from None  # a workbench checkpoint that cannot be read: its own message names the file
            raise CheckpointError(f"{p}: neither a workbench checkpoint, an HF model directory nor a legacy Megatron-LM "
                                  "checkpoint -> pass one of those") from None
        from workbench.conversion.legacy import lm_tensors, safe_torch_load

        files = find_legacy_files(p)
        tensors = {}
        for (r, s), f in sorted(files.items()):
            for k, v in lm_tensors(safe_torch_load(f), f).items():
                if hasattr(v, "shape"):
                    tensors[f"mp_rank_{r:02d}_{s:03d}/{k}"] = (tuple(v.shape), str(v.dtype).replace("torch.", ""))
        return {"kind": "megatron-lm-legacy", "path": str(p), "tensors": tensors}
    tensors = checkpoint_tensor_shapes(meta["path"])
    return {"kind": "workbench", "path": meta["path"], "iteration": meta.get("iteration"),
            "config": meta.get("config"), "tokenizer": meta.get("tokenizer"), "tensors": tensors,
            "source": ((meta.get("extra") or {}).get("source") or {}).get("format")}


def format_structure(info: dict[str, Any]) -> str:
    lines = [f"{info['kind']} checkpoint: {info['path']}"]
    if info.get("iteration") is not None:
        lines.append(f"iteration: {info['iteration']}")
    if info.get("model_type"):
        lines.append(f"model_type: {info['model_type']}")
    if info.get("config"):
        m = info["config"]["model"]
        p = info["config"]["parallel"]
        lines.append(f"model: {m['num_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']}, "
                     f"vocab {m['vocab_size']}; saved for tp={p['tensor_parallel']} pp={p['pipeline_parallel']} (loads at any layout)")
    total = 0
    width = max((len(k) for k in info["tensors"]), default=10)
    for k, (shape, dt) in sorted(info["tensors"].items()):
        n = 1
        for s in shape:
            n *= s
        total += n
        lines.append(f"  {k:<{width}}  {str(list(shape)):<22} {dt}")
    lines.append(f"{len(info['tensors'])} tensors, {total / 1e6:.2f}M elements")
    return "\n".join(lines)


# --------------------------------------------------------------------------- demos


def make_random_hf_model(out: str | Path, model_type: str = "gpt2", **kwargs: Any) -> Path:
    """A small randomly initialised HF model dir of ``model_type`` for demos and tests (the family's adapter makes it)."""
    fam = family_for_hf(model_type)
    if fam is None:
        raise ConversionError(f"model_type {model_type!r} -> one of {sorted(SUPPORTED_MODEL_TYPES)}")
    return hf_adapter(model_type).make_random_hf_model(out, model_type, **kwargs)


def compare_hf_dirs(a: str | Path, b: str | Path) -> dict[str, Any]:
    """Tensor-by-tensor comparison of two HF model dirs, one tensor of each at a time:
    {'identical': bool, 'differing': [...], 'missing': [...], 'tensors': n}."""
    import torch

    from workbench.conversion.hf_files import HFReader

    ra, rb = HFReader(a), HFReader(b)
    differing = []
    for k, ta in ra.tensors():
        if k in rb:
            tb = rb.read(k)
            if ta.dtype != tb.dtype or not torch.equal(ta, tb):
                differing.append(k)
            del tb
    missing = sorted(set(ra.infos) ^ set(rb.infos))
    return {"identical": not differing and not missing, "differing": differing, "missing": missing, "tensors": len(ra.infos)}
