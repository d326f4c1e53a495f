"""Label and box sizes for the widgets: a description is never cut ("ipeline parallel",
"make_vocab_size_divisible...") and an input box never overlaps the column next to it; columns
of controls keep their width and wrap onto the next line where the output is too narrow, so
nothing is clipped (a column narrower than its boxes scrolls them sideways when one is edited).
Also the small text helpers the widgets share (:func:`plural`) and the note under every interactive widget
(:func:`live_view`, :func:`show_live`)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

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


def column(W, widgets: Sequence[Any]) -> Any:
    """A VBox of controls that never shrinks below its widest control (so never clips or scrolls one)."""
    return W.VBox(list(widgets), layout=W.Layout(flex="0 0 auto", overflow="visible", margin="0 12px 0 0"))


def columns(W, cols: Sequence[Any]) -> Any:
    """An HBox of :func:`column` s that wraps a column onto the next line where the output is narrower."""
    return W.HBox(list(cols), layout=W.Layout(flex_flow="row wrap", overflow="visible"))


#: under every interactive widget: what a saved and reopened notebook shows of it (its widget state, drawn as it was)
LIVE_NOTE = ("Interactive while this notebook's kernel runs. Saved and reopened, this is a snapshot of what it showed: "
             "re-run the cell to make it live again.")


def live_view(W, ui: Any) -> Any:
    """``ui`` with :data:`LIVE_NOTE` below it, small and grey."""
    note = W.HTML(f"<span style='color:#777;font-size:85%'>{LIVE_NOTE}</span>")
    note.add_class("workbench-live-note")
    return W.VBox([ui, note])


def show_live(ui: Any) -> None:
    """Display an interactive widget's ``ui`` with its :func:`live_view` note (each widget's ``_ipython_display_``)."""
    import ipywidgets as W
    from IPython.display import display

    display(live_view(W, ui))


def plural(n: float, one: str, many: str) -> str:
    """``"1 micro-batch"``, ``"4 micro-batches"`` (``n`` printed as given, ``.3g`` for a float)."""
    text = f"{n:.3g}" if isinstance(n, float) else str(n)
    return f"{text} {one if n == 1 else many}"
