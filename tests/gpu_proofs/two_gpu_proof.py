"""GPU proof that two GPUs compute what one does, for every family: parity, resume, conversion, memory.

Run on a machine with 2 GPUs from the repository root, in two calls (each well under 9 minutes on 2x H100)::

    source tests/gpu_proofs/device_env.sh && export GIT_COMMIT=<sha>
    python3 tests/gpu_proofs/two_gpu_proof.py --phase a --out $OUT/two_gpu_proof.jsonl --work /tmp/two_gpu
    python3 tests/gpu_proofs/two_gpu_proof.py --phase b --out $OUT/two_gpu_proof.jsonl --work /tmp/two_gpu \\
        --planner-out $OUT/planner_2gpu.jsonl

Phase ``a`` (parity and resume; every run a real ``torchrun -m workbench.rank`` job started through
``Run.launch``, the product path, on the workbench's default GPU path: compiled layer, CUDA graphs, bf16):

- ``parity``: per family one initial checkpoint (the backend's ``Trainer`` set up and saved on one GPU),
  loaded with ``checkpoint.finetune`` by a one-GPU reference and by every two-GPU layout; 50 steps,
  dropout 0, synthetic data; max relative per-step loss difference against the reference <= 2%:
  GPT-2 (TP=2, TP=2+SP, PP=2, PP=2 x VPP=2, DP=2 + distributed optimizer), Llama with GQA (TP=2+SP,
  PP=2; and at 8k tokens a sequence, CP=2: ``llama-8k-cp2`` on the workbench ring, ``llama-8k-cp2-te`` through
  megatron-core's CP in Transformer Engine's attention where TE is importable), BERT (TP=2+SP, PP=2 1F1B and interleaved,
  DP=2; eval loss and masked-token accuracy at steps
  25 and 50 within the same bar), T5 (TP=2, DP=2 + distributed optimizer; eval loss within the bar).
  ``gpt-repeat`` runs the one-GPU reference again: the noise floor of bf16 training on this GPU.
- ``resume``: the TP=2 and PP=2 GPT runs (and BERT's TP=2+SP and PP=2) save at step 25; each checkpoint
  resumes at TP=1 (one GPU), at DP=2 and at its own layout; steps 26-50 against the run that never
  stopped: within the parity bar across layouts, within 1e-3 (absolute) at the same layout.
- optimizer CPU offload (``gpt-dp2-offload``: DP=2, the distributed optimizer's state on the host): parity with one
  GPU, and its checkpoint resumed with offload and on one GPU without it (the distributed optimizer kept: a checkpoint
  saved with it resumes only with it) (GPUs only: the CPU self-check skips them).

Phase ``b`` (conversion, then the planner):

- ``convert``: GPT and Llama trained at TP=2 and at PP=2 (TP=2 x PP=2 when 4 GPUs are visible), BERT and
  T5 at TP=2 (30 steps on the embedded corpus with the family's demo tokenizer), each then through
  ``tests/gpu_proofs/two_gpu_conversion.py``: export to HF, ``convert verify`` at the training layout, the round
  trip (HF -> workbench at the training layout -> HF, bit-identical), and greedy HF ``generate`` ==
  ``workbench generate`` on the round-tripped fp32 checkpoint (GPT, Llama, T5; BERT: the masked-token
  argmax of the verified logits equals HF's).
- ``planner``: ``tests/gpu_proofs/planner_measure.py --set 2gpu-all`` (predicted vs measured allocated and
  reserved per rank, the allocator's counters and the device memory outside torch), its JSON lines to
  ``--planner-out``.

Independent jobs run side by side (``--per-gpu`` ranks on a GPU at once; a two-GPU job takes both), each
with its own timeout; a progress line with the elapsed time is printed as each starts and ends, and a
summary table last.  JSON lines (device, date, git commit from ``GIT_COMMIT``) go to ``--out``.
``--only NAME[,NAME]`` picks cases by name or prefix (``gpt``, ``bert-pp2``, ``resume``, ``convert-t5``);
what they need (initial checkpoints, references, the runs they resume) comes with them.  ``--list``
prints the cases.  ``--device cpu`` runs the same logic on tiny models under gloo (a self-check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PARITY_BAR = 0.02  # max relative per-step loss difference, two GPUs vs one
SAME_LAYOUT_ABS = 1e-3  # a resume at the layout that saved: |loss - straight loss|
TP2, SP, PP2, VPP2 = ({"parallel.tensor_parallel": 2}, {"parallel.sequence_parallel": True},
                      {"parallel.pipeline_parallel": 2}, {"parallel.virtual_pipeline_parallel": 2})
DISTOPT = {"parallel.distributed_optimizer": True}
CP2 = {"parallel.context_parallel": 2}  # ring attention over the sequence, load-balanced chunks
OFFLOAD = {**DISTOPT, "parallel.optimizer_cpu_offload": 1.0}  # GPUs only (megatron's HybridDeviceOptimizer)

# family -> (preset, model shape on GPUs); every family at ~10-20 s of training per run on an H100 (llama-8k: ~2 min)
FAMILIES: dict[str, tuple[str, dict]] = {
    "gpt": ("gpt2-small", {"model.num_layers": 8, "model.hidden_size": 512, "model.num_attention_heads": 8,
                           "model.vocab_size": 8192, "model.seq_length": 512, "model.max_position_embeddings": 512,
                           "train.micro_batch_size": 4}),
    "llama": ("llama-small", {"model.num_layers": 8, "model.hidden_size": 512, "model.num_attention_heads": 8,
                              "model.num_query_groups": 2, "model.ffn_hidden_size": 1408, "model.vocab_size": 8192,
                              "model.seq_length": 512, "model.max_position_embeddings": 512, "train.micro_batch_size": 4}),
    # the same Llama at a long sequence, one sequence a micro-batch: context parallelism's parity
    "llama-8k": ("llama-small", {"model.num_layers": 8, "model.hidden_size": 512, "model.num_attention_heads": 8,
                                 "model.num_query_groups": 2, "model.ffn_hidden_size": 1408, "model.vocab_size": 8192,
                                 "model.seq_length": 8192, "model.max_position_embeddings": 8192,
                                 "train.micro_batch_size": 1}),
    "bert": ("bert-base", {"model.num_layers": 8, "model.hidden_size": 512, "model.num_attention_heads": 8,
                           "model.vocab_size": 8192, "model.seq_length": 256, "model.max_position_embeddings": 256,
                           "train.micro_batch_size": 8}),
    "t5": ("t5-base", {"model.num_layers": 4, "model.decoder_num_layers": 4, "model.hidden_size": 512,
                       "model.num_attention_heads": 8, "model.kv_channels": 64, "model.ffn_hidden_size": 2048,
                       "model.vocab_size": 8192, "model.seq_length": 256, "model.max_position_embeddings": 256,
                       "model.decoder_seq_length": 64, "train.micro_batch_size": 8}),
}
# the CPU self-check's shapes (gloo, fp32)
TINY: dict[str, dict] = {
    "gpt": {"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.vocab_size": 4096,
            "model.seq_length": 64, "model.max_position_embeddings": 64, "train.micro_batch_size": 2},
    "llama": {"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.num_query_groups": 2,
              "model.ffn_hidden_size": 176, "model.vocab_size": 4096, "model.seq_length": 64,
              "model.max_position_embeddings": 64, "train.micro_batch_size": 2},
    "llama-8k": {"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.num_query_groups": 2,
                 "model.ffn_hidden_size": 176, "model.vocab_size": 4096, "model.seq_length": 256,
                 "model.max_position_embeddings": 256, "train.micro_batch_size": 1},
    "bert": {"model.num_layers": 4, "model.hidden_size": 64, "model.num_attention_heads": 4, "model.vocab_size": 4096,
             "model.seq_length": 64, "model.max_position_embeddings": 64, "train.micro_batch_size": 2},
    "t5": {"model.num_layers": 2, "model.decoder_num_layers": 2, "model.hidden_size": 64, "model.num_attention_heads": 4,
           "model.kv_channels": 16, "model.ffn_hidden_size": 128, "model.vocab_size": 4196, "model.seq_length": 64,
           "model.max_position_embeddings": 64, "model.decoder_seq_length": 16, "train.micro_batch_size": 2},
}
EVAL_FAMILIES = ("bert", "t5")  # evaluation during training: eval loss (and BERT's masked-token accuracy) compared too

# parity: name -> (family, GPUs, layout overrides)
LAYOUTS: dict[str, tuple[str, int, dict]] = {
    "gpt-tp2": ("gpt", 2, TP2), "gpt-tp2-sp": ("gpt", 2, {**TP2, **SP}), "gpt-pp2": ("gpt", 2, PP2),
    "gpt-pp2-vpp2": ("gpt", 2, {**PP2, **VPP2}), "gpt-dp2-distopt": ("gpt", 2, DISTOPT),
    "llama-tp2-sp": ("llama", 2, {**TP2, **SP}), "llama-pp2": ("llama", 2, PP2),
    "llama-8k-cp2": ("llama-8k", 2, CP2), "llama-8k-cp2-te": ("llama-8k", 2, {**CP2, "model.attention_backend": "te"}),
    "bert-tp2-sp": ("bert", 2, {**TP2, **SP}), "bert-pp2": ("bert", 2, PP2), "bert-pp2-vpp2": ("bert", 2, {**PP2, **VPP2}),
    "bert-dp2": ("bert", 2, {}),
    "t5-tp2": ("t5", 2, TP2), "t5-dp2-distopt": ("t5", 2, DISTOPT),
    "gpt-dp2-offload": ("gpt", 2, OFFLOAD),
}
# resume: name -> (the parity run that saved at half-way, GPUs, layout of the resumed run)
RESUMES: dict[str, tuple[str, int, dict]] = {
    "resume-gpt-tp2-at-tp2": ("gpt-tp2", 2, TP2), "resume-gpt-tp2-at-tp1": ("gpt-tp2", 1, {}),
    "resume-gpt-tp2-at-dp2": ("gpt-tp2", 2, {}),
    "resume-gpt-pp2-at-pp2": ("gpt-pp2", 2, PP2), "resume-gpt-pp2-at-tp1": ("gpt-pp2", 1, {}),
    "resume-gpt-pp2-at-dp2": ("gpt-pp2", 2, {}),
    "resume-bert-tp2-sp-at-dp2": ("bert-tp2-sp", 2, {}), "resume-bert-tp2-sp-at-tp1": ("bert-tp2-sp", 1, {}),
    "resume-bert-pp2-at-dp2": ("bert-pp2", 2, {}),
    "resume-gpt-offload-at-offload": ("gpt-dp2-offload", 2, OFFLOAD), "resume-gpt-offload-at-tp1": ("gpt-dp2-offload", 1, DISTOPT),
}
#: cases the CPU self-check skips (optimizer CPU offload moves state between a GPU and the host)
GPU_ONLY = ("gpt-dp2-offload", "resume-gpt-offload")
#: cases that need Transformer Engine: skipped, and said so, where it is not importable
TE_ONLY = ("llama-8k-cp2-te",)
# conversion: name -> (family, layout of the training run); 4 GPUs: GPT and Llama at TP=2 x PP=2 instead
CONVERSIONS_2: dict[str, tuple[str, dict]] = {
    "convert-gpt-tp2": ("gpt", TP2), "convert-gpt-pp2": ("gpt", PP2), "convert-llama-tp2": ("llama", {**TP2, **SP}),
    "convert-llama-pp2": ("llama", PP2), "convert-bert-tp2": ("bert", TP2), "convert-t5-tp2": ("t5", TP2),
}
CONVERSIONS_4: dict[str, tuple[str, dict]] = {
    "convert-gpt-tp2-pp2": ("gpt", {**TP2, **PP2}), "convert-llama-tp2-pp2": ("llama", {**TP2, **PP2}),
    "convert-bert-tp2": ("bert", TP2), "convert-t5-tp2": ("t5", TP2),
}
DEMO_VOCAB = {"gpt": 4096, "llama": 4096, "bert": 4096, "t5": 4196}  # the demo tokenizers' vocabularies


def steps_of(tiny: bool) -> tuple[int, int]:
    """(training steps, the step the resumed runs restart from)."""
    return (6, 3) if tiny else (50, 25)


def family_config(fam: str, device: str, tiny: bool, **over: Any):
    """The family's run config of the parity runs (synthetic data, dropout 0, evaluation for the encoders)."""
    from workbench.config import preset

    base, shape = FAMILIES[fam]
    steps, half = steps_of(tiny)
    ov = {**(TINY[fam] if tiny else shape), "data.source": "synthetic", "parallel.device": device,
          "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
          "train.global_batch_size": 8 if tiny else 32, "train.train_iters": steps, "train.lr_decay_iters": steps,
          "train.lr": 2e-3 if tiny else 2e-4, "train.min_lr": 2e-4 if tiny else 2e-5, "train.lr_warmup_iters": 2 if tiny else 5,
          "train.log_interval": 1, "train.microbatch_timing_interval": 0,
          "train.eval_interval": half if fam in EVAL_FAMILIES else 0, "train.eval_iters": 2,
          "checkpoint.save_on_exit": False, "checkpoint.save_interval": 0}
    if fam == "bert":  # masked-token accuracy means something only on text: synthetic tokens keep it at chance
        ov.update({"data.source": "demo", "model.vocab_size": DEMO_VOCAB["bert"]})
        if not tiny:
            ov.update({"train.lr": 1e-3, "train.min_lr": 1e-4})
    if tiny:
        ov.update({"train.precision": "fp32", "train.compile_kernels": False})
    else:
        ov.update({"train.precision": "bf16"})
    ov.update(over)
    return preset(base, **ov).replace(name=f"two-gpu-{fam}")


