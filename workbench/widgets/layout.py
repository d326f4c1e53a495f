"""Label and box sizes for the widgets: a description is never cut ("ipeline parallel",
"make_vocab_size_divisible...") and an input box never overlaps the column next to it."""

from __future__ import annotations

import math
from typing import Iterable

#: width of one character of a widget label (JupyterLab: 13px sans-serif), on the generous side
CHAR_PX = 7.5


def label_px(labels: Iterable[str]) -> int:
    """Pixels that the longest of ``labels`` needs as a widget description."""
    return int(math.ceil(max((len(x) for x in labels), default=0) * CHAR_PX)) + 12


def labelled(W, labels: Iterable[str], input_px: int) -> tuple[dict, "object"]:
    """(style, layout) for widgets described by one of ``labels``: the description column fits the
    longest label and the box keeps its width (no flex shrinking into the next column)."""
    desc = label_px(labels)
    return {"description_width": f"{desc}px"}, W.Layout(width=f"{desc + input_px}px", flex="0 0 auto")
