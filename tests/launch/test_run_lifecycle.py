"""A run's lifecycle against real processes: real torchrun, real supervisor, a tiny rank script.

The rank script (``tests.support.RANK_SCRIPT``, written by the ``rank_script`` fixture in
conftest.py) stands in for ``workbench.rank`` at the process boundary only: it
writes the event stream through the real :class:`workbench.run.events.EventWriter` the way a
rank does, with behaviours the tests need (partial lines, failures, ignoring SIGTERM).
Tests against the real backend live in ``test_run_real_backend.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workbench.launch import Run
from workbench.config import ConfigError, preset

from tests.support import free_port, run_processes, wait_until

pytestmark = pytest.mark.slow


def _cfg(nproc: int, iters: int = 4):
    return preset("tiny").replace(**{"parallel.nproc_per_node": nproc, "train.train_iters": iters,
                                     "train.lr_warmup_iters": 1})


def launch(rank_script: Path, tmp_path: Path, mode: str, nproc: int, **kw) -> Run:
    return Run.launch(_cfg(nproc, kw.pop("iters", 4)), run_root=tmp_path / "runs", entry=[str(rank_script)],
                      env={"FAKE_MODE": mode}, **kw)


def test_partial_lines_status_transitions_frames_and_reattach(rank_script, tmp_path):
    run = launch(rank_script, tmp_path, "partial", 2)
    seen = [run.status]
    assert seen[0] == "starting"
    assert json.loads((run.run_dir / "config.json").read_text())["parallel"]["nproc_per_node"] == 2
    (run.run_dir / "go-start").touch()
    ev = run.run_dir / "events" / "rank-0.jsonl"
    # rank 0 has written exactly one complete step and half of the second
    wait_until(lambda: ev.exists() and not ev.read_bytes().endswith(b"\n"), 40, "a partial line")
    seen.append(run.status)
    assert run.steps.query("rank == 0")["iteration"].tolist() == [1]  # the half line is not parsed (nor lost)
    assert run.reader.bad_lines == 0
    (run.run_dir / "go-rest").touch()
    assert run.wait(timeout=40) == "finished"
    seen.append(run.status)
    assert seen == ["starting", "running", "finished"]
    assert run.steps.query("rank == 0")["iteration"].tolist() == [1, 2, 3, 4]
    assert sorted(run.steps["rank"].unique().tolist()) == [0, 1]
    assert run.train_loss["loss"].tolist() == pytest.approx([4.0, 2.0, 4 / 3, 1.0])
    assert run.evals["loss"].tolist() == [2.0]
    mem = run.memory.set_index("rank")
    assert mem.loc[1, "mem_reserved"] == 4000 and mem.loc[0, "mem_allocated"] == 1000
    assert run.exit_status["status"] == "finished" and run.exit_status["returncode"] == 0
    assert run.progress()[:2] == (4, 4)
    assert run.failure is None
    # per-rank logs captured by torchrun in the run dir
    assert run.rank_log(0, "stdout") is not None and run.rank_log(1, "stderr") is not None
    assert not run_processes(run.run_dir)
    # re-attach (a new kernel, a finished run): same frames, same status
    again = Run.attach(run.run_dir)
    assert again.status == "finished"
    assert again.steps.equals(run.steps)
    assert again.final_metrics()["train_loss"] == pytest.approx(1.0)
    with pytest.raises(FileNotFoundError):
        Run.attach(tmp_path / "nope")


def test_stop_from_reattached_run_escalates_and_leaves_no_process(rank_script, tmp_path):
    run = launch(rank_script, tmp_path, "hang", 2, grace=1.5)  # the ranks ignore SIGTERM
    wait_until(lambda: len(run.events("run_start")) == 2, 40, "both ranks to start")
    procs = run_processes(run.run_dir)
    assert len(procs) >= 4  # supervisor, torchrun, two ranks
    # a second notebook re-attaches to the still-running run and stops it
    other = Run.attach(run.run_dir)
    assert other.status == "running" and other.is_alive()
    t0 = time.time()
    assert other.stop(grace=1.5) == "stopped"
    assert time.time() - t0 < 20
    assert run_processes(run.run_dir) == []
    assert other.exit_status["status"] == "stopped"
    run._reap()
    assert run.status == "stopped" and not run.is_alive()


def test_failure_surfaces_rank_and_traceback_and_stops_job(rank_script, tmp_path):
    run = launch(rank_script, tmp_path, "fail", 2)
    wait_until(lambda: run.events("error"), 40, "the error event")
    t0 = time.time()
    assert run.status == "failed"
    f = run.failure
    assert f.rank == 1 and f.source == "event"
    assert "boom on rank 1" in f.message and "Traceback" in f.traceback
    # rank 0 would block forever; the job must still be torn down, within seconds
    assert run.wait(timeout=20) == "failed"
    assert time.time() - t0 < 20
    wait_until(lambda: not run_processes(run.run_dir), 10, "no processes")
    ex = json.loads((run.run_dir / "exit_status.json").read_text())
    assert ex["status"] == "failed" and ex["failed_rank"] == 1 and ex["returncode"] != 0


def test_crash_without_error_event_uses_stderr(rank_script, tmp_path):
    run = launch(rank_script, tmp_path, "crash", 2)
    assert run.wait(timeout=40) == "failed"
    f = run.failure
    assert f.rank == 1 and f.source == "stderr"
    assert "ValueError: bad shard index 7 on rank 1" in f.traceback
    assert f.log_path and Path(f.log_path).exists()
    assert "bad shard index" in run.log_tail(1)
    assert not run_processes(run.run_dir)


def test_dead_kernel_leaves_no_orphans(rank_script, tmp_path):
    """A killed kernel (SIGKILL: no atexit) must not leave the run's processes behind."""
    kernel = textwrap.dedent(
        f'''
        import sys, time
        from workbench.launch import Run
        from workbench.config import preset
        cfg = preset("tiny").replace(**{{"parallel.nproc_per_node": 2}})
        run = Run.launch(cfg, run_root={str(tmp_path / "runs")!r}, entry=[{str(rank_script)!r}], env={{"FAKE_MODE": "slow"}})
        print(run.run_dir, flush=True)
        time.sleep(600)
        '''
    )
    k = subprocess.Popen([sys.executable, "-c", kernel], stdout=subprocess.PIPE, text=True)
    try:
        run_dir = Path(k.stdout.readline().strip())
        run = Run.attach(run_dir)
        wait_until(lambda: len(run.events("run_start")) == 2, 40, "both ranks to start")
        assert len(run_processes(run_dir)) >= 4
        k.send_signal(signal.SIGKILL)
        k.wait()
        wait_until(lambda: not run_processes(run_dir), 15, "the run's processes to go after the kernel died")
        assert run.status == "stopped"
        assert run.exit_status["reason"] == "kernel-exited"
    finally:
        if k.poll() is None:
            k.kill()
            k.wait()


