"""Two ``workbench launch`` invocations as two nodes: the real backend in CPU mode (gloo).

Each "node" is its own ``workbench launch --nnodes 2 --node-rank K --rdzv-endpoint 127.0.0.1:PORT``
process tree (CLI, supervisor, torchrun, one rank) on this machine, talking over loopback; the
two share one run directory, as nodes of a cluster share a filesystem (``workbench.run.nodes``).
The test side plays the notebook: ``Run.attach`` on the shared directory follows both nodes.

- the two nodes train the tiny GPT exactly like one node with two processes (DP=2): same losses;
- a rank of node 1 SIGKILLed (an OOM kill): node 0 stops too, in seconds, both CLIs exit 1, and
  the run reports rank 1 on node 1 as the cause (node 0's "connection closed by peer" is a symptom);
- node 1 frozen whole (SIGSTOP: a hung host, a network partition; gloo would wait 600 s): node 0's
  supervisor misses node 1's heartbeat and stops node 0 in bounded time, reporting node 1 as lost;
- no process of either node is left behind.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from workbench.config import preset
from workbench.launch import Run
from workbench.launch.processes import rank_processes

from tests.support import ROOT, living, run_processes, wait_until

pytestmark = pytest.mark.slow

#: seconds without a heartbeat before a node counts as lost (the product's default is 60)
NODE_TIMEOUT = 8


def _cfg(iters: int):
    return preset("tiny").replace(**{
        "parallel.device": "cpu", "parallel.nnodes": 2, "parallel.nproc_per_node": 1, "train.train_iters": iters,
        "train.lr_warmup_iters": 2, "train.eval_interval": 0, "checkpoint.save_on_exit": False,
    })


def _launch_node(cfg_file: Path, run_dir: Path, node: int, port: int, out: Path, *extra: str) -> subprocess.Popen:
    """``workbench launch`` of one node, in the foreground (it follows the run and exits with its status)."""
    cmd = [sys.executable, "-m", "workbench.cli", "launch", str(cfg_file), "--nnodes", "2", "--nproc-per-node", "1",
           "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-dir", str(run_dir), *extra]
    with open(out, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    proc.out = out  # its terminal, for a failure's message
    return proc


def _attach(run_dir: Path, *nodes: subprocess.Popen) -> Run:
    """``Run.attach`` once node 0 has written its launch files; a node that exits before then fails the test at once,
    with what its terminal showed."""

    def attached() -> Run | None:
        if (run_dir / "launch.json").exists():
            return Run.attach(run_dir)
        for n in nodes:
            if n.poll() is not None:
                raise AssertionError(f"{n.out.name}: `workbench launch` exited ({n.returncode}) before node 0's launch "
                                     f"files appeared:\n{n.out.read_text()[-3000:]}")
        return None

    try:
        return wait_until(attached, 180, "node 0's launch files")
    except AssertionError as e:
        shown = "".join(f"\n--- {n.out.name}:\n{n.out.read_text()[-2000:]}" for n in nodes)
        raise AssertionError(f"{e}{shown}") from None


def _steps_of_both(run: Run, n: int) -> bool:
    steps = run.steps
    return len(steps) > 0 and all((steps["rank"] == r).sum() >= n for r in (0, 1))


def _node1_processes(run_dir: Path, roles=("supervisor", "torchrun", "rank", "child")) -> list[psutil.Process] | None:
    """Node 1's living processes of these roles, from its own launch.json; None until its supervisor, torchrun and a
    rank are recorded and alive."""
    meta = json.loads((run_dir / "nodes" / "node-1" / "launch.json").read_text())
    records = [{"pid": meta["supervisor_pid"], "role": "supervisor"}, *meta.get("processes", [])]
    if not any(r["role"] == "rank" for r in records):
        return None
    procs, alive = [], set()
    for r in records:
        if r["role"] in roles:
            try:
                procs.append(psutil.Process(r["pid"]))
                alive.add(r["role"])
            except psutil.NoSuchProcess:  # a recorded process that has already ended (the record stays; torchrun's
                continue                  # short-lived children count as "rank" too): nothing to freeze
    # None (asked again) until the node's supervisor, torchrun and a rank are recorded and alive
    return procs if {"supervisor", "torchrun", "rank"} & set(roles) <= alive else None


def _cleanup(run_dir: Path, *clis: subprocess.Popen) -> None:
    for p in living(run_processes(run_dir)):
        try:
            p.send_signal(signal.SIGCONT)
            p.kill()
        except psutil.NoSuchProcess:
            pass
    for c in clis:
        if c.poll() is None:
            c.kill()
        c.wait(timeout=10)


def test_two_nodes_train_like_one_node_and_one_run_follows_both(tmp_path, free_port):
    cfg = _cfg(24)
    cfg_file = cfg.save(tmp_path / "two-nodes.json")

    # the reference: one node with two processes (the same world size, DP=2), in its own run directory and on its own
    # rendezvous; it runs beside the two nodes (their start-up is mostly waiting: process starts, rendezvous, polls)
    ref = Run.launch(cfg.replace(**{"parallel.nnodes": 1, "parallel.nproc_per_node": 2}), tmp_path / "one-node")
    shared = tmp_path / "shared"
    n0 = n1 = None
    try:
        # node 1 first: it creates the shared directory and waits for node 0 at the rendezvous
        n1 = _launch_node(cfg_file, shared, 1, free_port, tmp_path / "node1.out")
        n0 = _launch_node(cfg_file, shared, 0, free_port, tmp_path / "node0.out")
        run = _attach(shared, n0, n1)  # the notebook side, attached to the run directory both nodes write
        live: dict = {}

        def both_training() -> bool:
            if run.status != "running" or not _steps_of_both(run, 1):
                return False
            live["nodes"] = [(v["node"], v["status"], v["ranks"]) for v in run.nodes()]
            live["alive"] = run.is_alive()
            return True

        wait_until(both_training, 300, "both nodes' ranks training, seen live", poll=0.2)
        assert live == {"nodes": [(0, "running", [0]), (1, "running", [1])], "alive": True}, live
        assert n1.wait(timeout=300) == 0, (tmp_path / "node1.out").read_text()[-3000:]
        assert n0.wait(timeout=60) == 0, (tmp_path / "node0.out").read_text()[-3000:]
        assert ref.wait(timeout=300) == "finished", ref.failure
    finally:
        if ref.is_alive():
            ref.stop(grace=2)
        _cleanup(shared, *(n for n in (n0, n1) if n is not None))
    ref_loss = dict(zip(ref.train_loss["iteration"], ref.train_loss["loss"]))
    assert sorted(ref_loss) == list(range(1, 25))

    for out in ("node0.out", "node1.out"):  # each node's terminal shows the whole job
        text = (tmp_path / out).read_text()
        assert "iteration 24: loss" in text and f"run finished: {shared}" in text, text[-2000:]
        assert "node 0 (" in text and "node 1 (" in text
    assert run.status == "finished" and not run.is_alive()
    assert [(v["node"], v["status"]) for v in run.nodes()] == [(0, "finished"), (1, "finished")]
    starts = sorted(run.events("run_start"), key=lambda e: e.rank)
    assert [(e.rank, e.world_size, e.coords["dp"]) for e in starts] == [(0, 2, 0), (1, 2, 1)]

    # same losses as the single node of the same world size, iteration by iteration
    loss = dict(zip(run.train_loss["iteration"], run.train_loss["loss"]))
    assert sorted(loss) == sorted(ref_loss)
    for it, want in ref_loss.items():
        assert math.isfinite(want) and abs(loss[it] - want) <= 1e-6 * abs(want), (it, loss[it], want)

    # one run directory, each node's launch files its own
    m0 = json.loads((shared / "launch.json").read_text())
    m1 = json.loads((shared / "nodes" / "node-1" / "launch.json").read_text())
    assert (m0["node_rank"], m1["node_rank"]) == (0, 1) and m0["supervisor_pid"] != m1["supervisor_pid"]
    for d in (shared, shared / "nodes" / "node-1"):
        assert json.loads((d / "exit_status.json").read_text())["status"] == "finished"
        assert (d / "logs" / "launcher.log").stat().st_size > 0 and (d / "heartbeat.json").exists()
    assert run.rank_log(1).is_relative_to(shared / "nodes" / "node-1" / "logs" / "torchrun")
    assert run.rank_log(0).is_relative_to(shared / "logs" / "torchrun")
    assert sorted(p.name for p in (shared / "events").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    assert living(run_processes(shared)) == []


def test_a_rank_killed_on_node_1_stops_node_0_and_is_reported(tmp_path, free_port):
    cfg_file = _cfg(100000).save(tmp_path / "long.json")
    shared = tmp_path / "shared"
    n0 = _launch_node(cfg_file, shared, 0, free_port, tmp_path / "node0.out")
    n1 = _launch_node(cfg_file, shared, 1, free_port, tmp_path / "node1.out")
    try:
        run = _attach(shared, n0, n1)
        wait_until(lambda: _steps_of_both(run, 2), 300, "both nodes training", poll=0.3)
        # the 'rank' records include torchrun's short-lived children: keep the training rank among them
        ranks = wait_until(lambda: rank_processes(_node1_processes(shared, ("rank",)) or ()), 20,
                           "node 1's rank in its launch.json")
        rank = next(iter(ranks.values()))
        assert "workbench.rank" in " ".join(rank.cmdline()) and rank.environ()["RANK"] == "1"
        rank.send_signal(signal.SIGKILL)  # what the kernel's OOM killer does
        t0 = time.time()
        assert run.wait(timeout=90) == "failed"
        took = time.time() - t0
        assert took < 60, f"the job took {took:.0f}s to end after node 1 lost its rank"
        assert n0.wait(timeout=30) == 1 and n1.wait(timeout=30) == 1
    finally:
        _cleanup(shared, n0, n1)
    print(f"both nodes down {took:.1f}s after node 1's rank was SIGKILLed")

    f = run.failure
    assert (f.rank, f.node) == (1, 1), f
    assert "-9" in f.message and "SIGKILL" in f.message, f.message
    views = {v["node"]: v for v in run.nodes()}
    assert views[0]["status"] == views[1]["status"] == "failed"
    assert "rank 1" in views[1]["why"] and "lost its peers" in views[0]["why"], views
    ex1 = json.loads((shared / "nodes" / "node-1" / "exit_status.json").read_text())
    assert (ex1["failed_rank"], ex1["failed_exitcode"], ex1["node"]) == (1, -9, 1)
    for out in ("node0.out", "node1.out"):  # both terminals name the cause
        text = (tmp_path / out).read_text()
        assert "rank 1 (node 1) failed: exited with code -9" in text and "run failed" in text, text[-2000:]
    assert wait_until(lambda: not living(run_processes(shared)), 15, "no process of either node left")


def test_a_frozen_node_is_declared_lost_and_the_other_stops_in_bounded_time(tmp_path, free_port):
    cfg_file = _cfg(100000).save(tmp_path / "long.json")
    shared = tmp_path / "shared"
    n0 = _launch_node(cfg_file, shared, 0, free_port, tmp_path / "node0.out", "--node-timeout", str(NODE_TIMEOUT))
    n1 = _launch_node(cfg_file, shared, 1, free_port, tmp_path / "node1.out", "--node-timeout", str(NODE_TIMEOUT))
    frozen: list[psutil.Process] = []
    try:
        run = _attach(shared, n0, n1)
        wait_until(lambda: _steps_of_both(run, 2), 300, "both nodes training", poll=0.3)
        frozen = wait_until(lambda: _node1_processes(shared), 20, "node 1's supervisor, torchrun and rank")
        assert len(frozen) >= 3
        for p in frozen:  # node 1 hangs whole: its sockets stay open, so gloo alone would wait out its timeout
            p.send_signal(signal.SIGSTOP)
        t0 = time.time()
        wait_until(lambda: run.exit_status is not None, 120, "node 0 to give up on the silent node 1", poll=0.2)
        took = time.time() - t0
        ex0 = run.exit_status
        assert ex0["status"] == "failed" and ex0["reason"] == "peer-lost" and ex0["peer"]["node"] == 1, ex0
        assert run.status == "failed"
        f = run.failure
        assert f.node == 1 and f.rank is None and "no heartbeat" in f.message, f
        assert living(frozen) == frozen  # node 0's side stopped only its own processes
        # the heartbeat timeout, the supervisor's 10 s grace for a rank stuck in a collective, a margin for a busy machine
        assert took < NODE_TIMEOUT + 10 + 25, f"node 0 took {took:.0f}s to stop after node 1 froze"
        print(f"node 0 stopped {took:.1f}s after node 1 froze")

        for p in frozen:  # node 1 comes back: it finds node 0 gone and ends too
            p.send_signal(signal.SIGCONT)
        assert run.wait(timeout=90) == "failed"
        assert n0.wait(timeout=30) == 1 and n1.wait(timeout=30) == 1
        assert run.failure.node == 1 and "no heartbeat" in run.failure.message
        assert "no heartbeat" in (tmp_path / "node0.out").read_text()
        assert wait_until(lambda: not living(run_processes(shared)), 15, "no process of either node left")
    finally:
        _cleanup(shared, n0, n1)  # SIGCONT + SIGKILL for anything a failed assertion left
