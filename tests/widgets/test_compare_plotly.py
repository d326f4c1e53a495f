"""The run overlay as a plotly figure (workbench/plots/compare_plotly.py, issue #55): one line per selected run named
after it, the comparison's own numbers, a log y axis when chosen, the marked step, and the bundle carrying both the
plotly JSON and the PNG (named ``compare``); the run browser's live output: plotly's JSON alone."""

from __future__ import annotations

import base64
import os

import pytest

from tests.support.event_runs import T0, config, write_run
from workbench.plots.compare_plotly import plotly_figure


PLOTLY = "application/vnd.plotly.v1+json"


@pytest.fixture
def two_runs(tmp_path):
    root = tmp_path / "runs"
    a = write_run(root / "a", [{"iteration": i, "time": T0 + i, "loss": 8.0 - i, "grad_norm": 2.0 / i}
                               for i in range(1, 7)], cfg=config(train_iters=6))
    b = write_run(root / "b", [{"iteration": i, "time": T0 + 50 + i, "loss": 9.0 - 0.5 * i} for i in (2, 4, 6)],
                  cfg=config(train_iters=6))
    os.utime(a / "config.json", (T0, T0))
    os.utime(b / "config.json", (T0 + 50, T0 + 50))
    return root, a, b


def _lines(fig) -> list:
    """The traces shown in the legend: one per run."""
    return [t for t in fig.data if t.showlegend is not False]


def test_one_line_per_run_with_the_comparisons_values(two_runs):
    from workbench.plots.compare import compare_runs

    _root, a, b = two_runs
    comp = compare_runs([a, b], "loss", smoothing=0.6, at_step=4)
    fig = plotly_figure(comp)
    lines = _lines(fig)
    assert [t.name for t in lines] == ["a", "b"]
    for t, c in zip(lines, comp.curves):
        assert list(t.x) == c.x and list(t.y) == pytest.approx(c.smoothed)  # smoothed: the line
        assert [row[0] for row in t.customdata] == pytest.approx(c.y)  # the raw values, in the hover
    raw = [t for t in fig.data if t.showlegend is False]
    assert [t.legendgroup for t in raw] == ["a", "b"]  # the raw curves, faint, in each run's group
    assert all(list(t.y) == pytest.approx(c.y) and t.opacity < 1 for t, c in zip(raw, comp.curves))
    assert fig.layout.hovermode == "x unified" and fig.layout.yaxis.type == "linear"
    assert [s.x0 for s in fig.layout.shapes] == [4.0]  # the marked step
    assert fig.layout.xaxis.title.text == "step" and fig.layout.yaxis.title.text == "train loss"


def test_unsmoothed_log_scale_and_a_run_lacking_the_metric(two_runs):
    from workbench.plots.compare import compare_runs

    _root, a, b = two_runs
    comp = compare_runs([a, b], "grad_norm", smoothing=0.0, log_y=True)
    fig = plotly_figure(comp)
    assert [t.name for t in fig.data] == ["a"] and comp.lacking == ["b"]  # no raw trace when not smoothed
    assert list(fig.data[0].y) == pytest.approx(comp.curves[0].y)
    assert fig.layout.yaxis.type == "log"
    assert any("not recorded by: b" in (n.text or "") for n in fig.layout.annotations)
    assert plotly_figure(compare_runs([a], "loss", log_y=False)).layout.yaxis.type == "linear"


def test_the_bundle_carries_plotly_and_the_named_png(two_runs):
    from workbench.plots.compare import compare_runs
    from workbench.plots.compare_plotly import figure_bundle

    _root, a, b = two_runs
    comp = compare_runs([a, b], "loss", x="wall time")
    out = figure_bundle(comp, "compare")
    data = out["data"]
    assert set(data) == {PLOTLY, "image/png", "text/plain"}
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG")
    assert [t["name"] for t in data[PLOTLY]["data"] if t.get("showlegend") is not False] == ["a", "b"]
    assert out["metadata"]["image/png"]["workbench_figure"] == "compare"
    import json

    json.dumps(out)  # a widget output: plain JSON
    assert "image/png" not in figure_bundle(comp, "compare", with_png=False)["data"]


def test_the_browser_shows_plotly_live_and_the_png_headless(two_runs, monkeypatch):
    import workbench.widgets.dashboard as dashboard
    from workbench.widgets.runs import FIGURE_NAME, RunBrowser

    root, _a, _b = two_runs
    w = RunBrowser(root, show=True)  # headless (no kernel): the PNG alone, as before
    assert set(w.out.outputs[0]["data"]) == {"image/png", "text/plain"}
    monkeypatch.setattr(dashboard, "is_headless", lambda: False)
    w.set(metric="loss", log_y=True)
    (out,) = w.out.outputs
    assert PLOTLY in out["data"] and "image/png" not in out["data"]  # plotly's renderer draws it at once
    assert out["data"][PLOTLY]["layout"]["yaxis"]["type"] == "log"
    assert out["metadata"]["image/png"]["workbench_figure"] == FIGURE_NAME
