"""``workbench plan``: the plan as text (:mod:`workbench.planner.text`) or JSON; exit 1 when it does not fit."""

from __future__ import annotations

import argparse
import sys

from workbench.config import ConfigError, load_config
from workbench.planner import text
from workbench.planner.gpus import GPUS
from workbench.planner.plan import COMPONENTS, Plan
from workbench.planner.predict import predict

__all__ = ["format_plan", "add_cli"]


def format_plan(plan: Plan) -> str:
    """A per-rank table (GiB) with the breakdown, totals, fits, suggestions and the notes that explain them
    (:mod:`workbench.planner.text`)."""
    return text.format_plan(plan, COMPONENTS)


def _cli_plan(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.file)
        plan = predict(cfg, gpu=args.gpu)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    except ValueError as err:  # unknown GPU name
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else format_plan(plan))
    if plan.fits is False:  # a status a script can test: 1 = does not fit, 2 = bad input
        print(f"workbench plan: does not fit on {args.gpu} (exit 1)", file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="predict per-rank GPU memory of a run config (before launching)",
                              epilog="exit status: 0 fits (or no --gpu), 1 does not fit on --gpu, 2 bad config or GPU name")
    p.add_argument("file", help="run config (JSON or YAML)")
    p.add_argument("--gpu", default=None, help=f"GPU to check against: {', '.join(GPUS)} or a capacity like 24GiB")
    p.add_argument("--json", action="store_true", help="print the whole plan (every rank, breakdown) as JSON")
    p.set_defaults(func=_cli_plan)
