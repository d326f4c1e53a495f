"""The router records of the run contract: written by an ``EventWriter``, read by ``RunReader.router()``, damaged
lines refused, the load numbers derived from them, and the router dashboard drawn from them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workbench.plots.router import load_table, router_figure
from workbench.run.events import KINDS, EventWriter, Router, parse_line
from workbench.run.reader import RunReader


def _write(run_dir, steps=(2, 4, 6), dropped=0):
    with EventWriter(run_dir, 0) as w:
        for it in steps:
            w.write(Router(iteration=it, layers=[0, 2], tokens_per_expert=[[10 * it, 10, 10, 10], [40, 0, 0, 0]],
                           assignments=[10 * it + 30 + dropped, 40], dropped=[dropped, 0],
                           load_balancing_loss=[1.0 + it / 10, 1.5], z_loss=[0.5, 0.25]))


def test_router_records_round_trip_through_the_reader(tmp_path):
    assert "router" in KINDS
    _write(tmp_path, steps=(4, 2))
    recs = RunReader(tmp_path).router()
    assert [r.iteration for r in recs] == [2, 4]  # step order, whatever the write order
    r = recs[0]
    assert isinstance(r, Router) and r.layers == [0, 2] and r.layer(2) == [40, 0, 0, 0]
    assert r.load_balancing_loss == [1.2, 1.5] and r.z_loss == [0.5, 0.25]


def test_a_damaged_router_line_is_refused():
    good = {"event": "router", "time": 1.0, "rank": 0, "iteration": 1, "layers": [0], "tokens_per_expert": [[1, 2]],
            "assignments": [3], "dropped": [0]}
    assert isinstance(parse_line(json.dumps(good)), Router)
    assert parse_line(json.dumps({**good, "tokens_per_expert": "lots"})) is None
    assert parse_line(json.dumps({**good, "iteration": "one"})) is None


def test_coefficient_of_variation_and_load_table(tmp_path):
    _write(tmp_path, steps=(2,), dropped=5)
    r = RunReader(tmp_path).router()[0]
    cv = r.coefficient_of_variation()
    assert cv[0] == pytest.approx(np.std([20, 10, 10, 10]) / np.mean([20, 10, 10, 10]))
    assert cv[1] == pytest.approx(np.sqrt(3))  # all tokens on one of four experts
    rows = load_table(tmp_path)
    assert [(x["layer"], x["dropped"]) for x in rows] == [(0, 5), (2, 0)]
    assert rows[1]["max_over_mean"] == pytest.approx(4.0) and rows[0]["load_balancing_loss"] == pytest.approx(1.2)


def test_router_figure_draws_the_layers_token_shares(tmp_path):
    _write(tmp_path)
    fig = router_figure(tmp_path, layer=0)
    heat = fig.axes[0]
    img = heat.images[0].get_array()
    assert img.shape == (4, 3)  # experts x sampled steps
    assert img[:, 0].tolist() == pytest.approx([20 / 50, 10 / 50, 10 / 50, 10 / 50])
    assert img[:, 2].tolist() == pytest.approx([60 / 90, 10 / 90, 10 / 90, 10 / 90])
    titles = [ax.get_title() for ax in fig.axes]
    assert any("router losses" in t for t in titles) and any("coefficient of variation" in t for t in titles)
    loss_ax = next(ax for ax in fig.axes if "router losses" in ax.get_title())
    lb_mean = [ln for ln in loss_ax.lines if "load balancing" in (ln.get_label() or "")][0]
    assert list(lb_mean.get_ydata()) == pytest.approx([(1.2 + 1.5) / 2, (1.4 + 1.5) / 2, (1.6 + 1.5) / 2])
    with pytest.raises(ValueError, match="not an MoE layer"):
        router_figure(tmp_path, layer=1)


def test_router_figure_without_records_says_so(tmp_path):
    fig = router_figure(tmp_path)
    assert any("no router records" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_the_dashboards_static_view_adds_the_router_panel_only_for_moe_runs(tmp_path):
    from workbench.widgets.dashboard import _router_png

    class _Run:
        def __init__(self, d):
            self.reader = RunReader(d)
            self.reader.poll()

    (tmp_path / "dense").mkdir()
    assert _router_png(_Run(tmp_path / "dense")) is None
    _write(tmp_path / "moe")
    png = _router_png(_Run(tmp_path / "moe"))
    assert png and png[:4] == b"\x89PNG"


def _records(rows_by_step):
    """Router records of one MoE layer (index 1) with 4 experts: {iteration: tokens per expert}."""
    return [Router(iteration=it, layers=[1], tokens_per_expert=[row], assignments=[sum(row)], dropped=[0])
            for it, row in rows_by_step.items()]


def test_collapse_flags_name_starved_and_flooded_experts_only_when_it_lasts():
    """An expert under 10% of its balanced share (1/E), or at 2x it, for the last 3 sampled steps in a row is
    flagged with the step the run of records began; one step over a bound (noise) or a recovered expert is not."""
    from workbench.plots.router import collapse_flags, flags_text

    balanced = [100, 100, 100, 100]
    collapsed = [260, 125, 10, 5]  # expert 0 at 2.6x its share; experts 2 and 3 at 0.1x and 0.05x
    flags = collapse_flags(_records({10: balanced, 20: collapsed, 30: collapsed, 40: collapsed}))
    got = {(f["expert"], f["kind"]): f for f in flags}
    assert set(got) == {(0, "flooded"), (3, "starved")}  # expert 2 sits exactly at 10%: not under it
    assert got[(0, "flooded")]["since"] == 20 and got[(0, "flooded")]["share_over_balanced"] == pytest.approx(2.6)
    assert got[(3, "starved")]["share_over_balanced"] == pytest.approx(0.05) and got[(0, "flooded")]["layer"] == 1
    assert "layer 1 expert 3 starved" in flags_text(flags)
    assert collapse_flags(_records({10: collapsed, 20: collapsed, 30: balanced})) == []  # recovered
    assert collapse_flags(_records({10: balanced, 20: balanced, 30: collapsed})) == []  # one step: noise
    assert collapse_flags(_records({20: collapsed, 30: collapsed})) == []  # fewer records than the window
    assert collapse_flags(_records({n: balanced for n in (1, 2, 3, 4)})) == [] and flags_text([]) == ""


def test_the_router_figure_titles_a_collapse():
    from workbench.plots.router import router_figure

    collapsed = [370, 10, 10, 10]
    fig = router_figure(_records({10: collapsed, 20: collapsed, 30: collapsed}))
    assert fig._suptitle is not None and "expert 0 flooded" in fig._suptitle.get_text()
    assert router_figure(_records({10: [100] * 4, 20: [100] * 4, 30: [100] * 4}))._suptitle is None