# --------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One process tree to run: a training run (``Run.launch``) or a script; ``needs``: jobs that must finish first."""

    name: str
    gpus: int
    start: Callable[[str], Any]  # CUDA_VISIBLE_DEVICES -> handle with poll() -> None | 0 | code, and kill()
    needs: list[str] = field(default_factory=list)
    timeout: float = 300.0
    status: str = "pending"  # pending, running, ok, failed, skipped
    seconds: float = 0.0
    why: str = ""
    handle: Any = None
    t0: float = 0.0
    devices: list[int] = field(default_factory=list)


class RunHandle:
    """A ``Run`` (workbench.launch) as a job handle."""

    def __init__(self, run: Any):
        self.run = run

    def poll(self) -> int | None:
        if not self.run.done:
            return None
        return 0 if self.run.status == "finished" else 1

    def kill(self) -> None:
        self.run.stop(grace=5)

    def why(self) -> str:
        f = self.run.failure
        return f"{self.run.status}: {f}" if f else self.run.status


class ProcHandle:
    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def why(self) -> str:
        try:
            return f"exit {self.proc.returncode}: " + self.log.read_text(errors="replace")[-2000:]
        except OSError:
            return f"exit {self.proc.returncode}"


def run_jobs(jobs: list[Job], ngpus: int, per_gpu: int, log: Callable[[str], None], deadline: float = 0.0,
             hard_stop: float = 0.0) -> None:
    """Run ``jobs`` respecting ``needs``; a job of g GPUs takes the g least-loaded GPUs; at most ``per_gpu``
    jobs share a GPU.  A job past its timeout is stopped (failed); jobs whose needs failed are skipped;
    none starts after ``deadline`` and running ones are stopped at ``hard_stop`` (seconds since the call; 0: none)."""
    t_start = time.time()
    by = {j.name: j for j in jobs}
    load = [0] * max(ngpus, 1)
    while True:
        for j in jobs:
            if j.status == "pending" and any(by[n].status in ("failed", "skipped") for n in j.needs if n in by):
                j.status, j.why = "skipped", "needs " + ", ".join(n for n in j.needs if by[n].status in ("failed", "skipped"))
                log(f"skip {j.name}: {j.why}")
        for j in jobs:
            if j.status != "pending" or not all(by[n].status == "ok" for n in j.needs if n in by):
                continue
            if deadline and time.time() - t_start > deadline:
                j.status, j.why = "skipped", "deadline"
                log(f"skip {j.name}: past the phase deadline")
                continue
            order = sorted(range(len(load)), key=lambda g: load[g])[: j.gpus]
            if any(load[g] >= per_gpu for g in order) and any(x.status == "running" for x in jobs):
                continue
            j.devices = sorted(order)
            for g in j.devices:
                load[g] += 1
            j.t0, j.status = time.time(), "running"
            try:
                j.handle = j.start(",".join(map(str, j.devices)))
                log(f"start {j.name} (GPU {j.devices})")
            except Exception as e:  # a config or launch refused: the job fails, the others go on
                j.status, j.why = "failed", f"{type(e).__name__}: {e}"
                for g in j.devices:
                    load[g] -= 1
                log(f"FAILED to start {j.name}: {j.why}")
        running = [j for j in jobs if j.status == "running"]
        if not running and not any(j.status == "pending" for j in jobs):
            return
        time.sleep(1.0)
        for j in running:
            rc = j.handle.poll()
            if rc is None and (time.time() - j.t0 > j.timeout or (hard_stop and time.time() - t_start > hard_stop)):
                j.handle.kill()
                rc, j.why = -1, (f"timeout ({j.timeout:.0f} s)" if time.time() - j.t0 > j.timeout else
                                 f"stopped at the phase's hard stop ({hard_stop:.0f} s)")
            if rc is None:
                continue
            j.seconds = time.time() - j.t0
            for g in j.devices:
                load[g] -= 1
            j.status = "ok" if rc == 0 else "failed"
            if rc != 0:
                j.why = j.why or j.handle.why()
            log(f"{'done' if rc == 0 else 'FAILED'} {j.name} in {j.seconds:.1f}s" + (f": {j.why[-600:]}" if rc else ""))


