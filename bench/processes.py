"""Benchmark processes that end with their benchmark: :func:`run_group` (a variant's torchrun, its ranks and every
process below it, ended on a timeout, an interrupt, SIGTERM, or the benchmark's own death) and
:func:`gpu_strangers` (who else holds the GPUs when a repeat starts).  Launcher side only; torch-free."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["run_group", "gpu_strangers", "check_gpus", "TERMINATED_GRACE"]


class _Terminated(SystemExit):
    """SIGTERM reached the process while :func:`run_group` waited (exit code 143, as the signal's default action gives):
    raised by the handler run_group installs, so its cleanup runs before the process ends."""

    def __init__(self) -> None:
        super().__init__(143)


class _SigtermGuard:
    """While entered in the main thread: SIGTERM raises :class:`_Terminated` (once; a later one is only noted, so a
    cleanup in progress is not cut short), instead of the signal's default action ending the process at once.
    ``timeout -k 5 530 python3 bench/train_throughput.py`` (bench/scale_call.sh) SIGTERMs its process group when the
    call's limit is reached; torchrun, in a session of its own, is not in that group.  With the default action
    ``run_group``'s cleanup never ran and torchrun's ranks outlived the call, one holding 74 GiB of a GPU while the
    next call measured beside it.  Only a default disposition is taken over: a caller's own handler, or an ignored
    SIGTERM, is left as it is.  The previous handler is restored on exit."""

    def __init__(self) -> None:
        self.raising, self.received, self._old, self._installed = True, False, None, False

    def __enter__(self) -> "_SigtermGuard":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                    self._old = signal.signal(signal.SIGTERM, self._handle)
                    self._installed = True
            except (ValueError, OSError):  # no signals here (an embedded interpreter, say)
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.raising:
            self.raising = False
            raise _Terminated()

    def __exit__(self, *exc: Any) -> None:
        import signal

        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._old is None else self._old)
            self._installed = False


def run_group(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)``, but when it does not end in
    time (or the caller is interrupted, or the process is sent SIGTERM) every process it started is ended before the
    exception goes on.
    ``subprocess.run`` SIGKILLs only its child: torchrun then cannot stop its workers (each in a session of its
    own), they outlived it holding the GPU, and the next variant ran out of memory (session 16, H100: a timed-out
    3B reference kept 77.8 GiB).  Here torchrun gets SIGTERM first (it stops its workers), then every process
    that descends from this one and was not there before is SIGKILLed, orphans included (this process is their
    subreaper, so they stay below it).

    Ending this process does not leave them behind either:

    - SIGTERM (``timeout`` at a device call's limit) raises :class:`_Terminated` (exit code 143) while this runs in
      the main thread, so the cleanup above runs, briefly: torchrun's group gets SIGTERM, at most ~2 s to go, then
      every new descendant is SIGKILLed (the caller's ``timeout -k`` SIGKILLs soon after), and the exception goes on.
    - SIGKILL: the child is started with ``PR_SET_PDEATHSIG = SIGTERM``
      (:func:`workbench.launch.ownership.die_with_parent`): torchrun gets SIGTERM when this process dies and stops
      its ranks itself; and ``WORKBENCH_SUPERVISOR`` (this process's token) in its environment makes every rank
      that imports ``workbench`` die with torchrun (:func:`workbench.launch.ownership.guard_rank`).

    One caller at a time per process: the cleanup ends every process below this one that was not there when it
    started, and the subreaper setting is the process's (the benchmarks launch one variant at a time)."""
    _subreaper(True)
    try:
        with _SigtermGuard() as guard:
            return _run_group(cmd, timeout, kw, guard)
    finally:
        _subreaper(False)


#: seconds torchrun's group is given after SIGTERM when this process itself is being ended (then SIGKILL)
TERMINATED_GRACE = 2.0


def _run_group(cmd: list[str], timeout: float, kw: dict[str, Any], guard: _SigtermGuard | None = None) -> subprocess.CompletedProcess:
    import signal

    from workbench.launch.ownership import SUPERVISOR_ENV, die_with_parent, supervisor_token

    kw = dict(kw)
    env = dict(kw.pop("env", None) or os.environ)
    env[SUPERVISOR_ENV] = supervisor_token()  # the ranks' guard_rank: die with torchrun, never outlive this process
    before = set(_descendants(os.getpid()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=die_with_parent(signal.SIGTERM), env=env, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as exc:  # the timeout, SIGTERM (_Terminated), or KeyboardInterrupt / SystemExit in the caller
        if guard is not None:
            guard.raising = False  # a SIGTERM from now on shortens the cleanup, never cuts it off
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

        terminated = isinstance(exc, _Terminated)

        def ending() -> bool:
            return terminated or (guard is not None and guard.received)

        start = time.monotonic()
        while proc.poll() is None:  # torchrun's own shutdown waits up to 30 s for its workers: 45 s, or ~2 s when ending
            if time.monotonic() - start >= (TERMINATED_GRACE if ending() else 45.0):
                break
            try:  # drain the pipes meanwhile (a descendant may hold them open: EOF is no sign here)
                proc.communicate(timeout=0.2 if ending() else 0.5)
            except subprocess.TimeoutExpired:
                pass
        if proc.returncode is None:
            proc.kill()
        _kill_new_descendants(before | {proc.pid})  # (proc itself: killed above, reaped by Popen)
        try:  # everything read so far, whichever call drained it (communicate keeps it)
            out, err = proc.communicate(timeout=2.0 if ending() else 10.0)
        except subprocess.TimeoutExpired:  # something outside our reach still holds the pipes: stop reading
            out = err = ""
            for pipe in (proc.stdout, proc.stderr):
                pipe.close()
            proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            exc.output, exc.stderr = out, err
        if guard is not None and guard.received and not isinstance(exc, _Terminated):
            raise _Terminated() from exc  # SIGTERM came during the cleanup of another exception: end as it asked
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _subreaper(on: bool) -> None:
    """While on, orphans of the processes this one starts are re-parented to it, not to init (Linux prctl;
    no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _kill_new_descendants(before: set[int], rounds: int = 50) -> None:
    """SIGKILL the descendants of this process not in ``before``, scanning afresh until none is left (a process
    may fork while the others die), reaping the ones that became its children."""
    import signal

    for _ in range(rounds):
        pids = [p for p in _descendants(os.getpid()) if p not in before]
        live = [p for p in pids if _state(p) not in ("Z", None)]
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:  # zombies that are our own children (orphans this process reaped as subreaper)
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not live:
            return
        time.sleep(0.2)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc), whatever its session."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _visible_uuids(exe: str) -> set[str] | None:
    """The UUIDs of the GPUs this process's ``CUDA_VISIBLE_DEVICES`` names (indices or UUIDs); None: every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return None
    done = subprocess.run([exe, "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True, text=True,
                          timeout=10)
    by_index = dict(tuple(f.strip() for f in line.split(",", 1)) for line in done.stdout.splitlines() if "," in line)
    names = [v.strip() for v in visible.split(",") if v.strip()]
    return {by_index.get(n, n) for n in names}


def gpu_strangers() -> list[dict[str, Any]]:
    """The processes that hold one of this process's GPUs (its ``CUDA_VISIBLE_DEVICES``, else every GPU) and are
    neither this process nor one of its descendants, as ``nvidia-smi --query-compute-apps`` lists them:
    ``[{"pid": int, "used_mib": int | None}]`` (None where nvidia-smi says ``[N/A]``).  A benchmark checks before
    each repeat: a process an earlier, killed call left behind (an orphaned rank held 74 GiB of a GPU through the
    next call's measurements) makes the repeat share the GPU; rows running side by side on other GPUs
    (bench/headline_call.sh) are not strangers.  ``[]`` where nvidia-smi is missing or fails (CPU machines); never
    raises."""
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            return []
        mine = _visible_uuids(exe)
        ours = {os.getpid(), *_descendants(os.getpid())}
        out = []
        for line in done.stdout.splitlines():
            parts = [f.strip() for f in line.split(",")]
            if len(parts) < 3 or not parts[1].isdigit():
                continue
            pid = int(parts[1])
            if pid in ours or (mine is not None and parts[0] not in mine):
                continue
            try:
                used: int | None = int(float(parts[2]))
            except ValueError:
                used = None
            out.append({"pid": pid, "used_mib": used})
        return out
    except Exception:  # noqa: BLE001  (a check, never the reason a benchmark fails)
        return []


def check_gpus(name: str) -> list[dict[str, Any]]:
    """:func:`gpu_strangers` before the repeat ``name``, with a warning on stderr when any process shares its GPUs."""
    import sys

    strangers = gpu_strangers()
    if strangers:
        print(f"[bench] WARNING: {len(strangers)} processes already on the GPUs before {name} "
              f"(pid, MiB: {[(s['pid'], s['used_mib']) for s in strangers]}); this repeat shares them",
              file=sys.stderr, flush=True)
    return strangers
