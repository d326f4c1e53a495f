"""The live run dashboard, and :func:`watch` for headless (papermill) execution.

Why a background thread: a notebook cell must return while the backend trains, yet the
plots must keep moving.  :class:`Dashboard` polls the run's event files from a daemon thread
and updates widgets in place (status line, progress bar with ETA, training figure and
pipeline-schedule figure as PNG ``Image`` widgets, log tail, failure box).  Widget state
changes are sent from that thread over the kernel's IOPub channel, which is thread-safe.

:func:`watch` waits until the run ends, so the notebook's next cells see a finished run.
Live it shows the dashboard and, when the run ends, replaces it with a static summary and the
final figures as PNG outputs, so a saved notebook and its HTML export keep them (a widget's
state is not saved with the notebook).  Headless (papermill, plain Python) it prints a
progress bar and finishes with the same static PNG figures.  A run that did not finish
(stopped by the stop button, ``Run.stop``, a kernel interrupt or ``timeout``; or failed)
raises :class:`RunStopped` / :class:`RunFailed`: a notebook shows it as one line, and "Run
All" halts at that cell, so nothing below it launches more work on a run that ended early.

Why the buttons work while ``watch`` waits: a click is a comm message on the kernel's shell
channel, which the kernel reads only between cells, so a cell that sleeps would queue every
click until it ends.  Live, ``watch`` therefore waits by serving the kernel's pending shell
messages (``jupyter-ui-poll``: comm messages such as the stop and stacks buttons run at once;
cells queued meanwhile are held and run after this one, or are answered "aborted", as the
kernel does with cells queued behind a failing cell, when this cell ends in an error).
``watch(run, until_done=False)`` returns at once instead and leaves the dashboard running on
its own.
"""

from __future__ import annotations

import contextlib
import html
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from workbench import planner
from workbench.plots.router import collapse_flags, flags_text, router_figure
from workbench.plots.schedule import measured_overlay
from workbench.plots.training import figure_png, frames_from_run, training_figure

__all__ = ["Dashboard", "watch", "static_figures", "figure_image", "show_figures", "planner_memory", "is_headless", "RunEnded", "RunStopped", "RunFailed",
           "wrap_words"]

_STATUS_COLOURS = {"starting": "#888", "running": "#1f77b4", "finished": "#2ca02c", "failed": "#d62728", "stopped": "#ff7f0e"}


def is_headless() -> bool:
    """True under papermill (``run_notebook`` sets WORKBENCH_HEADLESS) or outside an IPython kernel."""
    if os.environ.get("WORKBENCH_HEADLESS"):
        return True
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return True
    return ip is None or "Terminal" in type(ip).__name__


def planner_memory(cfg) -> Mapping[int, float] | float | None:
    """The memory planner's predicted peak allocated bytes per rank (``workbench.planner.predict``), if available."""
    if cfg is None:
        return None
    try:
        plan = planner.predict(cfg)
    except Exception:
        return None
    ranks = getattr(plan, "ranks", None) or []
    out = {int(r.rank): float(r.peak_allocated) for r in ranks if getattr(r, "peak_allocated", None) is not None}
    return out or None


class RunEnded(Exception):
    """A watched run ended without finishing; :func:`watch` raises it so that "Run All" halts at that cell.

    IPython shows it as its one-line message (``_render_traceback_``), not as a traceback: a run
    that was stopped or failed is news about the run, not a bug in the cell.  ``status`` is the
    run's final status, ``run`` the :class:`workbench.launch.Run`.
    """

    def __init__(self, message: str, status: str, run=None):
        super().__init__(message)
        self.status, self.run = status, run

    def _render_traceback_(self) -> list[str]:
        # a notebook shows an error as preformatted text that breaks lines anywhere ("di/vides"): wrapped
        # here on word boundaries instead, one string (one line of the error output's list)
        return [wrap_words(str(self))]


class RunStopped(RunEnded):
    """The run was stopped before it finished (stop button, ``Run.stop``, a kernel interrupt, a timeout)."""


class RunFailed(RunEnded):
    """A rank of the run failed (which one and why: ``run.failure``, shown above by :func:`watch`)."""