def run_job(name: str, cfg: Any, gpus: int, work: Path, needs: list[str], timeout: float, entry: tuple[str, ...] | None = None) -> Job:
    """A training run through workbench.launch (``Run.launch``: supervised torchrun, the product path)."""
    from workbench.launch import Run

    def start(devices: str) -> RunHandle:
        env = {"CUDA_VISIBLE_DEVICES": devices} if cfg.parallel.device == "cuda" else {}
        kw = {"entry": entry} if entry else {}
        return RunHandle(Run.launch(cfg.replace(**{"parallel.nproc_per_node": gpus}), work / name, env=env, **kw))

    return Job(name, gpus, start, needs, timeout)


def script_job(name: str, gpus: int, argv: list[str] | Callable[[], list[str]], work: Path, needs: list[str],
               timeout: float) -> Job:
    """A script run as ``python ARGV`` in its own session (``argv`` may be a callable, asked at the start)."""

    def start(devices: str) -> ProcHandle:
        args = argv() if callable(argv) else argv
        (work / name).mkdir(parents=True, exist_ok=True)
        logf = work / name / "log.txt"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
        with open(logf, "w") as fh:
            proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        return ProcHandle(proc, logf)

    return Job(name, gpus, start, needs, timeout)


# --------------------------------------------------------------------------- the initial checkpoint (rank side)


