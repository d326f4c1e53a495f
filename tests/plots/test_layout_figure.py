"""The layout picture (``workbench.plots.layout``): the ranks where megatron puts them, the sequence where CP puts it."""

from __future__ import annotations

import matplotlib.colors as mcolors
import pytest

from workbench.backend.context_parallel import load_balanced_chunks, shard_positions
from workbench.config import preset
from workbench.layout import Layout
from workbench.plots.layout import PALETTE, layout_figure, sequence_owners


def _cfg(**over):
    return preset("gpt2-medium", **{"parallel.nproc_per_node": 8, **over})


@pytest.mark.parametrize("seq, cp", [(1024, 1), (1024, 2), (96, 3), (4096, 4)])
def test_sequence_owners_tile_the_sequence_as_the_ranks_shard_it(seq, cp):
    owners = sequence_owners(seq, cp)
    assert owners[0][0] == 0 and owners[-1][1] == seq
    assert all(a[1] == b[0] for a, b in zip(owners, owners[1:]))  # contiguous, no gap or overlap
    for r in range(cp):
        mine = [(a, b) for a, b, who in owners if who == r]
        held = [int(p) for p in shard_positions(seq, r, cp)]  # the positions the trainer gives CP rank r
        assert [p for a, b in mine for p in range(a, b)] == sorted(held)
    if cp > 1:
        assert [who for _, _, who in owners] == list(range(cp)) + list(reversed(range(cp)))
        assert {b - a for a, b, _ in owners} == {seq // (2 * cp)}
        assert owners == sorted((a, b, r) for r, pair in enumerate(load_balanced_chunks(seq, cp)) for a, b in pair)


def test_sequence_owners_refuse_a_length_2cp_does_not_divide():
    with pytest.raises(ValueError, match="not divisible by 2 \\* context_parallel = 4"):
        sequence_owners(1026, 2)


def _boxes(fig):
    """(rank number, label, face colour) of each rank box of the figure's grid, read off its texts and patches (each
    keyed by its box: the box's centre x and its row)."""
    top = fig.axes[0]
    key = lambda x, y: (round(x, 2), round(y, 2))  # noqa: E731
    names = {key(t.get_position()[0], t.get_position()[1] - 0.62): t.get_text() for t in top.texts
             if t.get_text().startswith("r") and t.get_text()[1:].isdigit()}
    labels = {key(t.get_position()[0], t.get_position()[1] - 0.32): t.get_text() for t in top.texts
              if t.get_fontsize() == 7}
    faces = {key(p.get_x() + p.get_width() / 2, p.get_y() - 0.1): mcolors.to_hex(p.get_facecolor())
             for p in top.patches if p.get_fill()}
    assert set(names) == set(labels) == set(faces), (names, labels, faces)
    return [(int(names[k][1:]), labels[k], faces[k], k) for k in names]


def _frames(fig):
    """(row, first box x, last box x) of each replica frame (the unfilled rectangles)."""
    return [(round(p.get_y() - 0.04), round(p.get_x() - 0.02), round(p.get_x() - 0.02 + p.get_width() + 0.04) - 1)
            for p in fig.axes[0].patches if not p.get_fill()]


@pytest.mark.parametrize("over", [
    {"parallel.tensor_parallel": 2, "parallel.context_parallel": 2, "parallel.pipeline_parallel": 2},
    {"parallel.tensor_parallel": 2, "parallel.pipeline_parallel": 2},
    {"parallel.context_parallel": 4, "parallel.pipeline_parallel": 2},
])
def test_every_rank_is_drawn_once_with_its_coordinates_and_cp_colour(over):
    cfg = _cfg(**over)
    lay = Layout.of(cfg)
    fig = layout_figure(cfg)
    boxes = _boxes(fig)
    assert sorted(r for r, _, _, _ in boxes) == list(range(lay.world))
    where = {}
    for r, label, face, (x, row) in boxes:
        c = lay.coords(r)
        assert label == lay.rank_label(r, short=True), (r, label)
        assert face == mcolors.to_hex(PALETTE[(c.cp if lay.cp > 1 else c.dp) % len(PALETTE)]), (r, face)
        assert row == lay.pp - 1 - c.pp, (r, row)  # its stage's row, stage 0 on top
        where[(row, int(x - 0.5))] = c
    frames = _frames(fig)
    assert len(frames) == lay.pp * lay.dp
    for row, a, b in frames:  # a frame holds one data-parallel replica of the stage: tp x cp ranks, one dp
        inside = [where[(row, x)] for x in range(a, b + 1)]
        assert len(inside) == lay.tp * lay.cp and len({c.dp for c in inside}) == 1, (row, a, b, inside)
    seq = fig.axes[1]
    chunks = sorted((round(p.get_x()), round(p.get_x() + p.get_width()), mcolors.to_hex(p.get_facecolor())) for p in seq.patches)
    want = [(a, b, mcolors.to_hex(PALETTE[r])) for a, b, r in sequence_owners(cfg.model.seq_length, lay.cp)]
    assert chunks == want
    assert (f"CP rank r holds chunks r and {2 * lay.cp - 1}-r" in seq.get_title()) == (lay.cp > 1), seq.get_title()


def test_a_large_world_shows_one_replica_of_each_stage():
    cfg = preset("gpt2-medium", **{"parallel.nproc_per_node": 8, "parallel.nnodes": 16, "parallel.tensor_parallel": 8,
                                   "parallel.pipeline_parallel": 2})
    lay = Layout.of(cfg)
    assert lay.world == 128
    fig = layout_figure(cfg)
    ranks = sorted(r for r, _, _, _ in _boxes(fig))
    assert ranks == list(range(8)) + list(range(64, 72))  # the first replica (tp 8) of stage 0 and of stage 1
    assert "one replica of each stage shown (64 ranks a stage)" in fig.axes[0].get_title()


def test_a_world_that_does_not_split_is_refused_with_the_rule():
    with pytest.raises(ValueError, match="tp\\*cp\\*pp = 4"):
        layout_figure(_cfg(**{"parallel.nproc_per_node": 6, "parallel.context_parallel": 2, "parallel.pipeline_parallel": 2}))
