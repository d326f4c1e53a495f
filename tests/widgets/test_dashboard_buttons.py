"""The dashboard's buttons while ``watch(run)`` waits in a real Jupyter kernel.

A real ipykernel (jupyter_client), a real run (supervisor, torchrun, the fake rank script of
``tests.support``), and the messages a browser sends when a person clicks a button: a
``comm_msg`` ``{"method": "custom", "content": {"event": "click"}}`` to the button's comm on the
shell channel.  The clicks must take effect while the cell that called ``watch`` is still running.
A stop ends the cell in one line (``RunStopped``, no traceback) and the cells queued behind it
(as "Run All" queues them) are answered "aborted" instead of running on the stopped run; the
dashboard is replaced by a static summary and PNG figures.
The same thing through JupyterLab in Chromium: ``tests/browser``.
"""

from __future__ import annotations

import os
import queue
import textwrap
import time

import pytest

from tests.support import ROOT, run_processes

pytestmark = pytest.mark.slow


class _Widgets:
    """Follows a kernel's IOPub: widget models by comm id, their state, the cell's output."""

    def __init__(self, kc):
        self.kc = kc
        self.state: dict[str, dict] = {}
        self.text = ""
        self.idle_for: set[str] = set()
        self.errors: dict[str, dict] = {}  # cell msg_id -> its error content
        self.replies: dict[str, dict] = {}  # request msg_id -> execute_reply content
        self.outputs: dict[str, list] = {}  # cell msg_id -> [(msg_type, content)] of display messages

    def _shell(self) -> None:
        while True:
            try:
                msg = self.kc.get_shell_msg(timeout=0)
            except queue.Empty:
                return
            self.replies[msg["parent_header"].get("msg_id")] = msg["content"]

    def pump(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                self._shell()
                continue
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind in ("display_data", "update_display_data"):
                self.outputs.setdefault(msg["parent_header"].get("msg_id"), []).append((kind, content))
            if kind == "comm_open":
                self.state[content["comm_id"]] = dict(content["data"].get("state", {}))
            elif kind == "comm_msg" and content["data"].get("method") == "update":
                self.state.setdefault(content["comm_id"], {}).update(content["data"].get("state", {}))
            elif kind == "stream":
                self.text += content["text"]
            elif kind == "error":
                self.text += "\n".join(content["traceback"])
                self.errors[msg["parent_header"].get("msg_id")] = content
            elif kind == "status" and content["execution_state"] == "idle":
                self.idle_for.add(msg["parent_header"].get("msg_id"))

    def until(self, pred, seconds: float, what: str):
        end = time.time() + seconds
        while time.time() < end:
            v = pred()
            if v:
                return v
            self.pump(0.2)
        raise AssertionError(f"timed out after {seconds}s waiting for {what}; output so far:\n{self.text[-3000:]}")

    def find(self, model: str, **attrs) -> str | None:
        for cid, st in self.state.items():
            if st.get("_model_name") == model and all(st.get(k) == v for k, v in attrs.items()):
                return cid
        return None

    def click(self, comm_id: str) -> None:
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": {"event": "click"}}})
        self.kc.shell_channel.send(msg)


def test_stop_and_stacks_buttons_act_while_watch_waits(rank_script, tmp_path):
    from jupyter_client.manager import start_new_kernel

    from workbench.launch import Run

    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_HEADLESS"}  # a live kernel, as in a browser
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), env={**env, "MPLBACKEND": "Agg"})
    run_dir = None
    try:
        w = _Widgets(kc)
        code = textwrap.dedent(f'''
            from workbench.config import preset
            from workbench.launch import Run
            from workbench.widgets.dashboard import watch
            cfg = preset("tiny").replace(**{{"parallel.nproc_per_node": 2, "train.train_iters": 100000}})
            run = Run.launch(cfg, run_root={str(tmp_path / "runs")!r}, entry=[{str(rank_script)!r}], env={{"FAKE_MODE": "slow"}})
            print("RUN_DIR", run.run_dir, flush=True)
            status = watch(run, interval=0.5)
            print("WATCH_RETURNED", status, flush=True)
        ''')
        cell = kc.execute(code)
        marker = tmp_path / "queued-cell-ran"
        line = w.until(lambda: next((ln for ln in w.text.splitlines() if ln.startswith("RUN_DIR ")), None), 90, "the launch")
        run_dir = line.split(" ", 1)[1].strip()
        stop = w.until(lambda: w.find("ButtonModel", description="stop"), 60, "the dashboard's stop button")
        stacks_btn = w.until(lambda: w.find("ButtonModel", description="stacks"), 30, "the dashboard's stacks button")
        # widget models open one comm at a time: the accordion may arrive after the buttons
        accordion = w.until(lambda: (a := w.find("AccordionModel")) and len(w.state[a].get("children") or []) > 1 and a,
                            30, "the dashboard's accordion")
        stacks_html = w.state[accordion]["children"][1].removeprefix("IPY_MODEL_")
        status_html = w.find("HTMLModel")  # the first HTML of the dashboard is its status line
        w.until(lambda: any("iteration" in (st.get("value") or "") and "running" in (st.get("value") or "")
                            for st in w.state.values() if st.get("_model_name") == "HTMLModel"), 60, "the dashboard to say running")
        assert status_html is not None and cell not in w.idle_for  # watch() is still waiting

        t0 = time.time()
        w.click(stacks_btn)
        w.until(lambda: w.state[stacks_html].get("value"), 20, "the stacks button's answer while watch() waits")
        assert cell not in w.idle_for, "the stacks click was only served after the cell ended"
        assert time.time() - t0 < 20

        # "Run All": the cells below are sent at once and wait behind the watching cell (jupyter-ui-poll
        # holds them; it also publishes an "idle" for the watching cell as it takes each one off the queue)
        queued = [kc.execute(f"open({str(marker)!r}, 'w').write('ran')"), kc.execute("print('QUEUED_RAN')")]
        w.pump(1.0)
        t0 = time.time()
        w.click(stop)
        w.until(lambda: cell in w.errors, 40, "the watching cell to end after the stop click")
        assert time.time() - t0 < 40
        err = w.errors[cell]
        # a stop is said in one line, without a traceback, and the cell does not go on
        assert err["ename"] == "RunStopped", err
        assert len(err["traceback"]) == 1 and "stopped at iteration" in err["traceback"][0], err["traceback"]
        assert "WATCH_RETURNED" not in w.text
        # the dashboard became a static summary (HTML in place of the widget) and PNG figures
        outs = w.outputs.get(cell, [])
        updates = [c for k, c in outs if k == "update_display_data"]
        assert updates and "text/html" in updates[-1]["data"] and "stopped" in updates[-1]["data"]["text/html"], outs
        assert "application/vnd.jupyter.widget-view+json" not in updates[-1]["data"]
        assert any("image/png" in c["data"] for k, c in outs if k == "display_data"), outs
        # the cells queued behind it are aborted, not run on the stopped run
        w.until(lambda: all(q in w.replies for q in queued), 30, "the queued cells' replies")
        assert [w.replies[q]["status"] for q in queued] == ["aborted", "aborted"], [w.replies[q] for q in queued]
        assert not marker.exists() and "QUEUED_RAN" not in w.text
        w.until(lambda: cell in w.idle_for, 20, "the cell to end")
        assert not [p for p in run_processes(run_dir) if p.status() != "zombie"]
        assert Run.attach(run_dir).status == "stopped"
        # the kernel serves the next cell normally afterwards
        nxt = kc.execute("print('NEXT', run.status)")
        w.until(lambda: "NEXT stopped" in w.text, 20, "the next cell")
        assert nxt in w.idle_for or w.until(lambda: nxt in w.idle_for, 10, "the next cell to end")
    finally:
        if run_dir is not None:
            Run.attach(run_dir).stop(grace=2)
        kc.stop_channels()
        km.shutdown_kernel(now=True)
