"""A widget's chart in an ``ipywidgets.Output``, set as the widget's state.

Why not ``with out: display(fig)``: that output is captured by the browser (the Output widget
routes the kernel's display message to itself by message id) and the browser then sends the
captured outputs back to the kernel.  When two controls change within a fraction of a second
that echo arrives after the kernel has already moved on: a refused layout cleared the chart, then
the echo of the previous layout's chart put it back under the refusal.  Setting ``out.outputs``
from the kernel is one state update, applied in order, that the browser never sends back: the
newest update is what stays.
"""

from __future__ import annotations

import base64
from typing import Any

__all__ = ["figure_output", "show_figure", "clear_figure"]


def figure_output(fig: Any) -> dict:
    """A Jupyter ``display_data`` output of a matplotlib Figure: what IPython would display for it
    (PNG through the kernel's formatter, so notebooks look the same), base64 for the widget's JSON."""
    data: dict[str, Any] = {}
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            data, _meta = ip.display_formatter.format(fig, include=("image/png", "text/plain"))
    except ImportError:
        pass
    if "image/png" not in data:
        import io

        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight", dpi=90)
        data = {"image/png": buf.getvalue(), "text/plain": repr(fig)}
    png = data["image/png"]
    if isinstance(png, bytes):
        png = base64.b64encode(png).decode("ascii")
    return {"output_type": "display_data", "data": {"image/png": png, "text/plain": str(data.get("text/plain", repr(fig)))},
            "metadata": {}}


def show_figure(out: Any, fig: Any) -> None:
    """Make ``fig`` the one output of ``out`` (replacing whatever was there, in one update)."""
    out.outputs = (figure_output(fig),)


def clear_figure(out: Any) -> None:
    """Remove the chart from ``out`` at once."""
    out.outputs = ()
