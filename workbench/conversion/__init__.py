"""Checkpoint conversion: Hugging Face <-> megatron-core for every model family's HF types (each family's
``Supports.hf_classes``), layout reshape, legacy Megatron-LM import.

``workbench convert hf-to-megatron | megatron-to-hf | reshape | legacy | inspect | verify | trust`` and the
same as Python functions (:func:`hf_to_megatron`, :func:`megatron_to_hf`, :func:`reshape`,
:func:`import_legacy`, :func:`checkpoint_structure`, :func:`workbench.checkpoint.record_checksums`).
Light at import: torch, transformers and megatron-core load inside the functions that use them, and so do the
checkpoint package and the conversion modules; the CLI starts with the config and the families' declarations only.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Any

from workbench.config import ConfigError
from workbench.families import FAMILIES

__all__ = [
    "hf_to_megatron",
    "megatron_to_hf",
    "reshape",
    "import_legacy",
    "checkpoint_structure",
    "format_structure",
    "verify_against_hf",
    "make_random_hf_model",
    "compare_hf_dirs",
    "ConversionError",
    "add_cli",
]


def __getattr__(name: str) -> Any:  # lazy re-exports keep `import workbench.conversion` light
    if name in ("hf_to_megatron", "megatron_to_hf", "reshape", "import_legacy", "checkpoint_structure",
                "format_structure", "ConversionResult", "make_random_hf_model", "compare_hf_dirs"):
        from workbench.conversion import api

        return getattr(api, name)
    if name == "ConversionError":
        from workbench.models.common.conversion_rules import ConversionError

        return ConversionError
    if name in ("verify_against_hf",):
        from workbench.conversion import verify

        return getattr(verify, name)
    raise AttributeError(name)


# --------------------------------------------------------------------------- CLI


def _report(res: Any) -> None:
    print(f"wrote {res.output}")
    if res.checkpoint is not None:
        print(f"  checkpoint: {res.checkpoint}")
    if res.config_path is not None:
        c = res.config.parallel
        print(f"  config:     {res.config_path}  (tp={c.tensor_parallel} pp={c.pipeline_parallel}"
              f"{f' vpp={c.virtual_pipeline_parallel}' if c.virtual_pipeline_parallel else ''}, finetune from this checkpoint)")
    for n in res.notes:
        if n.startswith("WARNING: "):  # loud: stderr, where a script or a person sees it
            print(f"warning: {n[len('WARNING: '):]}", file=sys.stderr)
        else:
            print(f"  note: {n}")


def _print_structure(path: str) -> None:
    from workbench.conversion.api import checkpoint_structure, format_structure

    print(format_structure(checkpoint_structure(path)))


#: the environment a conversion process starts torch with: tensors of 2 MB and more on transparent huge pages (torch's
#: CPU allocator reads this once, at its first allocation).  A conversion allocates its model's size in fresh tensors
#: several times over; on the CI-class machine a copy into fresh tensors ran at 2.8-3.0 GB/s on 4 KiB pages and at
#: 8-11 GB/s on huge pages.
CONVERT_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}

#: glibc ``mallopt`` parameters (``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``) and the value a conversion process sets:
#: every block of 1 MB and more is its own mapping, given back to the kernel when the tensor is freed.  glibc's
#: default threshold grows after each freed mapping (up to 32 MB), so tensors below 32 MB then come from the heap,
#: which on huge pages keeps what they leave behind: a CI-scale hf-to-megatron peaked 290-360 MB above its baseline
#: (the higher under load) where it peaks at 140 MB with these.
_MALLOPT = {-3: 1 << 20, -1: 1 << 20}


def prepare_conversion_process() -> None:
    """What a conversion process sets before its first tensor: ``CONVERT_ENV`` (kept where the environment already
    says otherwise; only before torch is imported) and, on glibc, the allocator's release of freed blocks."""
    if "torch" not in sys.modules:
        for k, v in CONVERT_ENV.items():
            os.environ.setdefault(k, v)
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    for param, value in _MALLOPT.items():
        libc.mallopt(ctypes.c_int(param), ctypes.c_int(value))