def child_init(config: str, run_dir: str) -> int:
    """One rank: the backend's Trainer set up (initialised weights) and saved as iteration 0."""
    from workbench.config import apply_rank_environment, load_config

    cfg = load_config(config)
    apply_rank_environment(cfg)
    from workbench.rank.train import Trainer, teardown

    tr = Trainer(cfg, Path(run_dir))
    tr.setup()
    tr.save()
    return teardown(0)


# --------------------------------------------------------------------------- reading runs


def events_of(work: Path, name: str) -> list[dict]:
    from workbench.run.reader import read_events

    return read_events(work / name) if (work / name / "events").is_dir() else []


def series(ev: list[dict], kind: str = "step", key: str = "loss") -> dict[int, float]:
    return {e["iteration"]: float(e[key]) for e in ev if e["event"] == kind and e.get(key) is not None}


def max_rel(a: dict[int, float], b: dict[int, float], steps: list[int] | None = None) -> tuple[float | None, int | None]:
    keys = [i for i in (steps or sorted(set(a) & set(b))) if i in a and i in b]
    if not keys:
        return None, None
    rel = {i: abs(a[i] - b[i]) / max(abs(b[i]), 1e-12) for i in keys}
    at = max(rel, key=rel.get)
    return rel[at], at


def kernel_path(ev: list[dict]) -> dict:
    s = next((e for e in ev if e["event"] == "run_start"), {})
    return {"layer": (s.get("kernels") or {}).get("layer"), "cuda_graphs": (s.get("kernels") or {}).get("cuda_graphs"),
            "attention": (s.get("kernel_path") or {}).get("attention"), "schedule": (s.get("kernel_path") or {}).get("schedule")}


