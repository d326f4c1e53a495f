"""The ``workbench`` command line.

Each concern module contributes its own sub-commands through an ``add_cli(subparsers)``
function, so this file stays a thin router.  Every handler returns an exit code; bad
input exits 2 with the problems listed, never with a stack trace.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from workbench.config import ConfigError, from_accelerate, load_config

# Modules that register sub-commands (in help order).
COMMAND_MODULES = [
    "workbench.planner",         # plan
    "workbench.schedules",       # schedule
    "workbench.bridge",          # launch, sweep, notebook
    "workbench.data",            # preprocess, tokenizer, data
    "workbench.conversion",      # convert
    "workbench.generation",      # generate
]


def _config_validate(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    problems = cfg.validate()
    if problems:
        print(str(ConfigError(problems, args.file)), file=sys.stderr)
        return 2
    d = cfg.derived()
    print(f"{args.file}: valid  (world {d.world_size} = tp {cfg.parallel.tensor_parallel} x pp {cfg.parallel.pipeline_parallel} x dp {d.data_parallel}; "
          f"{d.params.total / 1e6:.1f}M params; {d.num_microbatches} micro-batches/step)")
    return 0


def _config_from_accelerate(args: argparse.Namespace) -> int:
    try:
        cfg = from_accelerate(args.file)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    out = Path(args.output)
    cfg.save(out)
    problems = cfg.validate()
    print(f"wrote {out}")
    if problems:
        print("note: the imported config does not validate yet (model fields come from the workbench defaults):", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from workbench.config import preset

    try:
        cfg = preset(args.preset)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    print(cfg.to_yaml() if args.yaml else cfg.to_json())
    return 0


def _add_config_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate, show and import run configs")
    csub = p.add_subparsers(dest="config_cmd", required=True)
    v = csub.add_parser("validate", help="exit 0 when valid, 2 with every problem listed")
    v.add_argument("file")
    v.set_defaults(func=_config_validate)
    a = csub.add_parser("from-accelerate", help="convert an Accelerate config with a megatron_lm_config section")
    a.add_argument("file")
    a.add_argument("-o", "--output", required=True)
    a.set_defaults(func=_config_from_accelerate)
    s = csub.add_parser("preset", help="print a preset as JSON (or YAML)")
    s.add_argument("preset")
    s.add_argument("--yaml", action="store_true")
    s.set_defaults(func=_config_show)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description="Megatron Workbench")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_cli(sub)
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that concern is not built yet
                continue
            raise
        add = getattr(mod, "add_cli", None)
        if add is not None:
            add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