def _run(fn: Any, args: argparse.Namespace) -> int:
    prepare_conversion_process()
    from workbench.checkpoint import CheckpointError
    from workbench.models.common.conversion_rules import ConversionError

    try:
        return int(fn(args) or 0)
    except (ConversionError, CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {e} -> free space on that file system and convert again (the partial output was removed)",
              file=sys.stderr)
        return 1


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from workbench.conversion.api import hf_to_megatron

    if args.print_checkpoint_structure:
        _print_structure(args.hf)
    res = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, dtype=args.dtype,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, device=args.device,
                         force=args.force, progress=not args.quiet)
    _report(res)
    if args.print_checkpoint_structure:
        _print_structure(str(res.output))
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from workbench.conversion.api import megatron_to_hf

    if args.print_checkpoint_structure:
        _print_structure(args.ckpt)
    res = megatron_to_hf(args.ckpt, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype,
                         force=args.force, progress=not args.quiet, tokenizer=args.tokenizer)
    _report(res)
    if args.print_checkpoint_structure:
        _print_structure(str(res.output))
    return 0


def _reshape(args: argparse.Namespace) -> int:
    from workbench.conversion.api import reshape

    res = reshape(args.ckpt, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, force=args.force, tokenizer=args.tokenizer)
    _report(res)
    if args.print_checkpoint_structure:
        _print_structure(str(res.output))
    return 0


def _legacy(args: argparse.Namespace) -> int:
    from workbench.conversion.api import import_legacy

    if args.print_checkpoint_structure:
        _print_structure(args.load)
    res = import_legacy(args.load, args.out, tp=args.tp, pp=args.pp, vpp=args.vpp, dtype=args.dtype,
                        vocab_size=args.vocab_size, num_attention_heads=args.num_attention_heads,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        tokenizer_dir=args.tokenizer, force=args.force)
    _report(res)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    _print_structure(args.path)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from workbench.conversion.verify import verify_against_hf

    r = verify_against_hf(args.ckpt, args.hf, tp=args.tp, pp=args.pp, vpp=args.vpp, seq_length=args.seq_length,
                          batch_size=args.batch_size, atol=args.atol)
    print(f"max |logits(mcore tp={args.tp} pp={args.pp}) - logits(HF)| = {r['max_abs_diff']:.3g} (atol {args.atol})")
    return 0 if r["ok"] else 1


def _trust(args: argparse.Namespace) -> int:
    from workbench.checkpoint import find_checkpoint, record_checksums

    d = find_checkpoint(args.ckpt)
    files = record_checksums(d)
    print(f"recorded the checksums of {len(files)} files of {d} ({', '.join(sorted(files))}): from now on a file that "
          "changes, or one that is added, is refused")
    return 0