def test_invalid_config_refused_before_anything_starts(rank_script, tmp_path):
    cfg = preset("tiny").replace(**{"parallel.tensor_parallel": 3, "parallel.nproc_per_node": 2})
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as ei:
        Run.launch(cfg, run_root=root, entry=[str(rank_script)], env={"FAKE_MODE": "ok"})
    fields = {p.field for p in ei.value.problems}
    assert "parallel.tensor_parallel" in fields
    assert not root.exists()
    cuda = preset("gpt2-small").replace(**{"parallel.device": "cuda"})
    if not os.path.exists("/dev/nvidia0"):
        with pytest.raises(ConfigError, match="no NVIDIA GPU"):
            Run.launch(cuda, run_root=root)
        assert not root.exists()


def test_kernel_exit_stops_its_runs_via_atexit(rank_script, tmp_path):
    """A kernel that shuts down normally (restart, papermill's end) stops the runs it launched."""
    kernel = textwrap.dedent(
        f'''
        import time
        from workbench.launch import Run
        from workbench.config import preset
        run = Run.launch(preset("tiny"), run_root={str(tmp_path / "runs")!r}, entry=[{str(rank_script)!r}], env={{"FAKE_MODE": "slow"}})
        print(run.run_dir, flush=True)
        while not run.events("step"):
            time.sleep(0.1)
        '''
    )
    k = subprocess.run([sys.executable, "-c", kernel], capture_output=True, text=True, timeout=120)
    assert k.returncode == 0, k.stderr
    run_dir = Path(k.stdout.splitlines()[0])
    assert run_processes(run_dir) == []
    ex = json.loads((run_dir / "exit_status.json").read_text())
    assert ex["status"] == "stopped" and ex["reason"] == "stopped"  # stopped by Run.stop, not by the orphan watchdog


