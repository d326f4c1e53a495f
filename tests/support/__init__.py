"""Helpers shared by the test files (no tests here): ports, process watching, the fake rank script,
synthetic run directories, notebook subprocesses and the generation tests' GPT-2 fixtures.

Test files import from here, never from each other.  Heavy imports (torch, transformers,
megatron) stay inside the functions so that importing this module is cheap.  Helper scripts that
tests run as subprocesses live beside this file (``compiled_layer_check.py``, ``live_bytes.py``).
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]   # the repository
SUPPORT = Path(__file__).resolve().parent     # tests/support: helper scripts run as subprocesses
#: a rank process's environment in the tests: this checkout importable, one OpenMP thread, no warnings
RANK_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def tiny_run_config(**over):
    """``preset("tiny")`` for a short rank run: synthetic data, 6 iterations (the LR decaying over them); ``over``:
    the rest (dotted fields)."""
    from workbench.config import preset

    return preset("tiny", **{"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6, **over})


def checkpointing_run_config(**over):
    """:func:`tiny_run_config` on two ranks, 4 samples a step, a checkpoint every 2nd step, no evaluation and no
    micro-batch timing: the checkpoint fault tests' run."""
    return tiny_run_config(**{"train.global_batch_size": 4, "train.eval_interval": 0, "train.microbatch_timing_interval": 0,
                              "checkpoint.save_interval": 2, "parallel.nproc_per_node": 2, **over})


