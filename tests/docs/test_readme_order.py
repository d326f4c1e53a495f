"""README.md reads in a newcomer's order: what it is, the two commands, the tour, the first multi-GPU run, then
where to read on; the long reliability and security promises live in docs/reliability.md (linked from the README
and from docs/index.md), not between the first run and the links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def headings() -> list[str]:
    return re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M)


def test_the_first_sections_are_set_up_tour_first_run_then_links():
    assert headings()[:4] == ["Set-up: the two commands", "A ten-line tour", "A first multi-GPU run", "Where to read on"]
    intro = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## ", 1)[0]
    assert "megatron-core" in intro and len(intro.split()) < 200, "the opening says what it is, briefly"


def test_reliability_lives_in_docs_and_is_linked():
    assert not any("reliability" in h.lower() for h in headings()), headings()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/reliability.md)" in readme.split("## Where to read on", 1)[1].split("\n## ", 1)[0]
    assert "(reliability.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    doc = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    for promise in ("**Checkpoints are data.**", "**Processes and network.**", "**Configs.**"):
        assert promise in doc, promise
