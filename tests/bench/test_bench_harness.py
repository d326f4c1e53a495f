"""bench/processes.run_group (harness.run_group): a timed-out launch ends every process it started, also those in sessions of their own
(torchrun's workers are), so the next benchmark variant finds the GPU free."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import harness

#: this session's probe marker: another pytest session's probes on the machine are neither seen nor killed here
_PROBE = f"wb-orphan-probe-{os.getpid()}"

# a launcher (like torchrun) whose worker runs in a session of its own and outlives a SIGKILL of the launcher
_LAUNCHER = ("import subprocess, sys, time; "
             "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # " + _PROBE + "'], "
             "start_new_session=True); print(w.pid, flush=True); time.sleep(120)")


def _probe_pids() -> list[int]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if _PROBE.encode() in cmdline.read_bytes() and int(cmdline.parent.name) != os.getpid():
                out.append(int(cmdline.parent.name))
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timeout_ends_the_launcher_and_its_worker_in_another_session():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        harness.run_group([sys.executable, "-c", _LAUNCHER], 3.0)
    assert time.monotonic() - start < 30  # not waiting on the worker's hold of the pipes
    assert not [p for p in _probe_pids() if _alive(p)]


def test_an_interrupted_caller_ends_them_too():
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(2)
    try:
        with pytest.raises(KeyboardInterrupt):
            harness.run_group([sys.executable, "-c", _LAUNCHER], 60.0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not [p for p in _probe_pids() if _alive(p)]


def test_a_run_inside_its_time_returns_its_output_and_code():
    done = harness.run_group([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], 30.0)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, "out", "err")


def test_a_timed_out_runs_output_is_kept_once():
    with pytest.raises(subprocess.TimeoutExpired) as info:
        harness.run_group([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2.0)
    assert info.value.output == "started\n"


def test_a_repeat_past_its_time_is_a_row_entry_with_its_log_not_the_end_of_the_row(monkeypatch, tmp_path):
    """A reference process that never settles (T5 at 471e8c8) ran past its limit and its exception ended the whole
    row, losing the other repeats and the process's own output: now the repeat is an entry with ``error``."""
    import argparse

    slow = "import sys, time; print('warm-up step 1', flush=True); print('compiling', file=sys.stderr, flush=True); time.sleep(60)"
    monkeypatch.setattr(harness, "torchrun", lambda nproc, args, timeout: harness.run_group([sys.executable, "-c", slow], timeout))
    a = argparse.Namespace(cpu_smoke=False, steps=20, warmup=5, warmup_max=40, timeout=2.0, out=str(tmp_path / "rows.jsonl"),
                           reference_compile="default")
    res = harness.measure("bench/t5_bench.py", "reference", "t5-base", a)
    assert res.get("tokens_per_s") is None
    assert "timed out after 2 s" in res["error"] and "warm-up step 1" in res["error"] and "compiling" in res["error"]
    assert harness.compare({"workbench": [{"tokens_per_s": 1.0}], "reference": [res]}, "workbench", "reference") is None
    partial = (tmp_path / "rows.partial.jsonl").read_text().splitlines()
    assert len(partial) == 1 and "timed out" in partial[0]


# --------------------------------------------------------------------------- the caller itself is ended

# a launcher that stops its worker on SIGTERM, as torchrun does (its SIGTERM handler is set before the worker starts;
# the file WB_READY names is written once both are in place)
_FORWARDING_LAUNCHER = ("import os, signal, subprocess, sys, time\n"
                        "w = None\n"
                        "def stop(*_):\n"
                        "    if w is not None:\n"
                        "        w.kill(); w.wait()\n"
                        "    os._exit(143)\n"
                        "signal.signal(signal.SIGTERM, stop)\n"
                        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # " + _PROBE + "'], "
                        "start_new_session=True)\n"
                        "open(os.environ['WB_READY'], 'w').close()\n"
                        "time.sleep(120)  # " + _PROBE + " launcher\n")

# the benchmark script's stand-in: run_group on a launcher whose code comes from the environment (so this parent's
# own command line does not name the probe)
_PARENT = ("import os, sys; sys.path.insert(0, os.environ['WB_ROOT']); from bench import harness; "
           "harness.run_group([sys.executable, '-c', os.environ['WB_LAUNCHER_CODE']], 120)")

_WORKER_ARGV = [b"-c", f"import time; time.sleep(120)  # {_PROBE}".encode()]


def _worker_pids() -> list[int]:
    """The live probe workers (not the launchers, whose code merely names them)."""
    out = []
    for pid in _probe_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == _WORKER_ARGV and _alive(pid):
            out.append(pid)
    return out


