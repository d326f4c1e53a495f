"""The one SIGTERM-wait-SIGKILL routine (workbench.launch.processes.stop) against real processes.

Each child notes the SIGTERM it receives in a file (one keeps running on it), so what the routine
sent is read from the children themselves; psutil reaps them, so their exit codes are not read.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from workbench.launch.processes import stop

CHILD = r"""
import signal, sys, time
path, leave = sys.argv[1], sys.argv[2] == "leave"
def on_term(*_):
    open(path, "a").write("term\n")
    if leave:
        sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(path + ".ready", "w").write("ok")
while True:
    time.sleep(0.05)
"""


def _child(tmp_path, name: str, on_term: str):
    note = tmp_path / name
    popen = subprocess.Popen([sys.executable, "-c", CHILD, str(note), on_term])
    deadline = time.time() + 30
    while not (tmp_path / f"{name}.ready").exists():
        assert time.time() < deadline, f"child {name} did not start"
        time.sleep(0.05)
    return popen, psutil.Process(popen.pid), note


def _noted(note) -> str:
    return note.read_text() if note.exists() else ""


def test_sigterm_goes_to_term_only_and_what_is_left_is_killed(tmp_path):
    pa, a, note_a = _child(tmp_path, "a", "leave")
    pb, b, note_b = _child(tmp_path, "b", "leave")
    try:
        said: list[str] = []
        stop([a, b], 0.5, term=[a], say=said.append)
        assert _noted(note_a) == "term\n"  # a got the one SIGTERM and left on it
        assert _noted(note_b) == ""  # b was never sent SIGTERM: it was killed once the grace was over
        assert not a.is_running() and not b.is_running()
        assert said == ["1 process(es) still alive after 0s: SIGKILL"]
    finally:
        for p in (pa, pb):
            p.kill()
            p.wait()


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    pc, c, note_c = _child(tmp_path, "c", "stay")
    pd, d, note_d = _child(tmp_path, "d", "stay")
    try:
        t0 = time.time()
        stop([c], 1.0, more=lambda: [d])  # d: a process that appeared in the tree meanwhile
        assert time.time() - t0 >= 1.0
        assert _noted(note_c) == "term\n" and not c.is_running()
        assert _noted(note_d) == "" and not d.is_running()  # never SIGTERMed, but SIGKILLed with the rest
    finally:
        for p in (pc, pd):
            p.kill()
            p.wait()


def test_nothing_left_means_no_sigkill(tmp_path):
    pe, e, note_e = _child(tmp_path, "e", "leave")
    try:
        said: list[str] = []
        stop([e], 10.0, say=said.append)
        assert _noted(note_e) == "term\n" and not e.is_running() and said == []
    finally:
        pe.kill()
        pe.wait()