def parity_record(name: str, fam: str, work: Path, ref_name: str, steps: int) -> dict:
    ev, ref_ev = events_of(work, name), events_of(work, ref_name)
    got, ref = series(ev), series(ref_ev)
    rel, at = max_rel(got, ref)
    rec = {"test": "parity", "case": name, "family": fam, "reference": ref_name, "steps": len(got), "max_rel_loss_diff": rel,
           "at_step": at, "bar": PARITY_BAR, "first_loss": got.get(1), "last_loss": got.get(steps),
           "ref_last_loss": ref.get(steps), "loss_fell": bool(got) and got.get(steps, 99) < got.get(1, 0),
           "kernel_path": kernel_path(ev)}
    ok = rel is not None and rel <= PARITY_BAR and len(got) == steps == len(ref)
    if fam in EVAL_FAMILIES:
        evals = {}
        for key in ("loss", "mlm accuracy"):
            a, b = series(ev, "eval", key), series(ref_ev, "eval", key)
            if b:
                r, i = max_rel(a, b)
                evals[key] = {"max_rel_diff": r, "at_step": i, "values": a, "reference": b}
                ok = ok and r is not None and r <= PARITY_BAR and set(a) == set(b)
        rec["eval"] = evals
        ok = ok and "loss" in evals and (fam != "bert" or "mlm accuracy" in evals)
    rec["pass"] = bool(ok)
    return rec


def resume_record(name: str, work: Path, source: str, same: bool, steps: int, half: int) -> dict:
    got, straight = series(events_of(work, name)), series(events_of(work, source))
    after = list(range(half + 1, steps + 1))
    rel, at = max_rel(got, straight, after)
    diffs = {i: got[i] - straight[i] for i in after if i in got and i in straight}
    worst_abs = max((abs(d) for d in diffs.values()), default=None)
    ok = len(diffs) == len(after) and sorted(got) == after and (
        worst_abs is not None and (worst_abs <= SAME_LAYOUT_ABS if same else rel <= PARITY_BAR))
    return {"test": "resume", "case": name, "saved_by": source, "resumed_at": half, "same_layout": same,
            "compared_steps": len(diffs), "max_abs_loss_diff": worst_abs, "max_rel_loss_diff": rel, "at_step": at,
            "bar": SAME_LAYOUT_ABS if same else PARITY_BAR, "bar_kind": "abs" if same else "rel",
            "loss_diff_per_step": diffs, "pass": bool(ok)}