def _hf_types() -> str:
    """The HF classes ``hf-to-megatron`` reads, from every family's declaration."""
    return ", ".join(cls for f in FAMILIES.values() for _, cls in f.supports.hf_classes)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_cli(sub: argparse._SubParsersAction) -> None:
    """``workbench convert ...``"""
    p = sub.add_parser("convert", help="convert checkpoints: HF <-> megatron-core, reshape TP/PP, legacy Megatron-LM import",
                       description=f"Hugging Face types converted: {_hf_types()}.")
    csub = p.add_subparsers(dest="convert_cmd", required=True)

    def layout(x: argparse.ArgumentParser, required: bool = False) -> None:
        x.add_argument("--tp", type=_positive, default=None if required else 1, required=required, help="tensor parallel size")
        x.add_argument("--pp", type=_positive, default=None if required else 1, required=required, help="pipeline parallel size")
        x.add_argument("--vpp", type=_positive, default=None, help="virtual pipeline chunks per pipeline rank")

    def common(x: argparse.ArgumentParser) -> None:
        x.add_argument("--out", required=True, help="output directory (written atomically; must not exist unless --force)")
        x.add_argument("--force", action="store_true", help="replace an existing --out")
        x.add_argument("--print-checkpoint-structure", action="store_true", help="list every tensor (name, shape, dtype)")

    h = csub.add_parser("hf-to-megatron", help=f"HF model dir ({_hf_types()}) -> workbench checkpoint + config",
                        description=f"A local Hugging Face model directory ({_hf_types()}) -> workbench checkpoint + config.")
    h.add_argument("--hf", required=True, help="local HF model directory (config.json + safetensors or .bin)")
    common(h)
    layout(h)
    h.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="stored dtype and train.precision (default: the HF dtype)")
    h.add_argument("--make-vocab-size-divisible-by", type=_positive, default=None, help="vocab padding multiple (x tp); default 128")
    h.add_argument("--device", choices=["cuda", "cpu"], default=None, help="parallel.device of the written config (default cuda)")
    h.add_argument("--quiet", action="store_true", help="no progress bar")
    h.set_defaults(func=lambda a: _run(_hf_to_megatron, a))

    m = csub.add_parser("megatron-to-hf", help="workbench checkpoint (any layout) -> sharded safetensors HF directory")
    m.add_argument("--ckpt", required=True, help="checkpoint root or iter_XXXXXXX directory")
    common(m)
    m.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard, e.g. 2GB, 500MB")
    m.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="output dtype (default: the checkpoint's)")
    m.add_argument("--tokenizer", default=None, help="tokenizer to ship (directory, tokenizer.json or name; default: the checkpoint's)")
    m.add_argument("--quiet", action="store_true")
    m.set_defaults(func=lambda a: _run(_megatron_to_hf, a))

    r = csub.add_parser("reshape", help="re-target a checkpoint's TP/PP/VPP layout (weights; config rewritten)")
    r.add_argument("--ckpt", required=True)
    common(r)
    layout(r, required=True)
    r.add_argument("--tokenizer", default=None, help="tokenizer to ship (directory, tokenizer.json or name; default: the checkpoint's)")
    r.set_defaults(func=lambda a: _run(_reshape, a))

    lg = csub.add_parser("legacy", help="legacy Megatron-LM GPT checkpoint (mp_rank_XX[_YYY]/model_optim_rng.pt) -> workbench checkpoint")
    lg.add_argument("--load", required=True, help="legacy root, iter_/release dir, or model_optim_rng.pt")
    common(lg)
    layout(lg)
    lg.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    lg.add_argument("--vocab-size", type=_positive, default=None, help="the tokenizer's vocab size (strips the checkpoint's padding)")
    lg.add_argument("--num-attention-heads", type=_positive, default=None, help="needed when the checkpoint has no args")
    lg.add_argument("--make-vocab-size-divisible-by", type=_positive, default=None)
    lg.add_argument("--tokenizer", default=None, help="HF tokenizer directory to ship with the checkpoint")
    lg.set_defaults(func=lambda a: _run(_legacy, a))

    i = csub.add_parser("inspect", help="print a checkpoint's structure (workbench, HF or legacy)")
    i.add_argument("path")
    i.set_defaults(func=lambda a: _run(_inspect, a))

    v = csub.add_parser("verify", help="run the checkpoint at TP/PP on CPU (torchrun, gloo) and compare logits with the HF model")
    v.add_argument("--ckpt", required=True)
    v.add_argument("--hf", required=True)
    layout(v)
    v.add_argument("--seq-length", type=_positive, default=16)
    v.add_argument("--batch-size", type=_positive, default=2)
    v.add_argument("--atol", type=float, default=1e-4)
    v.set_defaults(func=lambda a: _run(_verify, a))

    t = csub.add_parser("trust", help="record the checksums of a checkpoint saved without them (only for a copy you trust)",
                        description="A checkpoint without a checksum list is refused everywhere (its files cannot be checked). "
                                    "This records the files as they are now, after checking its tensor index and that it holds "
                                    "only files a megatron-core save writes.")
    t.add_argument("--ckpt", required=True, help="checkpoint root or iter_XXXXXXX directory")
    t.set_defaults(func=lambda a: _run(_trust, a))