def _start_parent(launcher: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    env = {**os.environ, "WB_ROOT": str(harness.ROOT), "WB_LAUNCHER_CODE": launcher, "WB_READY": str(ready)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return parent, ready


def _wait_for(cond, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def _end_all(parent: subprocess.Popen, known: set[int]) -> None:
    """Whatever a test started and is still there: the parent, and every probe (launchers and workers)."""
    import signal

    if parent.poll() is None:
        parent.kill()
    parent.wait(timeout=10)
    for pid in known | set(_probe_pids()):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_a_sigterm_to_the_caller_ends_the_launcher_and_its_worker(tmp_path):
    """``timeout -k 5 530 python3 bench/train_throughput.py`` SIGTERMs the benchmark at a device call's limit: its
    default action ended the script at once, run_group's cleanup never ran, and torchrun (in a session of its own)
    and its ranks outlived the call, one holding 74 GiB of a GPU through the next call's measurements."""
    import signal

    parent, _ = _start_parent(_LAUNCHER, tmp_path)
    known: set[int] = set()
    try:
        assert _wait_for(lambda: _worker_pids(), 30), "the probe worker never started"
        known = set(_probe_pids())
        parent.send_signal(signal.SIGTERM)
        start = time.monotonic()
        parent.wait(timeout=15)
        assert time.monotonic() - start < 15
        assert parent.returncode in (143, -signal.SIGTERM), parent.stderr.read()
        assert _wait_for(lambda: not [p for p in _probe_pids() if _alive(p)], 10), \
            f"left alive: {[p for p in _probe_pids() if _alive(p)]}"
    finally:
        _end_all(parent, known)


def test_a_sigkilled_caller_takes_the_launcher_down_and_the_launcher_its_worker(tmp_path):
    """No handler runs on SIGKILL: the launcher is started with PR_SET_PDEATHSIG = SIGTERM, so it gets SIGTERM when its
    caller dies, and (as torchrun does) stops its worker."""
    import signal

    parent, ready = _start_parent(_FORWARDING_LAUNCHER, tmp_path)
    known: set[int] = set()
    try:
        assert _wait_for(lambda: ready.exists() and _worker_pids(), 30), "the probe worker never started"
        known = set(_probe_pids())
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_for(lambda: not [p for p in _probe_pids() if _alive(p)], 10), \
            f"left alive: {[p for p in _probe_pids() if _alive(p)]}"
    finally:
        _end_all(parent, known)


def test_run_group_gives_the_child_the_supervisor_token_and_restores_sigterm():
    """The ranks' guard (workbench.launch.ownership.guard_rank) takes this process's token as a live supervisor; the
    SIGTERM handler is run_group's only while it runs."""
    import signal

    from workbench.launch.ownership import SUPERVISOR_ENV, _token_alive

    before = signal.getsignal(signal.SIGTERM)
    done = harness.run_group([sys.executable, "-c", f"import os; print(os.environ[{SUPERVISOR_ENV!r}])"], 30.0)
    token = done.stdout.strip()
    assert token.startswith(f"{os.getpid()}:") and _token_alive(token)
    assert signal.getsignal(signal.SIGTERM) is before


def test_gpu_strangers_is_empty_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    assert harness.gpu_strangers() == []


def test_gpu_strangers_are_the_processes_on_this_processs_gpus_not_this_one_nor_its_descendants(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in --query-gpu=*) echo "0, GPU-a"; echo "1, GPU-b"; exit 0;; esac\n'
                    f"echo 'GPU-a, 123, 500'\necho 'GPU-b, 789, 100'\necho 'GPU-a, {os.getpid()}, 10'\n"
                    "echo 'GPU-a, 456, [N/A]'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    a, b = {"pid": 123, "used_mib": 500}, {"pid": 456, "used_mib": None}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU is this process's
    assert harness.gpu_strangers() == [a, {"pid": 789, "used_mib": 100}, b]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a row beside another on GPU 1 (bench/headline_call.sh)
    assert harness.gpu_strangers() == [a, b]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")
    assert harness.gpu_strangers() == [{"pid": 789, "used_mib": 100}]
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert harness.gpu_strangers() == []


def test_gpu_strangers_on_this_machine_is_a_list():
    """On a CPU machine (no nvidia-smi) it is empty; it never raises."""
    import shutil

    got = harness.gpu_strangers()
    assert isinstance(got, list)
    if shutil.which("nvidia-smi") is None:
        assert got == []