def test_two_nodes_on_one_machine_rendezvous(rank_script, tmp_path):
    """The multi-node torchrun arguments really rendezvous: two 'nodes' (static rendezvous) on localhost."""
    port = free_port()
    cfg = preset("tiny").replace(**{"parallel.nnodes": 2, "parallel.nproc_per_node": 1, "train.train_iters": 3, "train.lr_warmup_iters": 1})
    with pytest.raises(ConfigError, match="rendezvous endpoint"):
        Run.launch(cfg, run_root=tmp_path / "runs", entry=[str(rank_script)])
    nodes = [Run.launch(cfg, run_root=tmp_path / f"node{r}", node_rank=r, rdzv_endpoint=f"127.0.0.1:{port}",
                        entry=[str(rank_script)], env={"FAKE_MODE": "ok"}) for r in (0, 1)]
    for r, node in enumerate(nodes):
        assert node.wait(timeout=60) == "finished"
        start = node.events("run_start")
        assert [e["rank"] for e in start] == [r] and start[0]["world_size"] == 2  # global rank = node_rank * nproc + local
        assert node.rank_log(r, "stdout") is not None and node.rank_log(1 - r) is None
        assert (node.run_dir / "slurm.sbatch").exists()
        assert not run_processes(node.run_dir)


def test_bad_data_and_checkpoint_paths_refused_before_anything_starts(rank_script, tmp_path):
    root = tmp_path / "runs"
    cfg = preset("tiny").replace(**{
        "data.source": "indexed",
        "data.datasets": [{"prefix": str(tmp_path / "nowhere" / "corpus_text_document"), "weight": 1.0}],
        "checkpoint.load_dir": str(tmp_path / "no-such-checkpoint"),
    })
    assert cfg.validate() == []  # well-formed: only the paths are wrong
    with pytest.raises(ConfigError) as ei:
        Run.launch(cfg, run_root=root, entry=[str(rank_script)], env={"FAKE_MODE": "ok"})
    fields = {p.field for p in ei.value.problems}
    assert "checkpoint.load_dir" in fields
    assert any(f.startswith("data.datasets") for f in fields), fields
    assert "nowhere" in str(ei.value)
    assert not root.exists()


def _fake_checkpoint(root: Path, cfg, *, has_optimizer: bool) -> Path:
    """A checkpoint as save_checkpoint writes it: its metadata, and a small but well-formed torch
    dist checkpoint (the pre-launch check verifies the files' index without loading tensors) holding as many
    parameters as ``cfg``'s model (it compares the count: :mod:`workbench.checkpoint.config_check`), in one flat tensor."""
    import torch
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint import FORMAT, METADATA_FILE, TRACKER_FILE, file_manifest, iter_dir_name

    d = root / iter_dir_name(3)
    d.mkdir(parents=True)
    dcp.save({"w": torch.zeros(cfg.derived().params.total)}, checkpoint_id=str(d), no_dist=True)
    (d / METADATA_FILE).write_text(json.dumps({"format": FORMAT, "iteration": 3, "config": cfg.to_dict(),
                                               "has_optimizer": has_optimizer, "files": file_manifest(d), "complete": True}))
    (root / TRACKER_FILE).write_text("3")
    return root