def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 and that no outgoing connection can take before the test's
    listener binds it (other tests and test runs share this machine): :func:`workbench.run.files.free_port`."""
    from workbench.run.files import free_port as port

    return port()


APT_LOCK = Path("/tmp/workbench-tests-apt.lock")


def apt_install(packages: list[str], installed) -> float | None:
    """Install Debian ``packages`` with apt-get unless ``installed()`` already holds; one install at a time on the
    machine (parallel test workers take :data:`APT_LOCK`; apt waits for dpkg's own lock too).  Seconds it took, None
    when nothing was installed; raises RuntimeError with apt's output when it fails (``apt-get update`` first when
    the install alone fails: a fresh machine has no package lists yet)."""
    import fcntl
    import os

    if installed():
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(APT_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed():  # another worker installed them meanwhile
            return None
        t0 = time.time()
        install = ["apt-get", "-o", "DPkg::Lock::Timeout=600", "install", "-y", "-q", "--no-install-recommends", *packages]
        r = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            for cmd in (["apt-get", "-o", "DPkg::Lock::Timeout=600", "update", "-q"], install):
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        return time.time() - t0


def torchrun_args(nproc: int | str) -> list[str]:
    """``-m`` arguments of a one-node torchrun on ``nproc`` ranks: the launch's own (its rendezvous on a port the OS
    picks, on the loopback), so no port is chosen here that another run could take first."""
    from workbench.launch.stores import MODULE, one_node_args

    return ["-m", MODULE, *one_node_args(), "--nproc-per-node", str(nproc)]


def wait_until(pred, timeout: float, what: str, poll: float = 0.05):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def living(procs) -> list[psutil.Process]:
    """The processes of ``procs`` still running (zombies and vanished ones left out)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process on the machine whose command line names this run directory (zombies included)."""
    out = []
    for p in psutil.process_iter(["cmdline", "pid"]):
        try:
            if str(run_dir) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


# -- the launch's fake rank: stands in for workbench.rank at the process boundary ----------------

RANK_SCRIPT = textwrap.dedent(
    '''
    import argparse, faulthandler, json, os, signal, sys, time
    from pathlib import Path
    from workbench.run.events import EventWriter, event_file

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # as the backend: stacks to stderr on SIGUSR1, and go on

    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    ap.add_argument("--run-dir")
    a = ap.parse_args()
    run_dir = Path(a.run_dir)
    rank = int(os.environ["RANK"])
    mode = os.environ["FAKE_MODE"]
    cfg = json.load(open(a.config))
    iters = cfg["train"]["train_iters"]

    def wait_for(name):
        while not (run_dir / name).exists():
            time.sleep(0.05)

    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a rank stuck in a collective ignores politeness
    if mode == "partial":
        wait_for("go-start")                              # lets the test observe 'starting'
    w = EventWriter(run_dir, rank)
    w.emit("run_start", config=cfg, world_size=int(os.environ["WORLD_SIZE"]))
    if mode == "stall":                                   # two quick steps, then no progress at all
        for it in (1, 2):
            w.emit("step", iteration=it, loss=1.0, step_time=0.01)
        wait_for("go-finish")
    if mode in ("hang", "slow"):
        it = 0
        while not (run_dir / "go-finish").exists():
            it += 1
            w.emit("step", iteration=it, loss=1.0, step_time=0.1)
            time.sleep(0.1)
    if mode == "crash" and rank == 1:
        print("rank 1 about to crash", flush=True)
        raise ValueError("bad shard index 7 on rank 1")  # no error event: only stderr knows
    for it in range(1, iters + 1):
        loss = 4.0 / it if rank == 0 else None
        rec = {"event": "step", "time": time.time(), "rank": rank, "iteration": it, "loss": loss, "lr": 1e-3 * it,
               "grad_norm": 0.5, "step_time": 0.02, "tokens_per_s": 100.0 * it, "mfu": 0.01,
               "mem_allocated": 1000 * (rank + 1), "mem_reserved": 2000 * (rank + 1), "mem_peak": 1500 * (rank + 1)}
        line = json.dumps(rec) + "\\n"
        if mode == "partial" and it == 2:
            with open(event_file(run_dir, rank), "a") as fh:   # half a line, flushed, then a pause
                fh.write(line[:25]); fh.flush()
                wait_for("go-rest")
                fh.write(line[25:]); fh.flush()
        else:
            w._fh.write(line); w._fh.flush()
        if mode == "fail" and rank == 1 and it == 2:
            try:
                raise RuntimeError("boom on rank 1")
            except RuntimeError as e:
                import traceback
                w.emit("error", message=str(e), type="RuntimeError", traceback=traceback.format_exc())
                raise
        time.sleep(0.02)
    if mode == "fail":
        while True:            # the healthy rank would block in the next collective
            time.sleep(0.1)
    w.emit("eval", iteration=iters, loss=2.0, ppl=7.39)
    w.emit("run_end", status="finished", iteration=iters, seconds=1.0)
    '''
)


def write_rank_script(directory: Path) -> Path:
    """``RANK_SCRIPT`` written to ``directory/fake_rank.py``: the entry point for ``Run.launch(entry=[...])``."""
    p = Path(directory) / "fake_rank.py"
    p.write_text(RANK_SCRIPT)
    return p


# -- configs -------------------------------------------------------------------------------------------

ACCELERATE_EXAMPLE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MEGATRON_LM
downcast_bf16: 'no'
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_num_micro_batches: 2
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: true
  megatron_lm_sequence_parallelism: true
  megatron_lm_tp_degree: 2
  megatron_lm_use_distributed_optimizer: true
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""


# -- synthetic run directories (schedules overlay) -----------------------------------------------------

def write_run(run_dir: Path, timelines_by_iteration: dict[int, "Timeline"], tp: int = 1, tp_shift_ms: float = 0.0,
              skip: set[tuple[int, int]] = frozenset()):
    """A run directory as the backend writes it: config.json + run_start/microbatch events per global rank.

    Global rank g = pp * tp + t (tp fastest).  Ranks with t > 0 get their ops shifted by
    ``tp_shift_ms`` so a test can tell which TP rank the reader picked.  ``skip`` holds
    (iteration, pipeline rank) pairs whose events are left out.
    """
    from workbench.config import preset
    from workbench.run.events import EventWriter

    tl0 = next(iter(timelines_by_iteration.values()))
    mbs = preset("tiny").train.micro_batch_size
    cfg = preset("tiny").replace(**{"train.global_batch_size": tl0.m * mbs,  # dp = 1: m micro-batches per step
                                    "parallel.pipeline_parallel": tl0.p, "parallel.tensor_parallel": tp,
                                    "parallel.nproc_per_node": tl0.p * tp,
                                    "parallel.virtual_pipeline_parallel": tl0.v if tl0.v > 1 else None})
    run_dir = Path(run_dir)
    cfg.save(run_dir / "config.json")
    for pp in range(tl0.p):
        for t in range(tp):
            g = pp * tp + t
            with EventWriter(run_dir, g) as w:
                w.emit("run_start", config=cfg.to_dict(), coords={"tp": t, "pp": pp, "dp": 0}, device="synthetic",
                       world_size=tl0.p * tp)
                for it, tl in timelines_by_iteration.items():
                    if (it, pp) in skip:
                        continue
                    shift = tp_shift_ms if t else 0.0
                    ops = [{"kind": o.kind, "microbatch": o.microbatch, "chunk": o.chunk,
                            "start_ms": o.start + shift, "end_ms": o.end + shift} for o in tl.ops[pp]]
                    w.emit("microbatch", iteration=it, ops=ops)
    return run_dir


# -- notebooks -----------------------------------------------------------------------------------------

def run_in_fresh_process(cmd: list[str], seconds: float) -> subprocess.CompletedProcess:
    """Run a notebook through a command in its own process (the product's path, e.g. `workbench notebook run`).

    One process per notebook: no interpreter state is shared with earlier tests. We have seen papermill's
    client wait forever on an idle kernel (about one run in five of notebook 03 inside the full suite, never
    outside it), with ipykernel 7.4.  ipykernel 7.x has open upstream reports of the same intermittent hang
    (microsoft/vscode-jupyter#17228; microsoft/qdk pinned 6.x for it), so pyproject now pins ipykernel < 7; not
    proven to be the cause.  Kept as a safety net: a hung attempt is killed after ``seconds`` and tried again (three
    attempts), so a flaky hang costs minutes rather than stalling CI, and a real hang still fails.
    """
    for attempt in (1, 2, 3):
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            if attempt == 3:
                raise
            print(f"note: {' '.join(cmd[3:6])} hung for {seconds:.0f}s; retrying in a fresh process")
    raise AssertionError("unreachable")


# -- generation: a random HF GPT-2 and the same weights in the workbench's mcore model ------------------

VOCAB = 1000          # tokenizer vocabulary (HF model size; mcore pads it to 1024)
HIDDEN, HEADS, LAYERS, POSITIONS = 64, 4, 2, 96


def gpt2_run_config(hf_model, tp: int = 1, pp: int = 1):
    """The workbench RunConfig of an HF GPT-2, from the conversion helper's mapping (CPU, fp32)."""
    from workbench.conversion.hf import run_config_from_hf

    cfg = run_config_from_hf(hf_model.config.to_dict(), tp=tp, pp=pp, dtype="fp32", make_vocab_size_divisible_by=128)
    return cfg.replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": tp * pp, "model.attention_backend": "sdpa",
                          "train.compile_kernels": False, "train.micro_batch_size": 1, "train.global_batch_size": 1,
                          "data.source": "synthetic"})