def wrap_words(text: str, width: int = 100) -> str:
    """``text`` with each line longer than ``width`` wrapped on word boundaries (never inside a word or a path),
    continuation lines indented like the line they continue."""
    import textwrap

    out = []
    for line in str(text).splitlines() or [""]:
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        more = indent + ("  " if line.lstrip().startswith("- ") else "")
        out.extend(textwrap.wrap(line, width, subsequent_indent=more, break_long_words=False,
                                 break_on_hyphens=False) or [line])
    return "\n".join(out)


def _ended_early(run, status: str, why: str | None, queued: int | None = None) -> RunEnded:
    """The exception :func:`watch` raises for a run that ended ``status`` (not finished).

    ``queued``: how many cells were queued behind the watching cell (by "Run All"), which the kernel aborts;
    0: the cell was run on its own; None: not known (papermill, a script), where execution stops at the error."""
    it, total, _eta = run.progress()
    where = f"at iteration {it}/{total}" if total else f"at iteration {it}"
    if queued:
        after = (f"Run All stops here: the {queued} queued cell{'s' if queued != 1 else ''} below "
                 f"{'were' if queued != 1 else 'was'} not run")
    elif queued == 0:
        after = "No other cell was queued"
    else:
        after = "Execution stops here: the cells below did not run"
    if status == "failed":
        f = run.failure
        first = (f.message or "").strip().splitlines()[:1] if f is not None else []
        who = f"rank {f.rank}: " if f is not None and f.rank is not None else ""
        cause = f" ({who}{first[0]})" if first else ""
        return RunFailed(f"The run failed {where}{cause}; see its failure above. {after}. {run.run_dir}", status, run)
    return RunStopped(f"The run was stopped {where}{f' ({why})' if why else ''}. {after}; run the cells below one by "
                      f"one to use what the run saved. {run.run_dir}", status, run)


class _Poll:
    """jupyter-ui-poll's poll function, and how many cells it holds (queued behind the waiting cell)."""

    def __init__(self, poll: Callable[[int], Any], held: Any):
        self._poll, self._held = poll, held

    def __call__(self, n: int = 1) -> Any:
        return self._poll(n)

    def queued(self) -> int | None:
        """How many cells jupyter-ui-poll holds; None where its version keeps them elsewhere (unknown)."""
        held = getattr(self._held, "_events", None)
        return None if held is None else len(held)


@contextlib.contextmanager
def ui_events() -> Iterator[Callable[[int], Any] | None]:
    """In a live kernel: a function that serves the kernel's pending shell messages (widget clicks)
    while a cell waits (``jupyter_ui_poll.ui_events``); None elsewhere (no kernel, or no jupyter-ui-poll).

    Cells queued while it serves (e.g. by "Run All") are held by jupyter-ui-poll and run after this
    cell; when this cell ends in an error they are answered "aborted" instead (:func:`_abort_held_on_error`)."""
    try:
        from IPython import get_ipython
        from jupyter_ui_poll import ui_events as _ui_events

        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            raise LookupError("not in a kernel")
        ctx = _ui_events()
    except Exception:
        yield None
        return
    _abort_held_on_error(shell, ctx)
    with ctx as poll:
        yield _Poll(poll, ctx)


def _abort_held_on_error(shell, held) -> None:
    """When the current cell ends in an error, answer the execute requests jupyter-ui-poll holds "aborted".

    The kernel aborts the requests queued behind a cell that fails (``stop_on_error``, what "Run
    All" sends); the ones jupyter-ui-poll took off the queue while this cell waited would be
    replayed after it regardless.  This runs at the cell's ``post_run_cell``, before that replay,
    and empties the held list (``KernelWrapper._events``, jupyter-ui-poll 1.x) the same way the
    kernel answers an aborted request (``_send_abort_reply``).
    """
    if getattr(held, "_workbench_abort_hook", False):
        return
    held._workbench_abort_hook = True
    kernel = shell.kernel

    def post_run_cell(result) -> None:
        shell.events.unregister("post_run_cell", post_run_cell)
        requests = getattr(held, "_events", None)
        if result.success or not requests:
            return
        parent = kernel.get_parent() if hasattr(kernel, "get_parent") else getattr(kernel, "_parent_header", {})
        if not ((parent or {}).get("content") or {}).get("stop_on_error", True):
            return
        for stream, ident, request in requests:
            kernel._send_abort_reply(stream, request, ident)
        requests.clear()

    shell.events.register("post_run_cell", post_run_cell)


