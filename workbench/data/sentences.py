"""Deterministic sentence splitting for sentence-split datasets (Megatron-LM's ``--split-sentences``).

BERT's datasets read one sequence per sentence (the binary head pairs sentence spans A / B).
Megatron-LM splits with NLTK's punkt model, which is a download; this splitter is a fixed rule
instead, so the same text always gives the same sentences on any machine, offline:

1. every non-empty line is a unit (line breaks end sentences: verse, list item, heading);
2. inside a line, a sentence ends at ``.``, ``!`` or ``?`` (optionally followed by closing quotes or
   brackets) followed by whitespace and then an upper-case letter, a digit or an opening quote/bracket;
3. a few abbreviations (``Mr.``, ``Dr.``, ``e.g.``, single capitals such as ``J.``) do not end a sentence.
"""

from __future__ import annotations

import re

__all__ = ["split_sentences"]

_BOUNDARY = re.compile(r"""(?<=[.!?])["'\u2019\u201d)\]]*\s+(?=["'\u2018\u201c(\[]?[A-Z0-9])""")
_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|vs|etc|e\.g|i\.e|cf|No|Vol|Fig)|\b[A-Z])\.$")


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text`` (stripped, never empty), in order."""
    out: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        start = 0
        for m in _BOUNDARY.finditer(line):
            piece = line[start:m.start()].rstrip()
            if _ABBREV.search(line[start:m.start()].split()[-1] if line[start:m.start()].split() else ""):
                continue
            if piece:
                out.append(line[start:m.end()].strip())
                start = m.end()
        rest = line[start:].strip()
        if rest:
            out.append(rest)
    return out
