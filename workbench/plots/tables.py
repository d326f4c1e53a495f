"""Tables for notebooks: pandas frames and memory plans as compact HTML whose rows never wrap.

JupyterLab lays an output table out with ``table-layout: fixed`` and wraps cell text, and it
wraps printed text at any character: at a normal output width a wide frame splits device names
over lines and cuts its last column, and a printed text table splits its numbers.
:func:`html_table` renders a DataFrame through a pandas ``Styler`` with one line per row (no
wrapping, a compact font, the table as wide as its content, a horizontal scrollbar instead of a
cut where it is wider than the output).  :func:`plan_table` shows a
:class:`workbench.planner.Plan` that way: the per-rank breakdown as a table, the plan's notes
(``format_plan``'s other lines) as prose above and below it.

Both return a :class:`Table`, a ``str`` holding the plain text (``format_plan`` for a plan) that
Jupyter renders as HTML: ``print`` and text exports give the text, a notebook shows the table.

Messages (a config error, a decoded sample) have the same problem as printed text: JupyterLab's output
``pre`` breaks a long line at any character ("di/vides", "for/m").  :func:`text_block` shows text as
preformatted lines that wrap between words at the output's width (a list item's continuation lines
indented under its text); :func:`say` is ``print`` for a notebook that does so.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

__all__ = ["Table", "html_table", "plan_frame", "plan_table", "CELL_CSS", "PRE_CSS", "text_block", "say"]

#: every header and data cell: one line, compact, numbers right-aligned
CELL_CSS = "white-space: nowrap; padding: 2px 5px; font-size: 12px; line-height: 1.35; text-align: right;"
#: a message's lines: JupyterLab's ``.jp-OutputArea-output pre`` sets ``word-break: break-all``; these wrap between
#: words instead (a single word longer than the line, e.g. a path, still breaks rather than overflow)
PRE_CSS = "white-space: pre-wrap; word-break: normal; overflow-wrap: break-word; margin: 0; padding: 0;"
_TABLE_CSS = "table-layout: auto; width: auto; max-width: none; border-collapse: collapse; margin: 2px 0 6px 0;"


class Table(str):
    """Text that Jupyter shows as HTML: ``str()`` / ``print`` give :attr:`text`, ``_repr_html_`` the table."""

    html: str

    def __new__(cls, text: str, html_: str) -> "Table":
        obj = super().__new__(cls, text)
        obj.html = html_
        return obj

    @property
    def text(self) -> str:
        return str.__str__(self)

    def _repr_html_(self) -> str:
        return self.html

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython's text/plain: the text, not a quoted repr
        p.text(self.text)


def _styled_html(df: Any, precision: int, index: bool, cell_styles: Mapping[str, Any] | None = None) -> str:
    sty = df.style.format(precision=precision, na_rep="-")
    if not index:
        sty = sty.hide(axis="index")
    for column, style in (cell_styles or {}).items():
        if column in df.columns:
            sty = sty.map(style, subset=[column])
    sty = sty.set_table_styles([
        {"selector": "", "props": _TABLE_CSS},
        {"selector": "th, td", "props": CELL_CSS},
        {"selector": "th", "props": "font-weight: bold; border-bottom: 1px solid #999;"},
        {"selector": "tbody tr:nth-child(even)", "props": "background: rgba(0, 0, 0, 0.035);"},
    ])
    return f"<div style='overflow-x: auto; max-width: 100%'>{sty.to_html()}</div>"


def html_table(df: Any, *, precision: int = 2, index: bool = False, common: Sequence[str] = (),
               cell_styles: Mapping[str, Any] | None = None) -> Table:
    """A DataFrame as a :class:`Table`: one line per row in a notebook, ``df.to_string()`` as text.

    ``precision``: decimals of float columns; ``index``: show the frame's index; ``common``: columns
    said once above the table (``device: NVIDIA H100 80GB HBM3 · commit: fa77810``) where every row
    holds the same value, instead of repeated on every row; ``cell_styles``: column -> (value -> CSS)
    for cells to highlight.
    """
    same = [c for c in common if c in df.columns and len(df) > 1 and df[c].nunique(dropna=False) == 1]
    note = " \u00b7 ".join(f"{c}: {df[c].iloc[0]}" for c in same)
    shown = df.drop(columns=same)
    text = (f"{note}\n" if note else "") + shown.to_string(index=index)
    head = f"<div style='font-size: 12px; line-height: 1.4; color: #555'>{html.escape(note)}</div>" if note else ""
    return Table(text, head + _styled_html(shown, precision, index, cell_styles))


#: the plan's allocated components, shortened the way ``format_plan`` heads its columns
_SHORT = {"weights": "weights", "gradients": "grads", "master_weights": "master", "optimizer_moments": "adam",
          "activations": "activ", "logits_loss": "logits", "pipeline_buffers": "p2p", "workspace": "work"}


def plan_frame(plan: Any):
    """The per-rank memory of a plan as a DataFrame (GiB): placement, allocated components, device totals, fits."""
    import pandas as pd

    from workbench.planner import COMPONENTS, GiB

    rows = []
    for r in plan.ranks:
        st = plan.stages[r.pp_rank]
        rows.append({"rank": r.rank, "tp": r.tp_rank, "pp": r.pp_rank, "dp": r.dp_rank,
                     **{_SHORT.get(c, c): st.components[c] / GiB for c in COMPONENTS},
                     "alloc": r.peak_allocated / GiB, "reserv": r.peak_reserved / GiB,
                     "+ctx": (r.total - r.peak_reserved) / GiB, "total": r.total / GiB,
                     "fits": "-" if r.fits is None else ("yes" if r.fits else "OOM")})
    return pd.DataFrame(rows)


def _fits_style(value: Any) -> str:
    return "color: #b00000; font-weight: bold" if value == "OOM" else ("color: #2a7a2a" if value == "yes" else "")


def plan_table(plan: Any) -> Table:
    """A memory plan for a notebook: ``format_plan``'s notes as prose around :func:`plan_frame` as an HTML
    table (text: ``format_plan(plan)``, what the CLI prints)."""
    from workbench.planner import format_plan

    text = format_plan(plan)
    lines = text.splitlines()
    # format_plan: notes, the column heads (ending "(GiB)"), one line per rank, notes
    head = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("(GiB)"))
    before, after = lines[:head], lines[head + 1 + len(plan.ranks):]
    table = _styled_html(plan_frame(plan), 2, False, {"fits": _fits_style})

    def prose(ls: list[str]) -> str:
        return "".join(f"<div style='font-size: 12px; line-height: 1.4; margin: 1px 0'>{html.escape(ln.strip())}</div>" for ln in ls)

    caption = "<div style='font-size: 11px; line-height: 1.4; color: #666'>GiB per rank: allocated components at the peak, then allocated, " \
              "reserved, + CUDA context and NCCL, total</div>"
    return Table(text, f"<div class='workbench-plan'>{prose(before)}{caption}{table}{prose(after)}</div>")


def _hanging(line: str) -> int:
    """Characters a wrapped line's continuation is indented by: its own indent, plus a list item's marker."""
    stripped = line.lstrip()
    indent = len(line) - len(stripped)
    return indent + (2 if stripped.startswith(("- ", "* ")) else 0)


def text_block(text: Any) -> Table:
    """``text`` as a :class:`Table`: the text itself for ``print`` and text exports; in a notebook, preformatted
    lines that wrap between words at the output's width, never inside one (see the module docstring)."""
    t = str(text)
    lines = "".join(f"<pre style='{PRE_CSS} padding-left: {k}ch; text-indent: -{k}ch'>{html.escape(ln) or ' '}</pre>"
                    for ln, k in ((ln, _hanging(ln)) for ln in t.split("\n")))
    return Table(t, f"<div class='workbench-text'>{lines}</div>")


def say(*parts: Any, sep: str = " ") -> None:
    """``print(*parts)`` for a notebook: in a kernel the text is displayed as a :func:`text_block` (wrapped between
    words); elsewhere (a script, a terminal) it is printed."""
    text = sep.join(str(p) for p in parts)
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is None or "Terminal" in type(shell).__name__:
        print(text)
        return
    from IPython.display import display

    display(text_block(text))
