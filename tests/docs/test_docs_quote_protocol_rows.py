"""README.md and docs/*.md cite throughput rows only where they were measured under the benchmark protocol.

The protocol (``bench/harness.Protocol``: warm-up until steady, >= 20 timed steps, >= 3 repeats per side in fresh
processes, interleaved; a ratio with its worst and best pairing) is the only way a speed ratio is measured now. Every
older row is one short pass per side: noise with a number on it. So a citation ``bench/results/<file>.jsonl:<lines>``
(a line, a range ``3-5``, a list ``3,5-6``; a bare ```:N``` code span continues the paragraph's last cited file) that
points at a throughput row must point at a row that carries ``"protocol"`` and is not a ``--quick`` row
(``"measured": "quick: ..."``). A throughput row: ``row`` starts with ``throughput``, or a speed key
(``tokens_per_s``, ``ratio``, ``ratio_to_reference``, ``scaling``, ``speedup_vs_hf``, ``te_vs_sdpa``) sits at the top
level, under ``workbench`` or in a ``rows`` list. Rows that carry a loss curve (``losses``: loss parity runs, whose
tokens/s is a by-product), planner, conversion and probe rows are not throughput rows and may be cited. The older
rows are listed, with their lines, in bench/README.md's "Superseded" table (bench/README.md is not checked here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: keys whose presence makes a row a speed measurement
SPEED_KEYS = ("tokens_per_s", "ratio", "ratio_to_reference", "scaling", "speedup_vs_hf", "te_vs_sdpa")

LINES = r"\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*"
CITATION_RE = re.compile(r"(?<![\w./-])(bench/results/[\w./-]+?\.jsonl)(?::(%s))?" % LINES)
CONTINUATION_RE = re.compile(r"`:(%s)`" % LINES)


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def line_numbers(spec: str) -> list[int]:
    """``"3-5,8"`` -> ``[3, 4, 5, 8]``."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _places(row: dict) -> list[dict]:
    places = [row]
    for key in ("workbench", "rows"):
        value = row.get(key)
        items = value if isinstance(value, list) else [value]
        places.extend(v for v in items if isinstance(v, dict))
    return places


def is_throughput(row: dict) -> bool:
    if str(row.get("row", "")).startswith("throughput"):
        return True
    if "losses" in row:  # a loss run: its tokens/s is not what it is cited for
        return False
    return any(key in place for place in _places(row) for key in SPEED_KEYS)


def is_protocol(row: dict) -> bool:
    measured = row.get("measured")  # planner rows store a number here
    return "protocol" in row and not (isinstance(measured, str) and measured.startswith("quick"))


def citations(doc: Path) -> list[tuple[int, str, str]]:
    """Every ``(doc line, results file, line spec)`` the document cites with lines."""
    found: list[tuple[int, str, str]] = []
    last: str | None = None
    for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            last = None  # a bare `:N` continues only its own paragraph
        events = [(m.start(), m.group(1), m.group(2)) for m in CITATION_RE.finditer(line)]
        events += [(m.start(), None, m.group(1)) for m in CONTINUATION_RE.finditer(line)]
        for _, path, spec in sorted(events, key=lambda e: e[0]):
            if path is not None:
                last = path
            if spec and (path or last):
                found.append((no, path or last, spec))
    return found


def problems(root: Path = ROOT, docs: list[Path] | None = None) -> list[str]:
    """Each citation of a throughput row not measured under the protocol, as ``"DOC:LINE: why"``."""
    out: list[str] = []
    rows_of: dict[str, list[str]] = {}
    for doc in docs if docs is not None else documents(root):
        rel = doc.relative_to(root) if doc.is_relative_to(root) else doc
        for no, path, spec in citations(doc):
            if path not in rows_of:
                f = root / path
                rows_of[path] = f.read_text(encoding="utf-8").splitlines() if f.is_file() else []
            lines = rows_of[path]
            for n in line_numbers(spec):
                if not 1 <= n <= len(lines):
                    out.append(f"{rel}:{no}: {path}:{n} is not a line of the file ({len(lines)} lines)")
                    continue
                try:
                    row = json.loads(lines[n - 1])
                except json.JSONDecodeError:
                    out.append(f"{rel}:{no}: {path}:{n} is not a JSON row")
                    continue
                if isinstance(row, dict) and is_throughput(row) and not is_protocol(row):
                    what = row.get("variant") or row.get("row") or row.get("model") or row.get("bench") or "row"
                    out.append(f"{rel}:{no}: {path}:{n} ({what}) is a throughput row measured in a single pass, "
                               "not under the protocol: quote a protocol row or point to bench/README.md")
    return out