def init_single_process(cfg) -> bool:
    """1-process gloo world + megatron parallel state via the backend's test initialiser.

    Returns whether cpu_mode was already enabled (so teardown leaves it as found)."""
    from workbench.backend import cpu_mode, distributed

    was = cpu_mode.enabled()
    distributed.destroy()
    distributed.initialize_for_tests(cfg, port=free_port())
    return was


def teardown_single_process(cpu_mode_was_enabled: bool) -> None:
    from workbench.backend import cpu_mode, distributed

    distributed.destroy()
    if not cpu_mode_was_enabled:
        cpu_mode.disable()


def hf_gpt2(seed: int = 0, init_range: float = 0.2):
    """A random GPT-2 (stock gelu_new) with peaky logits (init std 0.2) so argmax ties are rare."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     initializer_range=init_range, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(cfg).eval()
    return model


def workbench_gpt(cfg, pre_process: bool = True, post_process: bool = True):
    """The model the workbench trains (its layer spec, SDPA core attention), built for this rank."""
    from workbench.rank.build import build_model

    return build_model(cfg, pre_process=pre_process, post_process=post_process).eval()


def converted_state(hf_model, cfg) -> dict[str, torch.Tensor]:
    """HF GPT-2 weights as the full (TP=1) mcore state dict, via ``workbench.conversion``."""
    from workbench.conversion.hf import hf_to_mcore

    return hf_to_mcore(hf_model.state_dict(), cfg, "gpt2")


def load_into(model, full_state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly TP-sharded, possibly one-stage) mcore model."""
    import torch
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    rank = ps.get_tensor_model_parallel_rank()
    layer_offset = 0
    if ps.get_pipeline_model_parallel_world_size() > 1:
        per = LAYERS // ps.get_pipeline_model_parallel_world_size()
        layer_offset = per * ps.get_pipeline_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + layer_offset)
                key = ".".join(parts)
            if key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            full = full_state[key]
            if full.shape != p.shape:
                dim = 0 if full.shape[0] != p.shape[0] else 1
                full = full.chunk(tp, dim=dim)[rank]
            p.copy_(full)


def count_direct_reads(monkeypatch) -> list[int]:
    """The lengths of the ranges read past the page cache from now on (``DirectReads.read``, wrapped): a test of the
    direct path skips when this stays empty (a file system that refuses O_DIRECT)."""
    from workbench.checkpoint import DirectReads

    lengths: list[int] = []
    real = DirectReads.read
    monkeypatch.setattr(DirectReads, "read", lambda self, fd, offset, length: lengths.append(length) or
                        real(self, fd, offset, length))
    return lengths


def write_step_events(run_dir: Path, steps: int, train_iters: int = 60):
    """A tiny run's config and event stream in ``run_dir`` (as its rank writes them): ``run_start``, then ``steps``
    step events; returns the open :class:`EventWriter` (the caller writes more, or closes it)."""
    from workbench.config import preset
    from workbench.run.events import EventWriter

    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": 1, "train.train_iters": train_iters})
    cfg.save(Path(run_dir) / "config.json")
    writer = EventWriter(run_dir, 0)
    writer.emit("run_start", config=cfg.to_dict(), world_size=1, kernel_path={})
    for it in range(1, steps + 1):
        writer.emit("step", iteration=it, loss=5.0, step_time=0.05, tokens_per_s=1000.0)
    return writer