def _wait(seconds: float, poll: Callable[[int], Any] | None) -> None:
    """Sleep ``seconds``; in a live kernel serve widget messages every 50 ms meanwhile."""
    if poll is None:
        time.sleep(seconds)
        return
    end = time.time() + seconds
    while True:
        poll(20)
        left = end - time.time()
        if left <= 0:
            return
        time.sleep(min(0.05, left))


def _close_tree(widget) -> None:
    """Close a widget and every widget under it (their comms and front-end models)."""
    for child in getattr(widget, "children", ()) or ():
        _close_tree(child)
    widget.close()


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _fmt_eta(seconds: float | None) -> str:
    return "ETA --" if seconds is None else f"ETA {_fmt_duration(seconds)}"


def short_path(path: Any, keep: int = 3) -> str:
    """A run directory as the status line shows it: relative to the working directory when under it,
    else its last ``keep`` parts after an ellipsis (the full path goes in the tooltip)."""
    from pathlib import Path

    p = Path(path)
    try:
        p = p.absolute().relative_to(Path.cwd())
    except ValueError:
        pass
    return str(p) if len(p.parts) <= keep else "\u2026/" + "/".join(p.parts[-keep:])


def status_line(status: str, iteration: int, total: int, run_dir: Any) -> str:
    """The dashboard's one-line status: state, iteration, then the run directory (cut with an ellipsis,
    never wrapped, where the line is too narrow; the full path is its tooltip)."""
    colour = _STATUS_COLOURS.get(status, "#000")
    full = html.escape(str(run_dir), quote=True)
    return (f"<div style='white-space: nowrap; overflow: hidden; text-overflow: ellipsis' title='{full}'>"
            f"<b style='color:{colour}'>{html.escape(status)}</b> &nbsp; iteration {iteration}/{total}"
            f" &nbsp; <code>{html.escape(short_path(run_dir))}</code></div>")


