"""Every interactive widget displays, below it, the note that a saved notebook shows a snapshot of it, live again after
re-running its cell (issue #55); the browser test of reopened notebooks finds the note on the reopened page."""

from __future__ import annotations

import pytest

from workbench.config import preset


def _displayed(monkeypatch, obj) -> list:
    import IPython.display

    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **_k: shown.extend(objs))
    obj._ipython_display_()
    return shown


def _widgets(tmp_path):
    from workbench.widgets.advisor import AdvisorWidget
    from workbench.widgets.config_form import ConfigForm
    from workbench.widgets.planner import MemoryPlanner
    from workbench.widgets.runs import RunBrowser
    from workbench.widgets.schedule import ScheduleExplorer

    form = ConfigForm(preset("tiny"))
    return {
        "form": (form, form.widget),
        "planner": (p := MemoryPlanner(preset("tiny"), show=False), p.ui),
        "schedule": (s := ScheduleExplorer(p=2, m=4, v=1, schedule="1f1b", compare=False), s.ui),
        "advisor": (a := AdvisorWidget(preset("gpt2-medium"), gpus=2, top=2), a.widget),
        "runs": (r := RunBrowser(tmp_path, show=False), r.ui),
    }


def test_every_interactive_widget_says_a_saved_notebook_shows_a_snapshot(monkeypatch, tmp_path):
    from workbench.widgets import dashboard
    from workbench.widgets.layout import LIVE_NOTE

    monkeypatch.setattr(dashboard, "is_headless", lambda: False)  # a browser's kernel: the run browser's controls
    for name, (obj, ui) in _widgets(tmp_path).items():
        shown = _displayed(monkeypatch, obj)
        assert len(shown) == 1, (name, shown)
        box = shown[0]
        assert box.children[0] is ui, name  # the widget itself, unchanged, with the note under it
        note = box.children[-1]
        assert LIVE_NOTE in note.value and "workbench-live-note" in note._dom_classes, name


def test_headless_run_browser_shows_its_static_outputs_without_the_note(monkeypatch, tmp_path):
    from workbench.widgets import dashboard
    from workbench.widgets.layout import LIVE_NOTE
    from workbench.widgets.runs import RunBrowser

    monkeypatch.setattr(dashboard, "is_headless", lambda: True)  # papermill: no widget state saved, static outputs
    shown = _displayed(monkeypatch, RunBrowser(tmp_path, show=False))
    assert shown and not any(LIVE_NOTE in str(getattr(o, "value", "")) for o in shown)
    with pytest.raises(AttributeError):
        shown[0].children  # noqa: B018 - a static output, not a widget box