def test_checkpoint_that_cannot_load_is_refused_before_anything_starts(rank_script, tmp_path):
    """Another architecture, a resume without optimizer state, and a resume across the
    distributed-optimizer switch each name the field and the fix, and nothing is launched."""
    from workbench.launch import launch_problems

    saved = preset("tiny", **{"parallel.distributed_optimizer": True, "parallel.device": "cpu", "data.source": "synthetic"})
    ckpt = _fake_checkpoint(tmp_path / "ckpt", saved, has_optimizer=True)
    resume = saved.replace(**{"checkpoint.load_dir": str(ckpt)})
    assert launch_problems(resume) == []
    assert launch_problems(resume.replace(**{"checkpoint.load_dir": str(ckpt / "iter_0000003")})) == []

    def fields(cfg):
        return {p.field: str(p) for p in launch_problems(cfg)}

    wider = fields(resume.replace(**{"model.hidden_size": 2 * saved.model.hidden_size, "model.num_layers": 3}))
    assert set(wider) == {"model.hidden_size", "model.num_layers"}, wider  # not the sizes derived from them
    narrower = fields(resume.replace(**{"model.ffn_hidden_size": 3 * saved.model.hidden_size}))
    assert set(narrower) == {"model.ffn_hidden_size"}, narrower
    assert f"set model.num_layers: {saved.model.num_layers}" in wider["model.num_layers"]
    switched = fields(resume.replace(**{"parallel.distributed_optimizer": False}))
    assert set(switched) == {"parallel.distributed_optimizer"} and "checkpoint.finetune: true" in switched["parallel.distributed_optimizer"]
    assert fields(resume.replace(**{"parallel.distributed_optimizer": False, "checkpoint.finetune": True})) == {}

    # another tensor-parallel size pads the vocabulary differently: weights re-pad, Adam's state cannot
    odd_vocab = _fake_checkpoint(tmp_path / "odd", saved.replace(**{"model.vocab_size": 300}), has_optimizer=True)
    tp2 = {"checkpoint.load_dir": str(odd_vocab), "model.vocab_size": 300, "parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2}
    assert set(fields(resume.replace(**tp2))) == {"parallel.tensor_parallel"}
    assert fields(resume.replace(**tp2, **{"checkpoint.finetune": True})) == {}

    weights_only = _fake_checkpoint(tmp_path / "converted", saved, has_optimizer=False)
    no_optim = fields(resume.replace(**{"checkpoint.load_dir": str(weights_only)}))
    assert set(no_optim) == {"checkpoint.finetune"}, no_optim
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as ei:
        Run.launch(resume.replace(**{"checkpoint.load_dir": str(weights_only)}), run_root=root, entry=[str(rank_script)], env={"FAKE_MODE": "ok"})
    assert "checkpoint.finetune" in str(ei.value) and not root.exists()


def test_a_run_without_progress_is_flagged_as_stalled(rank_script, tmp_path):
    """Steps stop coming: after max(floor, 20 step times) the run (and its dashboard) say so."""
    from workbench.widgets.dashboard import Dashboard

    run = launch(rank_script, tmp_path, "stall", 2)
    try:
        wait_until(lambda: len(run.events("step")) == 4, 30, "the two steps of each rank")
        assert run.stalled_for(floor=60.0) is None  # quiet for less than the floor
        wait_until(lambda: run.stalled_for(floor=1.0) is not None, 10, "the stall to be noticed")
        assert run.stalled_for(floor=1.0) > 1.0 and run.status == "running"
        dash = Dashboard(run, autostart=False, stall_after=1.0)
        assert "no progress for 0:00:0" in dash.status.value and "stacks button" in dash.status.value
        assert "no progress" not in Dashboard(run, autostart=False).status.value  # default floor: 2 minutes
    finally:
        run.stop(grace=2)
    assert run.stalled_for(floor=1.0) is None  # ended runs are not stalled
