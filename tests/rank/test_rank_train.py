"""Training-rank tests: real ``torchrun ... -m workbench.rank`` jobs in CPU mode (gloo).

Covers: PP=2 training through megatron's 1F1B schedule with events (run_start, step,
microbatch, eval, checkpoint, run_end) and its TensorBoard log (``train.tensorboard``), checkpoint + resume continuing the loss curve and LR
schedule exactly, distributed-optimizer save and resume at DP=2, SIGTERM shutdown (checkpoint,
run_end "stopped", non-zero exit), SIGUSR1 stack dumps, a hung process-group teardown that
still ends the process, an exception in a rank (error event, non-zero exit), bad config (exit 2
before any process group), and the custom loss hook reproducing the reference guide's
key-token-weighted loss; a long evaluation reports its progress on every rank (``eval_progress``: the supervisor's
stall watch takes it for progress).

The evaluation-progress run, the PP=2 resume, both DP=2 distributed-optimizer runs (the first and its resume) and the
demo-corpus run share one launch of two ranks (``tests.support.trainer_runs``: the backend's Trainer per run directory, in order; a resumed
run never directly follows the run whose checkpoint it loads).  The loss hook's check and the hung teardown share one
plain process (the teardown last: it ends the process).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import RANK_ENV, ROOT, free_port, tiny_run_config, torchrun_args
from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import read_events

PY = sys.executable
ENV = RANK_ENV


def _cfg(**over):
    return tiny_run_config(**{"train.global_batch_size": 8, "train.eval_interval": 3, "train.eval_iters": 1,
                              "train.microbatch_timing_interval": 2, "checkpoint.save_interval": 3, **over})


def _torchrun(cfg, run_dir: Path, nproc: int, timeout: int = 240, **popen):
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.parallel.nproc_per_node = nproc
    cfg.save(run_dir / "config.json")
    cmd = [PY, *torchrun_args(str(nproc)),
           "-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _by(events, kind, rank=None):
    return [e for e in events if e["event"] == kind and (rank is None or e["rank"] == rank)]


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pp2")
    proc = _torchrun(_cfg(**{"parallel.pipeline_parallel": 2, "train.tensorboard": True}), run_dir, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return run_dir, read_events(run_dir)


def test_pp2_run_writes_the_event_contract(pp2_run):
    run_dir, ev = pp2_run
    for rank in (0, 1):
        start = _by(ev, "run_start", rank)
        assert len(start) == 1
        s = start[0]
        assert s["coords"] == {"tp": 0, "pp": rank, "dp": 0} and s["world_size"] == 2
        assert "megatron_core" in s["versions"] and "SDPA" in s["kernel_path"]["attention"]
        assert s["kernel_path"]["schedule"] == "1F1B" and s["config"]["parallel"]["pipeline_parallel"] == 2
        steps = _by(ev, "step", rank)
        assert [e["iteration"] for e in steps] == [1, 2, 3, 4, 5, 6]
        for e in steps:
            assert e["lr"] >= 0 and e["grad_norm"] > 0 and e["skipped"] is False
            assert e["step_time"] > 0 and e["tokens_per_s"] > 0 and e["tflops_per_gpu"] > 0
        # the loss lives on the last pipeline stage only
        assert all(e["loss"] is None for e in steps) if rank == 0 else all(math.isfinite(e["loss"]) and e["loss"] > 1 for e in steps)
        # micro-batch timings every 2nd step: 4 micro-batches, each with a forward and a backward
        mbs = _by(ev, "microbatch", rank)
        assert [m["iteration"] for m in mbs] == [2, 4, 6]
        for m in mbs:
            ops = m["ops"]
            assert sorted((o["kind"], o["microbatch"]) for o in ops) == sorted((k, i) for k in "FB" for i in range(4))
            for o in ops:
                assert 0 <= o["start_ms"] <= o["end_ms"]
            for i in range(4):  # backward of a micro-batch starts after its forward ended
                f = next(o for o in ops if o["kind"] == "F" and o["microbatch"] == i)
                b = next(o for o in ops if o["kind"] == "B" and o["microbatch"] == i)
                assert b["start_ms"] >= f["end_ms"]
        assert _by(ev, "run_end", rank)[0]["status"] == "finished"
        assert [c["iteration"] for c in _by(ev, "checkpoint", rank)] == [3, 6]
    evals = _by(ev, "eval", 1)
    assert [e["iteration"] for e in evals] == [3, 6]
    assert all(abs(e["ppl"] - math.exp(e["loss"])) < 1e-6 * e["ppl"] for e in evals)
    ckpt = run_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    meta = json.loads((ckpt / "iter_0000003" / "workbench.json").read_text())
    assert meta["complete"] and meta["iteration"] == 3 and meta["extra"]["consumed_samples"] == 24


def _tensorboard_points(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar series in ``logdir`` as TensorBoard's own reader gives it: tag -> [(step, value, wall time)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(s.step, s.value, s.wall_time) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_log_holds_the_logged_steps_and_evaluations(pp2_run, tmp_path):
    """``train.tensorboard``: the rank holding the loss (the last pipeline stage, rank 1) writes one event file into
    <run_dir>/tensorboard, and TensorBoard's reader finds each step record's loss, LR, grad norm and throughput and each
    eval record's loss at the same steps and times, equal to float32; an export of the run's events afterwards holds
    the same points (one adapter for both)."""
    import numpy as np

    from workbench.run.tensorboard import export

    run_dir, ev = pp2_run
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    live = _tensorboard_points(run_dir / "tensorboard")
    steps, evals = _by(ev, "step", 1), _by(ev, "eval", 1)
    for tag, key, records in (("train/loss", "loss", steps), ("train/lr", "lr", steps), ("train/grad_norm", "grad_norm", steps),
                              ("perf/tokens_per_s", "tokens_per_s", steps), ("perf/step_time_s", "step_time", steps),
                              ("eval/loss", "loss", evals), ("eval/ppl", "ppl", evals)):
        want = [(e["iteration"], float(np.float32(e[key])), e["time"]) for e in records]
        assert live[tag] == want, (tag, live[tag], want)
    assert [p[0] for p in live["train/loss"]] == [1, 2, 3, 4, 5, 6] and [p[0] for p in live["eval/loss"]] == [3, 6]
    # CPU mode leaves MFU and memory empty: no series for them
    assert sorted(live) == sorted(["train/loss", "train/lr", "train/grad_norm", "perf/step_time_s", "perf/tokens_per_s",
                                   "perf/tflops_per_gpu", "eval/loss", "eval/ppl"])
    assert _tensorboard_points(export(run_dir, tmp_path / "exported")) == live


DIST_OPT = {"parallel.distributed_optimizer": True, "train.eval_interval": 0}
#: the ranks write eval_progress after every evaluation batch (its default: at most every EVAL_PROGRESS_SECONDS); the
#: other runs of the launch do not evaluate
EVERY_BATCH = "import workbench.rank.train as _train\n_train.EVAL_PROGRESS_SECONDS = 0.0\n"


@pytest.fixture(scope="module")
def two_rank_runs(pp2_run, tmp_path_factory):
    """One launch of two ranks: a run whose one evaluation takes three batches, the DP=2 distributed-optimizer run
    (checkpoints at 3 and 6), the PP=2 run resumed from ``pp2_run``'s step-3 checkpoint, the DP=2 run resumed from
    its own step-3 checkpoint, and a run on the demo corpus (the preset's data source)."""
    root = tmp_path_factory.mktemp("two-rank")
    no_save = {"checkpoint.save_interval": 0, "checkpoint.save_on_exit": False}
    evaluating = preset("tiny", **{"data.source": "synthetic", "train.train_iters": 2, "train.lr_decay_iters": 2,
                                   "train.lr_warmup_iters": 0, "train.global_batch_size": 4, "train.eval_interval": 2,
                                   "train.eval_iters": 3, "train.microbatch_timing_interval": 0,
                                   "checkpoint.save_on_exit": False})
    run_trainers({root / "eval-progress": evaluating,
                  root / "dp2-first": _cfg(**DIST_OPT),
                  root / "pp2-resumed": _cfg(**{"parallel.pipeline_parallel": 2, "train.eval_interval": 0, **no_save,
                                                "checkpoint.load_dir": str(pp2_run[0] / "checkpoints" / "iter_0000003")}),
                  root / "dp2-resumed": _cfg(**DIST_OPT, **no_save,
                                             **{"checkpoint.load_dir": str(root / "dp2-first" / "checkpoints" / "iter_0000003")}),
                  root / "demo": preset("tiny", **{"train.train_iters": 6, "train.eval_interval": 0,
                                                   "train.lr_warmup_iters": 1, "checkpoint.save_on_exit": False})},
                 nproc=2, timeout=600, prelude=EVERY_BATCH)
    return root


def test_resume_continues_loss_lr_and_data(pp2_run, two_rank_runs):
    _, ev = pp2_run
    ev2 = read_events(two_rank_runs / "pp2-resumed")
    assert _by(ev2, "run_start", 1)[0]["start_iteration"] == 3
    assert _by(ev2, "run_start", 1)[0]["config"]["parallel"]["pipeline_parallel"] == 2
    before = {e["iteration"]: e for e in _by(ev, "step", 1)}
    after = _by(ev2, "step", 1)
    assert [e["iteration"] for e in after] == [4, 5, 6]
    for e in after:
        ref = before[e["iteration"]]
        assert abs(e["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (e["iteration"], e["loss"], ref["loss"])
        assert e["lr"] == pytest.approx(ref["lr"], rel=1e-9)
        assert e["consumed_samples"] == ref["consumed_samples"]


def test_sigterm_stops_cleanly_with_checkpoint(tmp_path):
    run_dir = tmp_path / "stop"
    cfg = _cfg(**{"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "train.train_iters": 2000,
                  "train.lr_decay_iters": None, "train.eval_interval": 0, "checkpoint.save_interval": 0})
    proc = _torchrun(cfg, run_dir, 2, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if len(_by(read_events(run_dir), "step", 0)) >= 2:
                break
            time.sleep(0.5)
        else:
            pytest.fail("no training steps within 180 s")
        # signal one rank only (as a scheduler's preemption of one node would): the other must
        # learn of it through the stop agreement and stop at the very same step boundary
        import psutil

        workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "workbench.rank" in " ".join(c.cmdline())]
        rank1 = [w for w in workers if w.environ().get("RANK") == "1"]
        assert len(workers) == 2 and len(rank1) == 1, [w.cmdline() for w in workers]
        # SIGUSR1 prints a rank's Python stacks (where a hung rank waits) and the run goes on
        rank0 = [w for w in workers if w.environ().get("RANK") == "0"]
        rank0[0].send_signal(signal.SIGUSR1)
        time.sleep(2)
        assert rank0[0].is_running()
        rank1[0].send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "(most recent call first)" in out and "workbench/rank/train.py" in out, out[-3000:]
    ev = read_events(run_dir)
    for rank in (0, 1):
        end = _by(ev, "run_end", rank)
        assert len(end) == 1 and end[0]["status"] == "stopped" and end[0]["exit_code"] == 143, out[-3000:]
        assert end[0]["iteration"] < 2000
    stopped_at = _by(ev, "run_end", 0)[0]["iteration"]
    assert _by(ev, "run_end", 1)[0]["iteration"] == stopped_at  # one agreed boundary
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped_at)
    assert not _by(ev, "error")


def test_exception_in_a_rank_is_an_error_event_and_nonzero_exit(tmp_path):
    # math.sqrt as a loss hook raises TypeError inside the schedule on the last stage
    cfg = _cfg(**{"train.loss_func": "math:sqrt", "train.train_iters": 3, "train.lr_decay_iters": 3, "train.lr_warmup_iters": 1})
    proc = _torchrun(cfg, tmp_path / "err", 1)
    assert proc.returncode != 0
    ev = read_events(tmp_path / "err")
    err = _by(ev, "error", 0)
    assert len(err) == 1 and err[0]["exception"] == "TypeError" and "sqrt" in err[0]["traceback"]
    assert _by(ev, "run_end", 0)[0]["status"] == "failed"


def test_bad_config_exits_2_before_starting(tmp_path):
    cfg = _cfg(**{"parallel.tensor_parallel": 3})  # 4 heads are not divisible by 3
    path = tmp_path / "bad.json"
    cfg.save(path)
    proc = subprocess.run([PY, "-m", "workbench.rank", "--config", str(path), "--run-dir", str(tmp_path / "r")],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "parallel.tensor_parallel" in proc.stderr and "divisible" in proc.stderr
    assert not (tmp_path / "r" / "events").exists()


HOOK_SCRIPT = r'''
import json, os, torch
from workbench.config import preset
from workbench.rank.train import Trainer
from workbench.rank.data import MicroBatchStream

cfg = preset("tiny", **{"data.source": "synthetic", "train.train_iters": 4, "train.global_batch_size": 4,
                        "train.eval_interval": 0, "checkpoint.save_on_exit": False, "train.return_logits": True,
                        "train.loss_func": "workbench.hooks:keytoken_weighted_loss"})
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["CHECK_PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
first = MicroBatchStream(__import__("workbench.models.gpt.data", fromlist=["x"]).SyntheticGPTDataset(
    cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed), cfg, 0)
batches = [next(first) for _ in range(2)]  # the two micro-batches of step 1
keytokens = [int(batches[0]["tokens"][0, 3]), int(batches[1]["tokens"][1, 5]), int(batches[1]["tokens"][1, 9])]
cfg.train.hook_kwargs = {"keytoken_ids": keytokens, "alpha": 0.25}
tr = Trainer(cfg, os.environ["RUN_DIR"])
tr.setup()

# the reference guide's loss, written out independently of workbench.hooks
def reference(tokens, loss_mask, losses):
    b, s = losses.shape
    loss = losses.float().view(-1) * loss_mask.view(-1).float()
    per_sample = loss.view(b, s).sum(1) / loss_mask.view(b, s).float().sum(1)
    weights = torch.stack([(tokens == kt).float() for kt in keytokens]).sum(axis=[0, 2])
    return (per_sample * (1.0 + 0.25 * weights)).mean(), weights

model = tr.model[0]
expected, plain, wsum = [], [], 0.0
with torch.no_grad():
    for b in batches:
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        ref, w = reference(b["tokens"], b["loss_mask"], losses)
        expected.append(float(ref)); plain.append(float(losses.mean())); wsum += float(w.sum())
res = tr.train_step()
logits = tr.last_logits
print(json.dumps({"reported": res["losses"]["lm loss"], "expected": sum(expected) / 2, "plain": sum(plain) / 2,
                  "weights": wsum, "n_logits": len(logits), "logits_shape": list(logits[0].shape),
                  "padded_vocab": tr.derived.padded_vocab_size}))
'''


#: after the hook's check, in the same process: a finished rank whose process-group teardown never returns (seen with
#: NCCL under CUDA graphs) leaves after the guard's timeout with the run's exit code; a teardown that returns hands the
#: code back
TEARDOWN_SCRIPT = r'''
import sys, time
print(f"TEARDOWN_START {time.time()}", flush=True)
from workbench.backend import distributed
from workbench.rank import train
distributed.destroy = lambda: None
assert train.teardown(5, timeout_s=30) == 5
distributed.destroy = lambda: time.sleep(300)
train.teardown(7, timeout_s=1)
sys.exit(0)  # not reached
'''


@pytest.fixture(scope="module")
def hook_then_teardown(tmp_path_factory):
    """One plain process (one start and one set of imports for both checks): :data:`HOOK_SCRIPT`, then
    :data:`TEARDOWN_SCRIPT`: (the process, the time it ended)."""
    env = {**ENV, "RUN_DIR": str(tmp_path_factory.mktemp("hook") / "hook"), "CHECK_PORT": str(free_port())}
    # unbuffered: the hook's line is out before the guard's os._exit
    proc = subprocess.run([PY, "-u", "-c", textwrap.dedent(HOOK_SCRIPT) + TEARDOWN_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    return proc, time.time()


def test_custom_keytoken_loss_hook_reproduces_the_reference(hook_then_teardown):
    proc, _ = hook_then_teardown
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.loads(lines[-1])
    assert res["weights"] >= 3  # the chosen key tokens occur, so the weighting matters
    assert abs(res["reported"] - res["expected"]) < 1e-5 * res["expected"], res
    assert abs(res["expected"] - res["plain"]) > 1e-3  # and differs from the plain mean loss
    # return_logits: one [b, s, padded vocab] logits tensor per micro-batch, kept on the last stage
    assert res["n_logits"] == 2 and res["logits_shape"] == [2, 64, res["padded_vocab"]]


def test_a_hung_teardown_still_ends_the_process_with_the_runs_code(hook_then_teardown):
    """:data:`TEARDOWN_SCRIPT` (after the hook's check): the process leaves with the run's code 7 after the guard's
    1 s, not after the 300 s the teardown would hang."""
    proc, ended = hook_then_teardown
    started = [float(l.split()[1]) for l in proc.stdout.splitlines() if l.startswith("TEARDOWN_START ")]
    assert started, proc.stdout[-3000:]
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "teardown hung for 1 s; exiting with 7" in proc.stderr
    assert ended - started[0] < 60  # the teardown script's own run: the guard's 1 s, not the 300 s hang


def test_demo_corpus_trains_through_the_data_pipeline(two_rank_runs):
    """The tiny preset's own data source (the demo corpus through megatron-core's datasets) trains: run at DP=2 in
    ``two_rank_runs``' launch."""
    ev = read_events(two_rank_runs / "demo")
    assert _by(ev, "run_start", 0)[0]["data"].startswith("demo")
    losses = [e["loss"] for e in _by(ev, "step", 0)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.05, losses


def test_distributed_optimizer_state_saves_and_resumes_at_dp2(two_rank_runs):
    """The distributed optimizer's state goes to disk as 'fully_reshardable' (mcore's default
    sharding is refused by the torch_dist strategy) and a resumed DP=2 run continues the loss."""
    ev = read_events(two_rank_runs / "dp2-first")
    start = _by(ev, "run_start", 0)[0]
    assert start["world_size"] == 2 and start["config"]["parallel"]["distributed_optimizer"] is True
    assert (two_rank_runs / "dp2-first" / "checkpoints" / "iter_0000003").is_dir()
    before = {e["iteration"]: e["loss"] for e in _by(ev, "step", 0)}
    resumed = read_events(two_rank_runs / "dp2-resumed")
    assert _by(resumed, "run_start", 0)[0]["start_iteration"] == 3
    after = {e["iteration"]: e["loss"] for e in _by(resumed, "step", 0)}
    assert sorted(after) == [4, 5, 6]
    for i, loss in after.items():
        assert abs(loss - before[i]) <= 1e-5 * before[i], (i, loss, before[i])


def test_every_rank_reports_progress_through_an_evaluation(two_rank_runs):
    """A long evaluation is progress: while it runs every rank writes ``eval_progress`` events (at most every
    ``EVAL_PROGRESS_SECONDS``), so the supervisor's stall watch does not take a slow first evaluation for a hung rank."""
    events = read_events(two_rank_runs / "eval-progress")
    for rank in (0, 1):
        mine = [e for e in events if e.get("rank") == rank]
        kinds = [e["event"] for e in mine]
        progress = [e for e in mine if e["event"] == "eval_progress"]
        assert [(p["iteration"], p["done"], p["total"]) for p in progress] == [(2, 0, 3), (2, 1, 3), (2, 2, 3)], kinds
        last_step = max(i for i, k in enumerate(kinds) if k == "step")
        first_progress = kinds.index("eval_progress")
        assert last_step < first_progress  # written during the evaluation that follows step 2
        if "eval" in kinds:  # the rank that holds the loss writes the evaluation's result after its progress
            assert kinds.index("eval") > max(i for i, k in enumerate(kinds) if k == "eval_progress")


def test_tp_comm_overlap_asks_for_one_hardware_queue_before_cuda_starts(monkeypatch, tmp_path):
    """TP with parallel.tp_comm_overlap runs its ranks with CUDA_DEVICE_MAX_CONNECTIONS=1 (the
    backward all-reduce must start before the GEMMs it runs under): the backend's entry point
    sets it before importing torch, a launch's own value is kept, nothing without TP."""
    from workbench.backend import distributed
    from workbench.rank import __main__ as entry
    from workbench.config import rank_environment

    tp2 = preset("gpt2-small", **{"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2})
    assert rank_environment(tp2) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert rank_environment(preset("gpt2-small")) == {}
    assert rank_environment(tp2.replace(**{"parallel.tp_comm_overlap": False})) == {}
    assert rank_environment(tp2.replace(**{"parallel.device": "cpu"})) == {}
    path = tmp_path / "run.json"
    tp2.save(path)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    entry._rank_environment(["--config", str(path), "--run-dir", str(tmp_path)])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert distributed.hardware_queue_note(tp2) == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    entry._rank_environment(["--config", str(path), "--run-dir", str(tmp_path)])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert distributed.hardware_queue_note(tp2) == "CUDA_DEVICE_MAX_CONNECTIONS=8 (set by the launch; kept)"
    assert distributed.hardware_queue_note(preset("gpt2-small")) is None
