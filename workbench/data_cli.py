"""``workbench preprocess``, ``workbench tokenizer ...`` and ``workbench data ...``: the data tools of
:mod:`workbench.data` on the command line (``preprocess --config`` reads a run config's ``model.vocab_size``).

Every handler returns an exit code: 0 on success, 2 with a one-line reason (file + problem + fix)
on bad input, never a stack trace for the user's mistakes.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys

from workbench.config import ConfigError, load_config
from workbench.data.demo import ensure_demo_dataset
from workbench.data.errors import DataError
from workbench.data.indexed import check_indexed
from workbench.data.inspect import inspect_dataset, plot_lengths
from workbench.data.preprocess import preprocess
from workbench.data.sources import ReadStats, iter_documents, resolve_inputs
from workbench.data.tokenizer import load_tokenizer, train_tokenizer, train_wordpiece

__all__ = ["add_cli"]


def _fail(e: Exception) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 2


def _model_vocab(args: argparse.Namespace) -> int | None:
    if getattr(args, "model_vocab_size", None):
        return args.model_vocab_size
    if getattr(args, "config", None):
        return load_config(args.config).model.vocab_size
    return None


def _preprocess(args: argparse.Namespace) -> int:
    try:
        summary = preprocess(args.input, args.output_prefix, tokenizer=args.tokenizer, json_key=args.json_key,
                             append_eod=args.append_eod, workers=args.workers, split_docs=args.split_docs,
                             invalid_utf8=args.invalid_utf8, model_vocab_size=_model_vocab(args), progress=not args.quiet,
                             split_sentences=args.split_sentences)
    except (DataError, ConfigError) as e:
        return _fail(e)
    except KeyboardInterrupt:
        print("interrupted: no new .idx was written (the previous dataset, if any, is untouched)", file=sys.stderr)
        return 130
    except OSError as e:  # out of disk or a file size limit mid-write (a directory that cannot be written: refused before)
        space = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        fix = "free disk space (or choose another --output-prefix)" if space else "choose another --output-prefix"
        print(f"error: writing {args.output_prefix}.bin/.idx failed: {e} -> {fix} and run again; nothing was written "
              "there (the previous dataset, if any, is untouched)", file=sys.stderr)
        return 1
    print(json.dumps(summary.to_dict()) if args.json else summary)
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    try:
        paths = resolve_inputs(args.input)
        stats = ReadStats()
        docs = iter_documents(paths, json_key=args.json_key, split_docs=args.split_docs, stats=stats, invalid_utf8=args.invalid_utf8)
        if args.wordpiece:
            tok = train_wordpiece(docs, args.vocab_size, args.out, min_frequency=args.min_frequency, lowercase=args.lowercase)
        else:
            tok = train_tokenizer(docs, args.vocab_size, args.out, min_frequency=args.min_frequency)
    except DataError as e:
        return _fail(e)
    kind = "WordPiece (BERT)" if args.wordpiece else "byte-level BPE"
    print(f"trained {tok.vocab_size}-token {kind} on {stats.documents:,} documents ({stats.bytes:,} bytes) -> {args.out}")
    if stats.invalid_utf8:
        print(f"WARNING: {stats.invalid_utf8} line(s) with invalid UTF-8 (first at {', '.join(stats.invalid_utf8_where)})", file=sys.stderr)
    if tok.vocab_size < args.vocab_size:
        print(f"note: the corpus supported only {tok.vocab_size} tokens (asked for {args.vocab_size})", file=sys.stderr)
    return 0


def _tokenizer_info(args: argparse.Namespace) -> int:
    try:
        tok = load_tokenizer(args.spec)
    except DataError as e:
        return _fail(e)
    print(json.dumps(tok.spec(), indent=2))
    if args.text is not None:
        ids = tok.encode(args.text)
        print(f"{len(ids)} tokens: {ids}")
        print("pieces:", [tok.decode([i]) for i in ids])
    return 0


def _data_inspect(args: argparse.Namespace) -> int:
    try:
        report = inspect_dataset(args.prefix, tokenizer=args.tokenizer, samples=args.samples)
    except DataError as e:
        return _fail(e)
    print(json.dumps(report.to_dict()) if args.json else report)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plot_lengths(report, args.plot)
        plt.close(fig)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _data_check(args: argparse.Namespace) -> int:
    rc = 0
    for prefix in args.prefix:
        try:
            info = check_indexed(prefix)
        except DataError as e:
            rc = _fail(e)
            continue
        print(f"{info.prefix}: ok ({info.documents:,} documents, {info.tokens:,} tokens, {info.dtype})")
    return rc


def _data_demo(args: argparse.Namespace) -> int:
    try:
        prefix = ensure_demo_dataset(args.cache_dir, progress=not args.quiet)
    except DataError as e:
        return _fail(e)
    print(prefix)
    return 0


def _add_reader_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", nargs="+", required=True, metavar="FILE|DIR|GLOB",
                   help="text (.txt/.md) or JSON-lines (.jsonl/.json) files, optionally .gz; directories are searched recursively")
    p.add_argument("--json-key", default="text", help="field holding the document in JSON lines (default: text)")
    p.add_argument("--split-docs", choices=["blank-line", "line"], default="blank-line",
                   help="plain text: a document per blank-line-separated block (default) or per line")
    p.add_argument("--invalid-utf8", choices=["replace", "skip", "error"], default="replace",
                   help="lines with invalid UTF-8 are counted and reported; keep them with U+FFFD (default), skip them, or stop")


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="tokenize text / JSON lines into a Megatron indexed dataset (PREFIX.bin/.idx)")
    _add_reader_args(p)
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.workbench.json")
    p.add_argument("--tokenizer", default="demo", help="'demo', a local HF tokenizer directory or a tokenizer.json (default: demo)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the tokenizer's end-of-document token (default: on)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1: in-process)")
    p.add_argument("--model-vocab-size", type=int, default=None, help="refuse a tokenizer whose vocabulary is larger than this")
    p.add_argument("--config", default=None, help="a run config: take --model-vocab-size from its model.vocab_size")
    p.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence inside each document (Megatron-LM's --split-sentences; what BERT reads; "
                        "deterministic rule-based splitter, no download); use with --no-append-eod for BERT")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_preprocess)

    t = sub.add_parser("tokenizer", help="train or show tokenizers")
    tsub = t.add_subparsers(dest="tokenizer_cmd", required=True)
    tt = tsub.add_parser("train", help="train a byte-level BPE locally (Hugging Face tokenizers)")
    _add_reader_args(tt)
    tt.add_argument("--vocab-size", type=int, required=True)
    tt.add_argument("--out", required=True, help="directory for tokenizer.json + tokenizer_config.json")
    tt.add_argument("--min-frequency", type=int, default=2)
    tt.add_argument("--wordpiece", action="store_true", help="a BERT WordPiece vocabulary ([PAD]=0 [UNK] [CLS] [SEP] [MASK]; writes vocab.txt too)")
    tt.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=True, help="WordPiece: lower-case the text (default: on)")
    tt.set_defaults(func=_tokenizer_train)
    ti = tsub.add_parser("info", help="show a tokenizer's vocabulary size and special tokens (and encode TEXT)")
    ti.add_argument("spec")
    ti.add_argument("text", nargs="?", default=None)
    ti.set_defaults(func=_tokenizer_info)

    d = sub.add_parser("data", help="inspect and check indexed datasets; build the demo dataset")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    di = dsub.add_parser("inspect", help="documents, tokens, length histogram, decoded samples")
    di.add_argument("prefix", help="PREFIX (or PREFIX.bin / PREFIX.idx)")
    di.add_argument("--tokenizer", default=None, help="decode samples with this tokenizer (default: the one recorded by preprocess)")
    di.add_argument("--plot", default=None, metavar="FILE.png", help="save the length histogram")
    di.add_argument("--samples", type=int, default=3)
    di.add_argument("--json", action="store_true")
    di.set_defaults(func=_data_inspect)
    dc = dsub.add_parser("check", help="validate PREFIX.idx against PREFIX.bin (exit 2 on a problem)")
    dc.add_argument("prefix", nargs="+")
    dc.set_defaults(func=_data_check)
    dd = dsub.add_parser("demo", help="build (once) the embedded corpus's indexed dataset and print its prefix")
    dd.add_argument("--cache-dir", default=None)
    dd.add_argument("-q", "--quiet", action="store_true")
    dd.set_defaults(func=_data_demo)
