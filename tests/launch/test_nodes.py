"""A multi-node run's files without processes: node directories, heartbeats, the supervisors' watch
over the other nodes, the checks of a shared run directory, and ``Run`` over nodes on other hosts.
(The real two-node runs are in ``tests/launch/test_multinode.py``.)"""

from __future__ import annotations

import json
import time

import pytest

from workbench.cli import main
from workbench.config import preset
from workbench.launch import Run, launch_checks, write_exit_status
from workbench.launch.exit_status import lost_peer
from workbench.launch.nodes import HeartbeatClock, PeerWatch, write_heartbeat
from workbench.run.events import EventWriter
from workbench.run.files import write_json_atomic
from workbench.run.nodes import node_dir


def _cfg(**over):
    return preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nnodes": 2, "parallel.nproc_per_node": 1, **over})


def test_node_directories(tmp_path):
    assert node_dir(tmp_path, 0) == tmp_path
    assert node_dir(tmp_path, 3) == tmp_path / "nodes" / "node-3"


def test_lost_peer_tells_symptoms_from_causes():
    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
            "[127.0.0.1]:16517. This is typically caused by a remote worker crashing.")
    assert lost_peer(gloo, "RuntimeError")
    assert lost_peer("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 600000ms for recv operation to complete")
    assert lost_peer("failed to recv, got 0 bytes", "torch.distributed.DistNetworkError")
    assert not lost_peer("CUDA out of memory. Tried to allocate 2.00 GiB", "torch.OutOfMemoryError")
    assert not lost_peer("bad shard index 7 on rank 1", "ValueError")
    assert not lost_peer(None)


def test_peer_watch_judges_a_silent_node_by_its_heartbeat(tmp_path):
    d1 = node_dir(tmp_path, 1)
    d1.mkdir(parents=True)
    w = PeerWatch(tmp_path, 0, 2, timeout=5, grace=2)
    assert w.check(now=100.0) is None  # node 1 not started yet: the rendezvous waits for it, not us
    write_heartbeat(d1, 1, 1)
    assert w.check(now=100.0) is None
    assert w.check(now=104.0) is None
    write_heartbeat(d1, 1, 2)  # it beats again: fresh
    assert w.check(now=108.0) is None
    reason, peer = w.check(now=113.5)
    assert reason == "peer-lost" and peer["node"] == 1 and "no heartbeat for 6 s" in peer["why"]


def test_peer_watch_never_trusts_another_host_clock(tmp_path):
    d1 = node_dir(tmp_path, 1)
    d1.mkdir(parents=True)
    write_json_atomic(d1 / "heartbeat.json", {"node": 1, "seq": 7, "time": time.time() - 3600, "host": "b"})  # a clock 1 h behind
    w = PeerWatch(tmp_path, 0, 2, timeout=5, grace=2)
    assert w.check() is None  # the supervisors measure change on their own clock
    assert HeartbeatClock(trust_clock=True).age(1, json.loads((d1 / "heartbeat.json").read_text())) > 3500  # a notebook's first look


def test_peer_watch_follows_another_node_that_failed_or_stopped(tmp_path):
    d1 = node_dir(tmp_path, 1)
    d1.mkdir(parents=True)
    write_json_atomic(d1 / "exit_status.json", {"status": "finished"})
    w = PeerWatch(tmp_path, 0, 2, timeout=5, grace=2)
    assert w.check(now=10.0) is None and w.check(now=1000.0) is None  # finished: its heartbeat stops, as it should
    write_json_atomic(d1 / "exit_status.json", {"status": "failed", "failed_rank": 1})
    assert w.check(now=1000.0) is None  # torch usually tears this node down first: give it the grace
    reason, peer = w.check(now=1002.5)
    assert reason == "peer-failed" and peer == {"node": 1, "status": "failed", "failed_rank": 1, "why": "node 1 failed (rank 1)", "host": None}
    write_json_atomic(d1 / "exit_status.json", {"status": "stopped"})
    w = PeerWatch(tmp_path, 0, 2, timeout=5, grace=0)
    assert w.check()[0] == "peer-stopped"


def test_a_shared_run_directory_takes_each_node_once_and_one_config(tmp_path):
    cfg = _cfg()
    shared = tmp_path / "shared"
    ok = dict(rdzv_endpoint="127.0.0.1:29500", local=False)
    assert launch_checks(cfg, run_dir=shared, node_rank=1, **ok) == []
    cfg.save(shared / "config.json")  # node 0 got there first
    write_json_atomic(shared / "launch.json", {"node_rank": 0})
    assert launch_checks(cfg, run_dir=shared, node_rank=1, **ok) == []
    again = launch_checks(cfg, run_dir=shared, node_rank=0, **ok)
    assert [p.field for p in again] == ["run_dir"] and "already launched" in again[0].rule
    other = launch_checks(_cfg(**{"train.lr": 0.01}), run_dir=shared, node_rank=1, **ok)
    assert [p.field for p in other] == ["run_dir"] and "train.lr" in other[0].rule and "same config" in other[0].fix
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert [p.field for p in launch_checks(cfg, run_dir=foreign, node_rank=1, **ok)] == ["run_dir"]
    # another node caught between making its folders and writing config.json (all nodes started at once)
    racing = tmp_path / "racing"
    for sub in ("events", "logs", "nodes/node-1"):
        (racing / sub).mkdir(parents=True)
    (racing / ".config.json.tmp-4242").write_text("{")
    assert launch_checks(cfg, run_dir=racing, node_rank=0, **ok) == []