# --------------------------------------------------------------------------- phases


def select(names: list[str], only: str | None) -> list[str]:
    if not only:
        return names
    keys = [k.strip() for k in only.split(",") if k.strip()]
    return [n for n in names if any(n.startswith(k) for k in keys)]


def phase_a(args: argparse.Namespace, work: Path, log: Callable) -> tuple[list[list[Job]], Callable[[], list[dict]]]:
    tiny, device = args.device == "cpu", args.device
    steps, half = steps_of(tiny)
    me = str(Path(__file__).resolve())
    layouts = select(list(LAYOUTS), args.only)
    resumes = select(list(RESUMES), args.only)
    if tiny:
        layouts = [n for n in layouts if not n.startswith(GPU_ONLY)]
        resumes = [r for r in resumes if not r.startswith(GPU_ONLY)]
    from workbench.kernel_rule import te_available

    if tiny or not te_available():
        skipped = [n for n in layouts if n in TE_ONLY]
        if skipped:
            log(f"skipped (Transformer Engine not importable{' on CPU' if tiny else ''}): {', '.join(skipped)}")
        layouts = [n for n in layouts if n not in TE_ONLY]
    repeat = select(["gpt-repeat"], args.only) if not tiny else []
    for r in resumes:  # a resume needs the run that saved
        if RESUMES[r][0] not in layouts:
            layouts.append(RESUMES[r][0])
    fams = sorted({LAYOUTS[n][0] for n in layouts} | ({"gpt"} if repeat else set()))
    t = args.timeout
    jobs: list[Job] = []
    for fam in fams:
        init = family_config(fam, device, tiny)
        jobs.append(run_job(f"{fam}-init", init, 1, work, [], t, entry=(me, "--child-init")))
        load = {"checkpoint.load_dir": str(work / f"{fam}-init" / "checkpoints"), "checkpoint.finetune": True}
        jobs.append(run_job(f"{fam}-ref", family_config(fam, device, tiny, **load), 1, work, [f"{fam}-init"], t))
        if fam == "gpt" and repeat:
            jobs.append(run_job("gpt-repeat", family_config(fam, device, tiny, **load), 1, work, ["gpt-init"], t))
    saving = {RESUMES[r][0] for r in resumes}
    for n in layouts:
        fam, g, over = LAYOUTS[n]
        load = {"checkpoint.load_dir": str(work / f"{fam}-init" / "checkpoints"), "checkpoint.finetune": True}
        save = {"checkpoint.save_interval": half} if n in saving else {}
        jobs.append(run_job(n, family_config(fam, device, tiny, **load, **over, **save), g, work, [f"{fam}-init"], t))
    for r in resumes:
        src, g, over = RESUMES[r]
        fam = LAYOUTS[src][0]
        ck = work / src / "checkpoints" / f"iter_{half:07d}"
        jobs.append(run_job(r, family_config(fam, device, tiny, **{"checkpoint.load_dir": str(ck)}, **over), g, work, [src], t))

    def evaluate() -> list[dict]:
        recs = []
        for n in layouts:
            recs.append(parity_record(n, LAYOUTS[n][0], work, f"{LAYOUTS[n][0]}-ref", steps))
        for n in repeat:
            recs.append({**parity_record(n, "gpt", work, "gpt-ref", steps), "test": "noise_floor", "informational": True})
        for r in resumes:
            src, _g, over = RESUMES[r]
            recs.append(resume_record(r, work, src, over == LAYOUTS[src][2], steps, half))
        return recs

    return [jobs], evaluate


def conversion_cases(ngpus: int, only: str | None) -> dict[str, tuple[str, dict]]:
    cases = CONVERSIONS_4 if ngpus >= 4 else CONVERSIONS_2
    return {n: cases[n] for n in select(list(cases), only)}


