"""docs/checkpoints-and-conversion.md opens with a walkthrough (HF -> ``convert hf-to-megatron`` -> fine-tune with
``launch`` -> ``convert megatron-to-hf``) whose every command line parses with the real CLI parser
(``workbench.cli.build_parser``; nothing runs), and whose steps hand their files to each other: the launch runs the
config the conversion writes, the export reads a run's checkpoints."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from workbench.cli import build_parser
from workbench.conversion.api import CONFIG_FILE

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "checkpoints-and-conversion.md"
HEADING = "## Walkthrough:"


def walkthrough() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert HEADING in text, f"{DOC.name} has no section starting {HEADING!r}"
    first = text.split("\n## ", 2)
    assert first[1].startswith(HEADING[3:]), f"the walkthrough is not the first section of {DOC.name}"
    return first[1]


def command_lines() -> list[list[str]]:
    blocks = re.findall(r"^```bash\n(.*?)^```$", walkthrough(), re.M | re.S)
    assert blocks, "the walkthrough shows no ```bash block"
    return [shlex.split(line, comments=True) for block in blocks for line in block.splitlines()
            if line.strip().startswith("workbench ")]


def test_every_command_line_parses_with_the_real_cli():
    parser = build_parser()
    lines = command_lines()
    assert len(lines) >= 3, lines
    for argv in lines:
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit as e:  # argparse's refusal: an unknown command, flag or choice
            pytest.fail(f"{shlex.join(argv)!r} does not parse (exit {e.code})")
        assert callable(args.func), argv


def test_the_steps_are_convert_fine_tune_export_and_hand_files_on():
    parser = build_parser()
    parsed = [(argv, parser.parse_args(argv[1:])) for argv in command_lines()]
    names = [" ".join(a[1:3]) if a[1] == "convert" else a[1] for a, _ in parsed]
    order = [names.index(n) for n in ("convert hf-to-megatron", "launch", "convert megatron-to-hf")]
    assert order == sorted(order), names
    to_mcore = next(ns for a, ns in parsed if a[1:3] == ["convert", "hf-to-megatron"])
    launches = [ns for a, ns in parsed if a[1] == "launch"]
    assert any(not ns.dry_run for ns in launches), "no launch that trains"
    for ns in launches:  # the config the conversion writes (checkpoint.load_dir + finetune set)
        assert Path(ns.file) == Path(to_mcore.out) / CONFIG_FILE, (ns.file, to_mcore.out)
    export = next(ns for a, ns in parsed if a[1:3] == ["convert", "megatron-to-hf"])
    assert export.ckpt.startswith("runs/") and export.ckpt.rstrip("/").endswith("checkpoints"), export.ckpt
