"""Gantt block labels: readable where a notebook shows them, inside their blocks, and an interleaved block names its chunk."""

from __future__ import annotations

import io

import pytest

from workbench.plots.schedule import block_label, compare, gantt
from workbench.schedules import simulate

OUTPUT_WIDTH_PX = 1050  # a notebook's output area at a common window width


def _rendered(fig):
    """(renderer, displayed scale): the figure drawn as a notebook saves it (tight PNG at its dpi), and
    how much the notebook shrinks that PNG to fit the output width."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    width = Image.open(io.BytesIO(buf.getvalue())).size[0]
    return fig.canvas.get_renderer(), min(1.0, OUTPUT_WIDTH_PX / width)


def _labels(ax):
    return [t for t in ax.texts if t.get_text()]


@pytest.mark.parametrize("shared_axis", [True, False])
def test_interleaved_blocks_name_pass_microbatch_and_chunk_readably(shared_axis):
    tls = [simulate("gpipe", 4, 8), simulate("1f1b", 4, 8), simulate("interleaved", 4, 8, 2)]
    fig = compare(tls) if shared_axis else gantt(tls[2])
    renderer, scale = _rendered(fig)
    ax = fig.axes[-1]
    ops = [o for r in range(4) for o in tls[2].ops[r]]
    texts = _labels(ax)
    assert len(texts) == len(ops), (len(texts), len(ops))  # every block, forwards included
    for t in texts:
        kind_mb, chunk = t.get_text().replace("\n", " ").split(" ")
        assert kind_mb[0] in "FB" and kind_mb[1:].isdigit() and chunk in ("c0", "c1"), t.get_text()
        # at least ~10 px tall on screen: the font size in pixels after the notebook shrinks the PNG
        assert t.get_fontsize() * fig.dpi / 72 * scale >= 10.0, (t.get_text(), t.get_fontsize(), scale)
    forwards = [t.get_text() for t in texts if t.get_text().startswith("F")]
    assert {f.split()[-1] for f in (x.replace("\n", " ") for x in forwards)} == {"c0", "c1"}
    # every label lies inside its block
    for t in texts:
        box = t.get_window_extent(renderer)
        x, y = t.get_position()
        op = min(ops, key=lambda o: abs(o.start + o.duration / 2 - x))
        left, right = ax.transData.transform([(op.start, y), (op.start + op.duration, y)])[:, 0]
        assert left - 0.5 <= box.x0 and box.x1 <= right + 0.5, (t.get_text(), box, left, right)


def test_a_block_too_small_for_any_readable_label_has_none():
    assert block_label("F", 3, 1, 2, width_pt=6.0, height_pt=40.0) is None
    assert block_label("F", 3, 0, 1, width_pt=30.0, height_pt=30.0) == ("F3", 10.0)
    text, size = block_label("F", 3, 1, 2, width_pt=13.0, height_pt=30.0)
    assert text == "F3\nc1" and size >= 8.5