def phase_b(args: argparse.Namespace, work: Path, log: Callable, ngpus: int) -> tuple[list[list[Job]], Callable[[], list[dict]]]:
    tiny, device = args.device == "cpu", args.device
    conv = conversion_cases(ngpus, args.only)
    jobs: list[Job] = []
    steps = 6 if tiny else 30
    for n, (fam, over) in conv.items():
        world = over.get("parallel.tensor_parallel", 1) * over.get("parallel.pipeline_parallel", 1)
        cfg = family_config(fam, device, tiny, **over, **{
            "data.source": "demo", "model.vocab_size": DEMO_VOCAB[fam], "train.train_iters": steps, "train.lr_decay_iters": steps,
            "train.lr": 3e-3 if tiny else 1e-3, "train.eval_interval": 0, "checkpoint.save_on_exit": True})
        train = f"{n}-train"
        jobs.append(run_job(train, cfg, world, work, [], args.timeout))
        argv = [str(ROOT / "tests" / "gpu_proofs" / "two_gpu_conversion.py"), "--ckpt", str(work / train / "checkpoints"),
                "--work", str(work / n), "--result", str(work / n / "result.json"), "--device", device]
        jobs.append(script_job(n, world, argv, work, [train], args.timeout * 2))
    waves = [jobs]
    planner_out = Path(args.planner_out)
    offset = planner_out.stat().st_size if planner_out.exists() else 0  # this call's planner records come after
    planner = select(["planner"], args.only)
    if planner:
        t_phase = time.time()

        def planner_argv() -> list[str]:
            # its own deadline stops its jobs (their process groups are its to end) before the phase's hard stop
            left = args.hard_stop - (time.time() - t_phase) - 40 if args.hard_stop else args.planner_deadline
            deadline = max(30.0, min(args.planner_deadline, left))
            log(f"planner: deadline {deadline:.0f} s")
            return [str(ROOT / "tests" / "gpu_proofs" / "planner_measure.py"), "--set", "2gpu-all", "--out", str(args.planner_out),
                    "--concurrent", "3", "--concurrent-multi", str(args.planner_concurrent), "--keep", str(work / "planner"),
                    "--deadline", f"{deadline:.0f}"] + (["--device", "cpu", "--only", "g2s-tp2-eager"] if tiny else [])

        # after the conversions (their wave ends first): the planner's jobs have the GPUs to themselves
        waves.append([script_job("planner", 0 if tiny else ngpus, planner_argv, work, [], args.planner_deadline + 60)])

    def evaluate() -> list[dict]:
        recs = []
        for n, (fam, over) in conv.items():
            res = work / n / "result.json"
            rec = json.loads(res.read_text()) if res.exists() else {"pass": False, "error": "no result (see the job's log)"}
            recs.append({"test": "conversion", "case": n, "family": fam, "train_layout": over, "train_steps": steps, **rec})
        if planner:
            recs.append(planner_summary(planner_out, offset))
            if tiny:
                recs[-1].update(informational=True, note="CPU self-check: no CUDA memory statistics")
        return recs

    return waves, evaluate


def planner_summary(path: Path, offset: int) -> dict:
    """The planner records written after ``offset`` bytes of ``path`` (this call's): per config and rank, errors in
    percent; pass when every rank of every config is within the planner's bar, allocated and reserved."""
    from workbench.planner.evidence import BAR

    rows, failed = [], []
    text = path.read_bytes()[offset:].decode() if path.exists() else ""
    for ln in (x for x in text.splitlines() if x.strip()):
        r = json.loads(ln)
        if r.get("status") == "failed":
            failed.append(r.get("config"))
        elif r.get("error_reserved_pct") is not None:
            rows.append({"config": r["config"], "rank": r["rank"], "alloc_err_pct": r["error_allocated_pct"],
                         "reserved_err_pct": r["error_reserved_pct"]})
    within = [r for r in rows if abs(r["alloc_err_pct"]) <= 100 * BAR and abs(r["reserved_err_pct"]) <= 100 * BAR]
    return {"test": "planner", "case": "planner", "file": str(path), "ranks_measured": len(rows), "ranks_within_bar": len(within),
            "bar": BAR, "failed_configs": failed, "rows": rows, "pass": bool(rows) and len(within) == len(rows) and not failed}


# --------------------------------------------------------------------------- main


