"""The docs name only things that exist: every repository path, ``workbench.*`` module and ``workbench`` command.

Scans README.md, ARCHITECTURE.md, docs/*.md and bench/README.md for
- repository paths (``workbench/...``, ``bench/...``, ``tests/...``, ``evidence/...``, ``notebooks/...``,
  ``launch/...``, ``docs/...``, ``tools/...``; ``<family>``-style placeholders and ``*`` match any one name, a ``:LINE`` suffix
  must lie within the file),
- relative Markdown links (``[text](path)``, resolved from the document's folder),
- dotted module names (``workbench.launch.torchrun``, ``workbench.kernel_rule.choose``): the longest prefix must
  be a module or package of the repository, and a name after it must occur in that module's source,
- ``workbench COMMAND`` in code (a fenced block or an inline code span): COMMAND must be a sub-command some ``add_parser("COMMAND", ...)`` registers.
A path that does not exist, a module that was renamed or a command that is gone fails the test with the document
and the line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "ARCHITECTURE.md", "bench/README.md")
PREFIXES = ("workbench", "bench", "tests", "evidence", "notebooks", "launch", "docs", "tools")

PATH_RE = re.compile(r"(?<![\w./$~-])((?:%s)/[\w./<>*-]*)((?::\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*)?)" % "|".join(PREFIXES))
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
MODULE_RE = re.compile(r"(?<![\w./-])(workbench(?:\.\w+)+)")
FILE_SUFFIXES = ("json", "jsonl", "yaml", "yml", "md", "log")
CODE_SPAN_RE = re.compile(r"`([^`]+)`")
COMMAND_RE = re.compile(r"^\s*(?:\$ )?workbench ([a-z][a-z-]*)")


#: Paths the docs name before they exist: what a GPU script writes once it has run on the device.
NOT_YET = {
    "evidence/advisor/": "tests/gpu_proofs/advisor_measure.py writes it (docs/advisor.md)",
    "bench/results/overlap_probe.jsonl": "bench/overlap_probe.py writes it on two GPUs (bench/README.md)",
}


def _preset_names() -> frozenset[str]:
    """Benchmark rows are named ``VARIANT/PRESET`` (``workbench/gpt2-large``): not paths."""
    from workbench.families import FAMILIES

    return frozenset(name for family in FAMILIES.values() for name in family.presets)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / d for d in DOCS if (root / d).exists()] + sorted((root / "docs").glob("*.md"))


def _path_problem(root: Path, token: str, lines: str, presets: frozenset[str]) -> str | None:
    """Why ``token`` (with an optional ``:LINE[-LINE][,...]`` suffix in ``lines``) names nothing (None: it exists)."""
    token = token.rstrip(".,;:)")
    if not token or token in NOT_YET or token.split("/", 1)[1] in presets:
        return None
    pattern = re.sub(r"<[^>/]*>", "*", token.rstrip("/"))
    if "*" in pattern:
        return None if any(root.glob(pattern)) else f"path {token} does not exist"
    path = root / pattern
    if not path.exists():
        return f"path {token} does not exist"
    if lines:
        last = max(int(n) for n in re.findall(r"\d+", lines))
        have = len(path.read_text(encoding="utf-8", errors="replace").splitlines())
        if last > have:
            return f"{token}{lines}: the file has {have} lines"
    return None


def _module_problem(root: Path, dotted: str) -> str | None:
    parts = dotted.rstrip(".").split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            if n == 1 and len(parts) > 1:
                return f"{dotted}: no module {'.'.join(parts[:2])}"
            rest = parts[n:]
            if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text(encoding="utf-8")):
                return f"{dotted}: {rest[0]!r} is not in {source.relative_to(root)}"
            return None
    return f"{dotted}: no such module"


def _commands(root: Path) -> set[str]:
    names: set[str] = set()
    for f in (root / "workbench").rglob("*.py"):
        names.update(re.findall(r"add_parser\(\s*\"([a-z][a-z-]*)\"", f.read_text(encoding="utf-8")))
    return names


def problems(root: Path = ROOT, docs: list[Path] | None = None, presets: frozenset[str] | None = None) -> list[str]:
    """Every broken path, link, module and command in ``docs`` (default: the repository's docs), as
    ``"FILE:LINE: what"``."""
    found: list[str] = []
    presets = _preset_names() if presets is None else presets
    commands = _commands(root)
    for doc in docs if docs is not None else documents(root):
        rel = doc.relative_to(root)
        fenced = False
        for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            for token, lines in PATH_RE.findall(line):
                why = _path_problem(root, token, lines, presets)
                if why:
                    found.append(f"{rel}:{no}: {why}")
            for target in LINK_RE.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue
                path = target.split("#", 1)[0]
                if path and not (doc.parent / path).exists():
                    found.append(f"{rel}:{no}: link {target} does not exist")
            for dotted in MODULE_RE.findall(line):
                if dotted.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # a file name (``workbench.json``), not a module
                    continue
                why = _module_problem(root, dotted)
                if why:
                    found.append(f"{rel}:{no}: module {why}")
            code = [line] if fenced else CODE_SPAN_RE.findall(line)
            for cmd in (c for span in code for c in COMMAND_RE.findall(span)):
                if cmd not in commands:
                    found.append(f"{rel}:{no}: command `workbench {cmd}` is not a sub-command")
    return found


def test_docs_name_only_what_exists():
    docs = documents()
    assert len(docs) >= 4, [str(d) for d in docs]
    assert problems() == []


def test_checker_reports_what_is_broken(tmp_path):
    (tmp_path / "workbench" / "launch").mkdir(parents=True)
    (tmp_path / "workbench" / "__init__.py").write_text("")
    (tmp_path / "workbench" / "launch" / "__init__.py").write_text("from .handle import Run\n")
    (tmp_path / "workbench" / "cli.py").write_text('sub.add_parser("launch")\n')
    (tmp_path / "workbench" / "models" / "gpt").mkdir(parents=True)
    (tmp_path / "workbench" / "models" / "gpt" / "shapes.py").write_text("")
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"
    doc.write_text(
        "`workbench/launch/` and `workbench/models/<family>/shapes.py` exist, [self](page.md).\n"
        "`workbench.launch.Run` and `workbench launch CFG` too.\n"
        "`workbench/launch/gone.py`, `bench/results/none.jsonl:3`, [x](../nowhere.md), `docs/page.md:1-12`\n"
        "`workbench.bridge.Run`, `workbench.launch.Missing`, `workbench runs`; workbench uses prose\n"
        "`workbench/models/<family>/step.py`; rows `workbench/gpt2-large`, `workbench/gpt2-huge`\n"
        "```\nworkbench launch cfg.yaml\nworkbench lanch cfg.yaml\n```\n"
    )
    found = problems(tmp_path, [doc], presets=frozenset({"gpt2-large"}))
    assert [f.split(": ", 1)[0] for f in found] == ["docs/page.md:3"] * 4 + ["docs/page.md:4"] * 3 + ["docs/page.md:5"] * 2 + ["docs/page.md:8"]
    joined = "\n".join(found)
    for name in ("workbench/launch/gone.py", "bench/results/none.jsonl", "../nowhere.md", "workbench.bridge",
                 "'Missing'", "`workbench runs`", "workbench/models/<family>/step.py",
                 "workbench/gpt2-huge", "`workbench lanch`", "docs/page.md:1-12: the file has 9 lines"):
        assert name in joined, (name, joined)


@pytest.mark.parametrize("doc", ["README.md"])
def test_readme_stays_short(doc):
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"{doc}: {len(lines)} lines (at most 250; reference material belongs in docs/)"
    long_cells = [(i, len(cell.strip())) for i, line in enumerate(lines, 1) if line.startswith("|")
                  for cell in re.split(r"(?<!\\)\|", line) if len(cell.strip()) > 220]
    assert not long_cells, f"{doc}: table cells over 220 characters (line, length): {long_cells}"
