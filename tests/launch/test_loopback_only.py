"""One-node work listens on the loopback only: nothing of a training run, of generation's ranks or of
conversion's process group accepts connections from the network.

torch's TCPStore server listens on every interface whatever host it is given; the workbench runs
torchrun through ``workbench.launch.torchrun`` (its stores bound to 127.0.0.1) and sets up one-process
groups on an in-memory store.  Real supervisor, torchrun, backend (CPU mode, 2 ranks, the tiny
preset) and generation ranks; every LISTEN socket of their process trees is sampled while they run.
"""

from __future__ import annotations

import os
import threading

import psutil
import pytest

from workbench.config import preset
from workbench.launch.processes import rank_processes
from workbench.launch import Run
from workbench.launch.stores import loopback_interface

from tests.support import living, run_processes, wait_until

pytestmark = pytest.mark.slow

LOOPBACK = {"127.0.0.1", "::1"}


def _listeners(procs) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every listening TCP socket of ``procs``."""
    out = []
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())[:100]
            out += [(p.pid, cmd, c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


class _Sampler:
    """Every listening socket of this process's descendants, sampled until stopped; the commands seen."""

    def __init__(self):
        self.seen: set[tuple[int, str, str, int]] = set()
        self.commands: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        me = psutil.Process()
        while not self._done.is_set():
            kids = me.children(recursive=True)
            for p in kids:
                try:
                    self.commands.add(" ".join(p.cmdline()))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.seen.update(_listeners(kids))
            self._done.wait(0.1)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(timeout=10)


def _not_loopback(found) -> list:
    return [x for x in found if x[2] not in LOOPBACK]


def test_a_one_node_run_and_generation_from_it_listen_on_the_loopback_only(tmp_path):
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 2, "train.train_iters": 100000,
                                    "train.lr_warmup_iters": 1, "train.eval_interval": 0})
    run = Run.launch(cfg, run_root=tmp_path / "runs")
    try:
        wait_until(lambda: len({e.rank for e in run.events("step")}) == 2, 300, "both ranks training")
        procs = run.processes()
        found = _listeners(procs)
        assert found and not _not_loopback(found), found  # torchrun's stores and gloo's sockets, on 127.0.0.1
        ranks = rank_processes(procs)
        assert len(ranks) == 2
        lo = loopback_interface()
        for p in ranks.values():  # the collectives' sockets are asked for on the loopback interface
            if "GLOO_SOCKET_IFNAME" not in os.environ:
                assert p.environ().get("GLOO_SOCKET_IFNAME") == lo
        assert run.stop(grace=30) == "stopped"  # saves a checkpoint on the way out
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()
    ckpt = run.run_dir / "checkpoints"
    assert ckpt.is_dir()

    from workbench.generation import generate

    for tp in (2, 1):  # torchrun's ranks; one plain process with its private group
        with _Sampler() as s:
            out = generate(ckpt, prompt_ids=[[1, 2, 3]], max_new_tokens=2, tp=tp, device="cpu", timeout=300)
        assert len(out) == 1
        assert any("workbench.rank.inference" in c for c in s.commands), s.commands  # the sampler saw the ranks
        assert not _not_loopback(s.seen), s.seen
        if tp == 2:
            assert any("workbench.launch.torchrun" in cmd for _, cmd, _, _ in s.seen), s.seen  # torchrun's store, on 127.0.0.1


def test_conversion_s_process_group_listens_on_the_loopback_only():
    from workbench.models.common.one_process import single_process_group

    before = set(_listeners([psutil.Process()]))
    with single_process_group():
        opened = set(_listeners([psutil.Process()])) - before
    assert not _not_loopback(opened), opened


def test_calibrate_s_ranks_listen_on_the_loopback_only(tmp_path):
    """``workbench calibrate --cpu`` (2 gloo ranks under torchrun, the links measured between them): its stores and
    the ranks' sockets are on 127.0.0.1, started through the workbench's torchrun entry."""
    from workbench.advisor.profile import load_profile
    from workbench.cli import main

    cfg = preset("tiny").save(tmp_path / "tiny.json")
    out = tmp_path / "cal.json"
    with _Sampler() as s:
        rc = main(["calibrate", str(cfg), "--cpu", "--nproc", "2", "--iters", "2", "--gpu", "H100-80GB",
                   "--out", str(out), "--timeout", "300"])
    assert rc == 0
    assert load_profile(out).collectives["all_reduce"]  # the ranks did talk to each other
    assert any("workbench.advisor.measure" in c for c in s.commands), s.commands  # the sampler saw the ranks
    assert any("workbench.launch.torchrun" in c for c in s.commands), s.commands
    assert not any("torch.distributed.run" in c for c in s.commands), s.commands
    assert s.seen and not _not_loopback(s.seen), s.seen