def test_docs_cite_only_protocol_throughput_rows():
    docs = documents()
    assert len(docs) >= 5, [str(d) for d in docs]
    assert sum(len(citations(d)) for d in docs) > 0  # the scan sees citations at all
    assert problems() == []


def _write_rows(root: Path) -> None:
    results = root / "bench" / "results"
    results.mkdir(parents=True)
    protocol = {"name": "harness-v1", "steps": 20, "repeats": 3}
    rows = [
        {"variant": "workbench/llama3.2-1b", "tokens_per_s": 63661.0, "ratio_to_reference": 1.01, "quick": True},  # 1
        {"variant": "workbench/llama3.2-1b", "tokens_per_s": 65408.8, "ratio_to_reference": 1.007,
         "measured": "protocol", "protocol": protocol},  # 2
        {"row": "throughput", "preset": "bert-base", "workbench": {"tokens_per_s": 232540.0}, "ratio": 1.43},  # 3
        {"row": "planner", "preset": "bert-base", "predicted": 3800230692, "measured": 3808456192},  # 4
        {"variant": "workbench/llama3.2-1b", "tokens_per_s": 64000.0, "measured": "quick: one pass",
         "protocol": protocol},  # 5
        {"family": "bert-base", "losses": [10.5, 9.1], "tokens_per_s": 45021.0},  # 6
        {"row": "generate", "rows": [{"batch": 1, "ratio": 21.2, "tokens_equal": True}]},  # 7
        {"row": "throughput", "preset": "t5-base", "workbench": [{"tokens_per_s": 149811.8}], "ratio": 1.24,
         "protocol": protocol},  # 8
    ]
    (results / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_checker_flags_single_pass_rows(tmp_path):
    _write_rows(tmp_path)
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text(
        "Llama 1.01x (`bench/results/train.jsonl:2`), BERT 0.83x (`bench/results/train.jsonl:8`).\n"  # 1: fine
        "Planner (`bench/results/train.jsonl:4`), loss (`bench/results/train.jsonl:6`), `bench/results/train.jsonl`.\n"  # 2: fine
        "\n"
        "Old Llama 1.01x (`bench/results/train.jsonl:1-2`); BERT 1.43x (`bench/results/train.jsonl:3,4`).\n"  # 4: 1, 3
        "T5 generation 21.2x (`bench/results/train.jsonl:7`), quick (`bench/results/train.jsonl:5`),\n"  # 5: 7, 5
        "and the same call's old row (`:1`).\n"  # 6: 1 (continues train.jsonl)
        "\n"
        "`:3` alone after a blank line names no file; `bench/results/train.jsonl:9` is past the end.\n"  # 8: 9
    )
    found = problems(tmp_path, [doc])
    assert [f.split(": ", 1)[0] for f in found] == ["docs/page.md:4", "docs/page.md:4", "docs/page.md:5",
                                                    "docs/page.md:5", "docs/page.md:6", "docs/page.md:8"], found
    joined = "\n".join(found)
    for cited in ("train.jsonl:1 ", "train.jsonl:3 ", "train.jsonl:7 ", "train.jsonl:5 ", "train.jsonl:9 is not a line"):
        assert cited in joined, (cited, joined)
    assert "train.jsonl:2 " not in joined and "train.jsonl:8 " not in joined and "train.jsonl:4 " not in joined


def test_line_specs():
    assert line_numbers("5") == [5]
    assert line_numbers("40-41,43-44") == [40, 41, 43, 44]
    assert line_numbers("90-91,99") == [90, 91, 99]