class Dashboard:
    """Live view of a :class:`workbench.launch.Run` (launched here or re-attached)."""

    def __init__(self, run, interval: float = 1.0, predicted_memory: Mapping[int, float] | float | None = None,
                 log_lines: int = 15, autostart: bool = True, stall_after: float = 120.0):
        import ipywidgets as W

        self.run = run
        self.interval = interval
        self.stall_after = stall_after  # seconds without events (and 20 step times) before the "stuck?" hint
        self.log_lines = log_lines
        self.predicted_memory = predicted_memory if predicted_memory is not None else planner_memory(run.config)
        self.status = W.HTML(layout=W.Layout(flex="1 1 auto", min_width="0", width="auto"))
        self.progress = W.IntProgress(min=0, max=max(self._total(), 1), description="progress")
        self.eta = W.Label("ETA --")
        self.figure = W.Image(format="png")
        self.schedule = W.Image(format="png", layout=W.Layout(display="none"))
        self.router = W.Image(format="png", layout=W.Layout(display="none"))  # MoE runs: the router dashboard
        self.failure = W.HTML(layout=W.Layout(display="none"))
        self.log = W.HTML()
        self.stop_button = W.Button(description="stop", button_style="danger", icon="stop")
        self.stop_button.on_click(lambda _b: self.stop())
        self.stacks_button = W.Button(description="stacks", icon="search", tooltip="every rank's Python stacks (for a run that seems stuck)")
        self.stacks_button.on_click(lambda _b: self.show_stacks())
        self.stacks = W.HTML()
        self.widget = W.VBox([
            W.HBox([self.status, self.stop_button, self.stacks_button]),
            W.HBox([self.progress, self.eta]),
            self.failure, self.figure, self.schedule, self.router,
            W.Accordion(children=[self.log, self.stacks], titles=("log tail", "rank stacks")),
        ])
        self._n_events = -1
        self._last_status: str | None = None
        # one update at a time: the polling thread and watch()'s final update never interleave, so a slow
        # redraw that started on older events cannot land after (and over) the final figures
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.stopped_here = False  # the stop button (or :meth:`stop`) stopped the run
        self.updates = 0
        self.update()
        if autostart and not self.finished:
            self.start()

    def _total(self) -> int:
        return self.run.config.train.train_iters if self.run.config else 0

    @property
    def finished(self) -> bool:
        return self.run.status in ("finished", "failed", "stopped") and not self.run.is_alive()

    # ---- updating
    def update(self, force: bool = False) -> None:
        """One refresh: re-read events; redraw only when something changed."""
        with self._lock:
            self._update(force)

    def _update(self, force: bool) -> None:
        run = self.run
        status = self._update_status()
        n = run.event_count
        f = run.failure if status == "failed" else None
        if f is not None:
            self.failure.value = (f"<div style='color:#d62728'><b>rank {f.rank} failed</b>: {html.escape(f.message)}</div>"
                                  f"<pre style='font-size:11px;max-height:300px;overflow:auto'>{html.escape(f.traceback)}</pre>")
            self.failure.layout.display = None
        if force or n != self._n_events or status != self._last_status:
            self.figure.value = figure_png(training_figure(frames_from_run(run), self.predicted_memory))
            sched = self._schedule_png()
            if sched:
                self.schedule.value = sched
                self.schedule.layout.display = None
            routed = _router_png(self.run)
            if routed:
                self.router.value, self.router.layout.display = routed, None
            self._n_events, self._last_status = n, status
            # drawing takes a while and a fast run goes on meanwhile (the status line lagged ~30
            # iterations behind the log): read again, so status, progress and log are current
            self._update_status()
        self.log.value = f"<pre style='font-size:11px'>{html.escape(run.log_tail(None, self.log_lines))}</pre>"
        self.updates += 1

    def _update_status(self) -> str:
        """Read new events; status line, progress bar, ETA and stop button from them. Returns the status."""
        run = self.run
        run.refresh()
        status = run.status
        it, total, eta = run.progress()
        self.status.value = status_line(status, it, total, run.run_dir)
        stalled = run.stalled_for(floor=self.stall_after, status=status)
        if stalled is not None:
            self.status.value += (f"<div><b style='color:#d62728'>no progress for {_fmt_duration(stalled)}</b>: "
                                  "if it is stuck, the stacks button shows where each rank waits</div>")
        if run.reader.has("router", refresh=False):  # an MoE run: name the experts its routers starve or flood
            if warn := flags_text(collapse_flags(run.reader)):
                self.status.value += f"<div><b style='color:#d62728'>{html.escape(warn)}</b></div>"
        self.progress.max = max(total, 1)
        self.progress.value = min(it, self.progress.max)
        self.progress.bar_style = {"finished": "success", "failed": "danger", "stopped": "warning"}.get(status, "info")
        self.eta.value = _fmt_eta(eta) if status in ("running", "starting") else status
        self.stop_button.disabled = status in ("finished", "failed", "stopped") and not run.is_alive()
        return status

    def _schedule_png(self) -> bytes | None:
        if not self.run.reader.has("microbatch", refresh=False):
            return None
        try:  # the records the run already holds: nothing is read again
            fig, _report = measured_overlay(self.run.reader)
            return figure_png(fig)
        except Exception:
            return None

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                self.update()
                if self._closed.is_set():
                    break  # closed meanwhile: whoever closed it draws the final state
                if self.finished:
                    self.update(force=True)
                    break
            except Exception as e:  # keep polling; show the problem instead of dying silently
                self.status.value = f"<b>dashboard error</b>: {html.escape(repr(e))}"
            self._closed.wait(self.interval)

    def start(self) -> "Dashboard":
        if self._thread is None or not self._thread.is_alive():
            self._closed.clear()
            self._thread = threading.Thread(target=self._loop, name=f"dashboard-{self.run.run_dir.name}", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def stop(self, grace: float = 10.0) -> str:
        """The stop button: stop the run (SIGTERM, SIGKILL after ``grace``)."""
        self.stopped_here = True
        self.stop_button.disabled = True
        self.stop_button.description = "stopping..."
        st = self.run.stop(grace=grace)
        self.stop_button.description = "stopped"
        self.update(force=True)
        return st

    def show_stacks(self) -> dict[int, str]:
        """The stacks button: every live rank's Python stacks (:meth:`Run.stacks`), shown under "rank stacks"."""
        stacks = self.run.stacks()
        self.stacks.value = "".join(f"<b>rank {r}</b><pre style='font-size:11px;max-height:300px;overflow:auto'>{html.escape(t)}</pre>"
                                    for r, t in stacks.items()) or "<i>no live ranks</i>"
        return stacks

    # ---- display
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def leave_static(self, handle=None) -> None:
        """Replace the live dashboard by what a saved notebook can show: its final status line (with the
        failure and the log tail) as HTML, then the training and schedule figures as PNG outputs.

        ``handle``: the ``DisplayHandle`` the dashboard's widget was displayed with (``display(...,
        display_id=True)``); it is updated in place.  The widgets are closed afterwards.

        The polling thread is stopped first and everything is drawn once more from every event the run
        wrote, so the figures show each step the status line counts (a redraw the thread started on older
        events can no longer land over them)."""
        from IPython.display import HTML, display

        self.close()
        with self._lock:
            self._update(force=True)
            parts = [f"<div>{self.status.value}</div>"]
            if self.failure.layout.display != "none" and self.failure.value:
                parts.append(self.failure.value)
            parts.append(f"<details><summary>log tail</summary>{self.log.value}</details>")
            pngs = [(name, w.value) for name, w in (("training", self.figure), ("schedule", self.schedule), ("router", self.router))
                    if w.layout.display != "none" and w.value]
        summary = HTML("".join(parts))
        if handle is not None:
            handle.update(summary)
        else:
            display(summary)
        for name, png in pngs:
            display(figure_image(name, bytes(png)))
        _close_tree(self.widget)

    def static(self) -> list:
        """The current figures as IPython PNG images (for papermill / HTML export)."""
        return static_figures(self.run, self.predicted_memory)


def _follow(run, bar, end: float | None, timeout: float | None, interval: float,
            live: bool) -> tuple[str | None, int | None]:
    """Wait for the run to end (a timeout or an interrupt stops it): (why it was stopped here, cells queued since)."""
    why = None
    queued = None  # cells queued behind this one (live in a kernel: counted while they wait; elsewhere unknown)
    poll = None
    ui = contextlib.ExitStack()
    try:
        poll = ui.enter_context(ui_events()) if live else None
        while True:
            st = run.status
            if bar is not None:
                it, _total, _eta = run.progress()
                bar.update(max(it - bar.n, 0))
                bar.set_postfix_str(st, refresh=False)
            if st in ("finished", "failed", "stopped") and not run.is_alive():
                break
            if end is not None and time.time() > end:
                why = f"watch's timeout of {timeout:g} s"
                print(f"watch: timeout after {timeout}s; stopping the run", flush=True)
                run.stop()
                break
            _wait(interval, poll)
    except KeyboardInterrupt:
        why = "kernel interrupt"
        print("interrupted: stopping the run", flush=True)
        run.stop()
    finally:
        if poll is not None:
            try:
                poll(20)  # take what the front end queued last off the kernel's queue, so it is counted
                queued = poll.queued()
            except Exception:
                queued = None
        ui.close()
        if bar is not None:
            bar.close()
    return why, queued


def _show_end(run, st: str, dash: "Dashboard | None", handle, show: bool) -> None:
    """The ended run's output: the dashboard left static (or updated), or headless the status, failure and figures."""
    if dash is not None:
        dash.close()  # the polling thread first: the final update below is the last one
        if show:
            dash.leave_static(handle)
        else:
            dash.update(force=True)
    elif show:
        print(f"run {st}: {run.run_dir}")
        f = run.failure
        if f is not None:
            print(str(f))
        show_figures(run)  # PNG outputs in a notebook; in a script, the saved files' paths (not an object's repr)


def watch(run, until_done: bool = True, *, live: bool | None = None, interval: float = 1.0,
          timeout: float | None = None, show: bool = True, check: bool = True) -> str:
    """Follow a run until it ends and show its plots; returns the final status.

    live (default: auto): the ipywidgets dashboard updating in place; its stop and stacks
    buttons work while this waits (the kernel's widget messages are served meanwhile).  When
    the run ends the dashboard is replaced by a static summary and the final figures as PNG
    outputs (:meth:`Dashboard.leave_static`), which a saved notebook keeps.
    ``until_done=False``: show the dashboard and return at once.  Headless: a text progress
    bar, the failure (rank + traceback) if any, then static PNG figures.  A kernel interrupt
    (or Ctrl-C) or ``timeout`` seconds stop the run.

    ``check`` (default): a run that did not finish raises :class:`RunStopped` or
    :class:`RunFailed` after its figures are shown (one line in a notebook; "Run All" halts
    there).  ``check=False`` returns the status instead.
    """
    from tqdm import tqdm

    live = (not is_headless()) if live is None else live
    dash = handle = None
    if live:
        from IPython.display import display

        dash = Dashboard(run, interval=interval)
        handle = display(dash.widget, display_id=True)  # replaced by the static summary when the run ends
        if not until_done:
            return run.status
    end = None if timeout is None else time.time() + timeout
    total = run.config.train.train_iters if run.config else None
    bar = None if live else tqdm(total=total, desc=run.run_dir.name, unit="it", file=sys.stdout, mininterval=5.0,
                                 disable=not show)
    why, queued = _follow(run, bar, end, timeout, interval, live)
    st = run.wait(timeout=30)
    _show_end(run, st, dash, handle, show)
    if why is None and dash is not None and dash.stopped_here:
        why = "the stop button"
    if check and st != "finished":
        raise _ended_early(run, st, why, queued)
    return st


def static_figures(run, predicted_memory: Mapping[int, float] | float | None = None) -> list:
    """The training figure (and the measured pipeline schedule, when micro-batch events exist) as PNG images."""
    return [figure_image(name, png) for name, png in _figure_pngs(run, predicted_memory)]


def figure_image(name: str, png: bytes):
    """A run figure as an IPython PNG image whose output names it (``metadata["image/png"]["workbench_figure"]``:
    ``training``, ``schedule`` or ``router`` from a run's dashboard, ``compare`` from the run browser, a notebook's
    own, as 07's ``accuracy``), so a saved notebook says which figure each output is."""
    from IPython.display import Image

    return Image(data=png, format="png", metadata={"workbench_figure": name})


def _figure_pngs(run, predicted_memory: Mapping[int, float] | float | None = None) -> list[tuple[str, bytes]]:
    """(name, PNG bytes) of the training figure, the measured pipeline schedule and the router dashboard (the
    last two when the run wrote their events)."""
    pred = predicted_memory if predicted_memory is not None else planner_memory(run.config)
    out = [("training", figure_png(training_figure(frames_from_run(run), pred), dpi=90))]
    if run.events("microbatch"):
        try:
            fig, _ = measured_overlay(run.reader)
            out.append(("schedule", figure_png(fig, dpi=90)))
        except Exception as e:
            print(f"(pipeline schedule view unavailable: {e})")
    routed = _router_png(run, dpi=90)
    if routed:
        out.append(("router", routed))
    return out


def _in_kernel() -> bool:
    """True inside a notebook kernel (Jupyter, papermill), where a displayed PNG shows; False in a plain script
    or a terminal IPython, where ``display`` would print the image object's repr."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:
        return False
    return ip is not None and "Terminal" not in type(ip).__name__


def show_figures(run, predicted_memory: Mapping[int, float] | float | None = None) -> list[Path]:
    """The run's final figures: displayed as PNG outputs in a notebook kernel; elsewhere (a script) written to
    ``<run_dir>/figures/<name>.png`` with one line naming each file.  Returns the files written ([] in a kernel)."""
    pngs = _figure_pngs(run, predicted_memory)
    if _in_kernel():
        from IPython.display import display

        for name, png in pngs:
            display(figure_image(name, png))
        return []
    out_dir = Path(run.run_dir) / "figures"
    written = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, png in pngs:
            path = out_dir / f"{name}.png"
            path.write_bytes(png)
            written.append(path)
    except OSError as e:
        print(f"(figures not saved: {e})")
    for path in written:
        print(f"figure: {path}")
    return written


def _router_png(run, dpi: int = 80) -> bytes | None:
    """The router dashboard (:func:`workbench.plots.router.router_figure`) of a run that wrote ``router`` records."""
    if not run.reader.has("router", refresh=False):
        return None
    return figure_png(router_figure(run.reader), dpi=dpi)
