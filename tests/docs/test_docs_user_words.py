"""README.md and docs/*.md speak to a user, not in the workshop's own words.

The words of the machinery that measured the numbers ("device call", ``$OUT``, "carry the wheel", a machine kind such
as ``nvidia-h100-x2``, ``../shared/`` paths outside the repository, "phase b" of a proof script, "strengthened
reference") mean nothing to someone who cloned the repository: the docs say "one two-GPU run", name the proof
script, write results to a folder the reader picks.

Row citations, one rule: README.md links to a results file without line numbers (``bench/results/x.jsonl``, no
``:123``) and names no commit hashes in its prose -- it is the first page a newcomer reads, and a line number or a
hash there is a pointer into the workshop's bookkeeping.  docs/*.md (performance.md above all) may cite a row as
``bench/results/<file>.jsonl:<line>``: that is the form ``tests/docs/test_docs_quote_protocol_rows.py`` resolves and
holds to protocol rows, so a line there is checked evidence, not bookkeeping.  bench/README.md is the benchmark's own
log and is not checked here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: (pattern, what to write instead): the workshop's words, anywhere in README.md or docs/*.md
WORKSHOP_WORDS = (
    (r"device calls?\b", "say what ran: 'one two-GPU run', 'on two H100s'"),
    (r"\$OUT\b", "a folder the reader picks, e.g. --out results/"),
    (r"carry the wheel", "say what to install where"),
    (r"\bnvidia-h\d00(?:-x\d)?\b", "name the GPUs: '2x H100'"),
    (r"\.\./shared/", "a path inside the repository, or describe the check"),
    (r"\bphase b\b", "name what it checks (the two-GPU conversion and planner checks of the proof script)"),
    (r"strengthened reference", "name the reference (e.g. the plain compiled Llama, bench/reference_llama.py)"),
)
#: README.md only: a JSON-lines file with a line number (``train_throughput.jsonl:123``, ``x.jsonl:3-5``)
JSONL_LINE_RE = re.compile(r"\b[\w./-]+\.jsonl:\d+")
#: README.md only: a commit-hash-looking token in prose (7-40 hex digits with both a digit and a letter)
HASH_RE = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/.-])")


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((no, line))
    return out


def problems(root: Path = ROOT, docs: list[Path] | None = None) -> list[str]:
    out = []
    for doc in docs if docs is not None else documents(root):
        rel = doc.relative_to(root)
        text = doc.read_text(encoding="utf-8")
        for no, line in enumerate(text.splitlines(), 1):
            for pattern, fix in WORKSHOP_WORDS:
                for m in re.finditer(pattern, line, re.I):
                    out.append(f"{rel}:{no}: {m.group(0)!r} is the workshop's word -> {fix}")
        if doc.name == "README.md" and doc.parent == root:
            for no, line in enumerate(text.splitlines(), 1):
                for m in JSONL_LINE_RE.finditer(line):
                    out.append(f"{rel}:{no}: {m.group(0)!r}: link the results file without a line number")
            for no, line in prose_lines(text):
                for m in HASH_RE.finditer(line):
                    out.append(f"{rel}:{no}: {m.group(0)!r} looks like a commit hash: the rows record their commit")
    return out


def test_readme_and_docs_use_the_users_words():
    assert len(documents()) >= 10
    assert problems() == []


@pytest.mark.parametrize("line, flagged", [
    ("Predicted vs measured (one device call)", "device call"),
    ("python3 x.py --out $OUT/advisor", "$OUT"),
    ("then carry the wheel to the GPU machine", "carry the wheel"),
    ("run it on nvidia-h100-x2", "nvidia-h100-x2"),
    ("a kind such as NVIDIA-H200 does", "NVIDIA-H200"),
    ("The structure check (`../shared/checks/structure.sh`)", "../shared/"),
    ("part of two_gpu_proof.py phase b, not yet run", "phase b"),
    ("Phase B (two-GPU checkpoints)", "Phase B"),
    ("vs the strengthened reference", "strengthened reference"),
])
def test_each_workshop_word_is_flagged(tmp_path, line, flagged):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# ok\n")
    (tmp_path / "docs" / "page.md").write_text(f"fine words\n{line}\n")
    found = problems(tmp_path)
    assert len(found) == 1 and found[0].startswith("docs/page.md:2:") and repr(flagged) in found[0], found


def test_readme_line_references_and_hashes_are_flagged_but_docs_rows_are_not(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "ok: [rows](bench/results/train_throughput.jsonl), 65.4k tokens/s, 1.01x, H100, 2026-11-28\n"
        "| Llama | 1.01x | `bench/results/train_throughput.jsonl:175-176` |\n"
        "Two GPUs (2x H100, 6baf497): within 2%\n"
        "```\n"
        "abc1234 in a code block is output, not prose\n"
        "```\n")
    (tmp_path / "docs" / "performance.md").write_text("1.01x (`bench/results/train_throughput.jsonl:176`), 6baf497\n")
    found = problems(tmp_path)
    assert [f.split(": ", 1)[0] for f in found] == ["README.md:2", "README.md:3"], found
    assert "train_throughput.jsonl:175" in found[0] and "'6baf497' looks like a commit hash" in found[1]


def test_one_term_for_cpu_mode():
    """Training on CPU under gloo is "CPU mode" everywhere a user reads it: the docs and the messages and docstrings
    of the package (validation refusals, notebook notes), never "CPU emulation"."""
    places = documents() + [ROOT / "ARCHITECTURE.md"] + sorted((ROOT / "workbench").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{no}" for p in places
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bCPU emulation\b|\bgloo emulation\b", line, re.I)]
    assert found == [], f"say 'CPU mode': {found}"
    assert "CPU mode" in (ROOT / "README.md").read_text(encoding="utf-8")
