"""The one line a watched run that did not finish ends its cell with: it says what happened to the cells below (a cell
run on its own, cells queued by Run All, papermill), and it wraps on word boundaries, never inside a word."""

from __future__ import annotations

import contextlib

import pytest

from workbench.launch import Run
from workbench.launch.exit_status import write_exit_status
from tests.support import write_step_events


def _stopped_run(tmp_path) -> Run:
    write_step_events(tmp_path, 12).close()
    write_exit_status(tmp_path, None, status="stopped", reason="stopped")
    return Run.attach(tmp_path)


class _FakePoll:
    """What watch() gets from jupyter-ui-poll in a kernel: a poll function and the cells it holds."""

    def __init__(self, queued: int):
        self.n = queued

    def __call__(self, n: int = 1) -> None:
        pass

    def queued(self) -> int:
        return self.n


@pytest.mark.parametrize("queued", [0, 3])
def test_the_stop_message_says_what_happened_to_the_cells_below(tmp_path, monkeypatch, queued):
    import IPython.display

    from workbench.widgets import dashboard as dashboard_module

    @contextlib.contextmanager
    def ui_events():
        yield _FakePoll(queued)

    monkeypatch.setattr(dashboard_module, "ui_events", ui_events)
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    with pytest.raises(dashboard_module.RunStopped) as caught:
        dashboard_module.watch(_stopped_run(tmp_path), live=True, interval=0.05)
    message = str(caught.value)
    assert "stopped at iteration 12/60" in message
    if queued:  # Run All: the kernel aborts the cells queued behind this one
        assert "Run All stops here" in message and "the 3 queued cells below were not run" in message, message
    else:  # the cell was run on its own: there is no Run All to stop
        assert "Run All" not in message and "No other cell was queued" in message, message


def test_headless_the_stop_message_says_execution_stops(tmp_path):
    from workbench.widgets.dashboard import RunStopped, watch

    with pytest.raises(RunStopped) as caught:
        watch(_stopped_run(tmp_path), live=False, show=False)
    assert "Execution stops here" in str(caught.value) and "Run All" not in str(caught.value)


def test_the_message_as_a_notebook_shows_it_wraps_between_words(tmp_path):
    """A notebook shows an error's lines as preformatted text, which JupyterLab breaks anywhere when a line is longer
    than the output ("di/vides"): the lines come wrapped at word boundaries, no longer than 100 characters."""
    from workbench.widgets.dashboard import RunStopped, _ended_early

    run = _stopped_run(tmp_path / ("a-rather-long-directory-name-" * 2))
    err = _ended_early(run, "stopped", "the stop button", queued=2)
    assert isinstance(err, RunStopped)
    (shown,) = err._render_traceback_()
    lines = shown.splitlines()
    assert len(lines) > 1 and all(len(ln) <= 100 or " " not in ln.strip() for ln in lines), lines
    # nothing is cut inside a word: the words of the message are the words of the lines
    assert shown.split() == str(err).split()