@pytest.mark.parametrize("args, field", [
    (["--node-rank", "1", "--rdzv-endpoint", "127.0.0.1"], "rdzv_endpoint"),
    (["--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500", "--node-timeout", "0"], "node_timeout"),
    (["--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:29500"], "node_rank"),
    (["--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500", "--no-run-dir"], "--run-dir"),
])
def test_cli_refuses_bad_node_input_before_anything_starts(tmp_path, capsys, args, field):
    f = _cfg().save(tmp_path / "two.json")
    rd = tmp_path / "shared"
    run_dir = [] if "--no-run-dir" in args else ["--run-dir", str(rd)]
    args = [a for a in args if a != "--no-run-dir"]
    assert main(["launch", str(f), *args, *run_dir, "--run-root", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert field in err and "->" in err, err
    assert not rd.exists() and not (tmp_path / "runs").exists()


def _node_files(run_dir, k, host, **launch):
    d = node_dir(run_dir, k)
    d.mkdir(parents=True, exist_ok=True)
    write_json_atomic(d / "launch.json", {"command": ["torchrun"], "nproc_per_node": 1, "nnodes": 2, "node_rank": k,
                                          "host": host, "started": time.time() - 100, **launch})
    return d


def test_run_follows_nodes_on_other_hosts_by_their_heartbeats(tmp_path):
    shared = tmp_path / "shared"
    _cfg().save(shared / "config.json")
    d0 = _node_files(shared, 0, "host-a")
    d1 = _node_files(shared, 1, "host-b")
    for r in (0, 1):
        with EventWriter(shared, r) as w:
            w.emit("run_start", world_size=2)
            w.emit("step", iteration=1, loss=8.0)
    write_heartbeat(d0, 0, 5)
    write_heartbeat(d1, 1, 5)
    run = Run.attach(shared)
    assert run.status == "running" and run.is_alive()
    assert [(v["node"], v["status"], v["local"]) for v in run.nodes()] == [(0, "running", False), (1, "running", False)]

    write_json_atomic(d1 / "heartbeat.json", {"node": 1, "seq": 9, "time": time.time() - 300, "host": "host-b"})
    run = Run.attach(shared)
    views = run.nodes()
    assert views[1]["status"] == "lost" and "no heartbeat for 300 s" in views[1]["why"]
    assert run.status == "failed"
    f = run.failure
    assert (f.rank, f.node, f.source) == (None, 1, "node") and "node 1 lost" in str(f)

    # node 0's supervisor gave up on node 1 (and said so), then ended
    write_exit_status(shared, 0, reason="peer-lost", node_rank=0, peer={"node": 1, "status": "lost", "why": "node 1 (host-b) sent no heartbeat for 60 s"})
    write_json_atomic(d0 / "heartbeat.json", {"node": 0, "seq": 9, "time": time.time() - 200, "host": "host-a"})
    run = Run.attach(shared)
    assert run.exit_status["status"] == "failed" and run.exit_status["node"] == 0 and run.exit_status["ranks"] == [0]
    assert not run.is_alive() and run.status == "failed"
    assert [v["status"] for v in run.nodes()] == ["failed", "lost"]
    assert run.failure.node == 1


ROOT_CAUSE = """\
============================================================
workbench.rank FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_22:58:59
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""


def test_a_node_exit_status_names_its_own_ranks(tmp_path):
    shared = tmp_path / "shared"
    d1 = _node_files(shared, 1, "host-b", nproc_per_node=2)
    (d1 / "logs").mkdir()
    (d1 / "logs" / "launcher.log").write_text("[supervisor] ...\n" + ROOT_CAUSE)
    with EventWriter(shared, 0) as w:  # node 0's rank saw its peer vanish first: a symptom, not node 1's cause
        w.emit("error", message="Connection closed by peer [127.0.0.1]:1234", exception="RuntimeError")
    ex = write_exit_status(shared, 1, node_rank=1)
    assert (d1 / "exit_status.json").exists() and not (shared / "exit_status.json").exists()
    assert (ex["status"], ex["failed_rank"], ex["failed_exitcode"], ex["node"], ex["ranks"]) == ("failed", 3, -9, 1, [2, 3])
    assert ex["failed_message"] == "Signal 9 (SIGKILL) received by PID 4242"


def test_ranks_that_agreed_to_stop_with_another_node_are_stopped_not_failed(tmp_path):
    shared = tmp_path / "shared"
    _node_files(shared, 1, "host-b", nproc_per_node=2)
    for r in (2, 3):  # node 0 was stopped; every rank agreed on the step and left with 143, which torchrun calls a failure
        with EventWriter(shared, r) as w:
            w.emit("run_end", status="stopped", iteration=7, exit_code=143)
    assert write_exit_status(shared, 1, node_rank=1)["status"] == "stopped"
    with EventWriter(shared, 3) as w:
        w.emit("error", message="bad shard", exception="ValueError")
    assert write_exit_status(shared, 1, node_rank=1)["status"] == "failed"