def summary_table(recs: list[dict]) -> str:
    lines = [f"{'test':<11} {'case':<28} {'result':<6} {'measure':<40}"]
    for r in recs:
        if r["test"] in ("parity", "noise_floor"):
            m = f"max rel {r['max_rel_loss_diff']:.2e} @ step {r['at_step']}" if r.get("max_rel_loss_diff") is not None else "no losses"
            for k, v in (r.get("eval") or {}).items():
                if v.get("max_rel_diff") is not None:
                    m += f"; eval {k} {v['max_rel_diff']:.2e}"
        elif r["test"] == "resume":
            m = (f"max abs {r['max_abs_loss_diff']:.2e}, rel {r['max_rel_loss_diff']:.2e} ({r['compared_steps']} steps)"
                 if r.get("max_abs_loss_diff") is not None else "no losses")
        elif r["test"] == "conversion":
            m = (f"verify {r.get('verify_max_abs_diff')}, round trip {r.get('round_trip_identical')}, "
                 f"generate equal {r.get('generate_equal')}")
        elif r["test"] == "planner":
            m = f"{r.get('ranks_within_bar')}/{r.get('ranks_measured')} ranks within {100 * r.get('bar', 0):.0f}%"
        else:
            m = f"{r.get('status')}: {(r.get('why') or '')[-120:]}".replace("\n", " ")
        res = "info" if r.get("informational") else ("PASS" if r.get("pass") else "FAIL")
        lines.append(f"{r['test']:<11} {r['case']:<28} {res:<6} {m}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["a", "b", "all"], default="a", help="a: parity + resume; b: conversion + planner")
    ap.add_argument("--out", default=str(ROOT / "evidence" / "two_gpu_proof.jsonl"))
    ap.add_argument("--planner-out", default=str(ROOT / "evidence" / "planner_2gpu.jsonl"))
    ap.add_argument("--work", default="/tmp/two_gpu_proof", help="run directories (one per case)")
    ap.add_argument("--only", default=None, help="cases by name or prefix, comma-separated (see --list)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the self-check on tiny models (gloo)")
    ap.add_argument("--per-gpu", type=int, default=3, help="jobs sharing a GPU at once")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per training run (default 240 on GPUs, 900 on CPU)")
    ap.add_argument("--deadline", type=float, default=400, help="seconds: start no job later than this into the phase")
    ap.add_argument("--hard-stop", type=float, default=520,
                    help="seconds: stop the jobs still running this far into the phase (its records say so); 0: never")
    ap.add_argument("--planner-deadline", type=float, default=240, help="planner_measure's own deadline (seconds)")
    ap.add_argument("--planner-concurrent", type=int, default=3,
                    help="planner jobs at once under its memory budget (1: each alone, so the device-wide memory outside "
                         "torch is its own; the per-process numbers hold either way)")
    ap.add_argument("--child-init", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_init:
        return child_init(args.config, args.run_dir)
    if args.list:
        for n, (fam, g, over) in LAYOUTS.items():
            print(f"a  {n:<28} {fam:<6} {g} GPU(s) {over}")
        print(f"a  {'gpt-repeat':<28} gpt    1 GPU    the one-GPU reference again (noise floor)")
        for n, (src, g, over) in RESUMES.items():
            print(f"a  {n:<28} from {src} at step half-way, {g} GPU(s) {over}")
        for n, (fam, over) in {**CONVERSIONS_2, **CONVERSIONS_4}.items():
            print(f"b  {n:<28} {fam:<6} trained at {over}")
        print(f"b  {'planner':<28} tests/gpu_proofs/planner_measure.py --set 2gpu-all")
        return 0
    tiny = args.device == "cpu"
    args.timeout = args.timeout or (900.0 if tiny else 240.0)
    ngpus = 0
    if not tiny:
        import torch

        ngpus = torch.cuda.device_count()
        if ngpus < 2:
            print(f"{ngpus} GPU(s) visible: this proof needs 2", file=sys.stderr)
            return 2
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 8) // (2 * args.per_gpu))))
    from workbench.provenance import stamp as provenance

    stamp = provenance()
    if os.environ.get("GIT_COMMIT"):
        stamp.update(commit=os.environ["GIT_COMMIT"], git_commit=os.environ["GIT_COMMIT"])
    if not tiny:
        import torch

        stamp["device"] = f"{ngpus} x {torch.cuda.get_device_name(0)}"
    work = Path(args.work) / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_all = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_all:7.1f}s] {msg}", flush=True)

    phases = ["a", "b"] if args.phase == "all" else [args.phase]
    recs: list[dict] = []
    for ph in phases:
        t_phase = time.time()
        waves, evaluate = phase_a(args, work, log) if ph == "a" else phase_b(args, work, log, ngpus)
        jobs = [j for w in waves for j in w]
        log(f"phase {ph}: {len(jobs)} jobs: {', '.join(j.name for j in jobs)}")
        for i, wave in enumerate(waves):
            # the conversion wave's jobs are mostly CPU work (export, verify on CPU ranks): more of them share a GPU
            per = 1 if tiny else args.per_gpu + (2 if ph == "b" and i == 0 else 0)
            hard = max(1.0, args.hard_stop - (time.time() - t_phase)) if args.hard_stop else 0.0
            run_jobs(wave, ngpus, per, log, args.deadline if i == 0 else 0, hard)
        phase_recs = evaluate()
        for j in jobs:
            if j.status != "ok":
                phase_recs.append({"test": "job", "case": j.name, "status": j.status, "why": j.why[-3000:], "pass": False})
        with open(out, "a") as fh:
            for r in phase_recs:
                r = {**stamp, "phase": ph, **r, "seconds": next((j.seconds for j in jobs if j.name == r["case"]), None)}
                fh.write(json.dumps(r, default=str) + "\n")
        recs += phase_recs
    log(f"wrote {len(recs)} records to {out}")
    print(summary_table(recs), flush=True)
    return 0 if all(r.get("pass") or r.get("informational") for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
