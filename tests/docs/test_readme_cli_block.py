"""README.md's "Command line" block: every flag it shows belongs to the command it follows, and it shows what a
newcomer looks for first (``--version``, ``config preset --list``, ``advise --fp8``, ``generate --device``)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from workbench.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def cli_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Command line", 1)[1]
    return section.split("```", 2)[1]


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    out = {o for a in parser._actions for o in a.option_strings}
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= flags_of(sub)
    return out


def commands(block: str) -> list[tuple[str, str]]:
    """(command, its text) for each ``workbench COMMAND ...`` in the block (a line may hold two)."""
    out = []
    for line in block.splitlines():
        for part in re.split(r"(?=\bworkbench )", line):
            m = re.match(r"workbench (\S+)(.*)", part.strip())
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def test_every_flag_shown_belongs_to_its_command():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    shown = commands(cli_block())
    assert len(shown) >= 15, shown
    for command, rest in shown:
        if command.startswith("--"):
            assert command in flags_of(parser), command
            continue
        assert command in subs, command
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
            assert flag in flags_of(subs[command]), (command, flag)


def test_the_block_shows_what_a_newcomer_looks_for():
    shown = commands(cli_block())
    assert ("--version", "") in [(c, r.split("workbench")[0].strip()) for c, r in shown]
    assert any(c == "config" and "preset --list" in r for c, r in shown)
    assert any(c == "advise" and "[--fp8]" in r for c, r in shown)
    assert any(c == "generate" and "--device" in r for c, r in shown)
