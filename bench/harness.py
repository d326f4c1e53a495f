"""What the benchmark scripts share: step timing, the one-GPU training measurement of a family's
benchmark (``bench/bert_train.py``, ``bench/t5_bench.py``), their torchrun worker plumbing and
JSON-lines rows, and the HF references' training step.

The scripts are run as ``python bench/<x>.py``; each puts the repository root on ``sys.path``
first, so this module is imported as ``bench.harness``.  Nothing here imports torch or the
workbench at module level (the launcher side of a script stays light).

Benchmark-only code: it lives in ``bench/``, never in ``workbench/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- timing


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls after 3 untimed ones: a probe's timer for one kernel-sized
    piece (``workbench.advisor.measure.median_seconds``), not the training protocol."""
    from workbench.advisor.measure import median_seconds

    return 1e3 * median_seconds(fn, iters, cuda)


#: a step at least this long prints a progress line (stderr), so a row cut by its timeout shows in its log how far it
#: got and what each step cost (fast steps stay quiet)
PROGRESS_MIN_S = 1.0


def progress(phase: str, i: int, n: int | None, seconds: float) -> None:
    """``[harness] <phase> step i[/n]: <s> s`` on stderr for a slow step (:data:`PROGRESS_MIN_S`)."""
    if seconds >= PROGRESS_MIN_S:
        print(f"[harness] {phase} step {i}{f'/{n}' if n else ''}: {seconds:.2f} s", file=sys.stderr, flush=True)


def time_steps(step: Callable[[], Any], n: int, cuda: bool, clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Seconds of each of ``n`` calls of ``step``, the device synchronised before and after each (slow ones said:
    :func:`progress`)."""
    out = []
    for i in range(n):
        sync(cuda)
        t0 = clock()
        step()
        sync(cuda)
        out.append(clock() - t0)
        progress("timed", i + 1, n, out[-1])
    return out


def median(xs: list[float]) -> float:
    """The upper median (an element of ``xs``); NaN for no values."""
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


# --------------------------------------------------------------------------- the measurement protocol


@dataclass(frozen=True)
class Protocol:
    """How every throughput row is measured (the one protocol; a row stores it under ``"protocol"``).

    A side (one variant of a comparison) is run ``repeats`` times, each in a fresh process, interleaved with
    the other side (A B A B A B) so that drift of clocks, temperature or neighbours hits both alike.  In each
    process :func:`warm_up` steps until the last ``window`` step times agree within ``tolerance`` (at least
    ``warmup_min`` steps, at most ``warmup_max`` steps or ``warmup_max_s`` seconds: a run that never settles
    is marked ``steady: false``), then ``steps`` steps are timed, each between device synchronisations; the
    process's number is the median step.  The row stores every repeat's median, the median of the medians
    and the spread; a ratio of two sides is reported with its range, the worst and best of all pairings of
    their repeats (:func:`ratio`), and a target counts as met only when the worst pairing clears it."""

    steps: int = 20
    repeats: int = 3
    warmup_min: int = 5
    warmup_max: int = 60
    warmup_max_s: float = 180.0
    window: int = 5
    tolerance: float = 0.03

    NAME = "harness-v1"

    def record(self) -> dict[str, Any]:
        return {"name": self.NAME, **dataclasses.asdict(self)}


#: CPU smokes (CI): the protocol's code at its smallest (one repeat: the interleaving has a test of its own)
SMOKE = Protocol(steps=2, repeats=1, warmup_min=2, warmup_max=3, window=2, tolerance=10.0)


def settled(times: list[float], window: int, tolerance: float) -> bool:
    """Whether the last ``window`` times agree within ``tolerance`` (max - min over their median)."""
    if len(times) < window:
        return False
    last = times[-window:]
    return (max(last) - min(last)) / median(last) <= tolerance


def warm_up(step: Callable[[], Any], cuda: bool, p: Protocol, clock: Callable[[], float] = time.perf_counter,
            agree: Callable[[bool, bool], tuple[bool, bool]] | None = None) -> dict[str, Any]:
    """Untimed-for-the-row steps until steady (see :class:`Protocol`): their times, count, seconds, and whether
    the bound was reached first (``steady: false``).  ``clock``: the time source (tests plant one).  ``agree``: on
    more than one rank, the vote that ends every rank's warm-up at the same step (:func:`rank_vote`: this rank's
    (settled, at its bound) in, (every rank settled, any rank at its bound) out); a rank that decided alone runs
    more steps than its peers and waits for them in a collective until its process is killed."""
    vote = agree or (lambda settled_here, bound_here: (settled_here, bound_here))
    times: list[float] = []
    t0 = clock()
    while True:
        sync(cuda)
        s = clock()
        step()
        sync(cuda)
        times.append(clock() - s)
        progress("warm-up", len(times), None, times[-1])
        here = len(times) >= p.warmup_min and settled(times, p.window, p.tolerance)
        bound = len(times) >= p.warmup_max or clock() - t0 >= p.warmup_max_s
        all_settled, any_bound = vote(here, bound)
        if all_settled or any_bound:  # every rank settled, or any rank at its bound: all stop
            steady = all_settled
            break
    return {"warmup_steps": len(times), "warmup_times": times, "warmup_s": clock() - t0, "steady": steady}


def rank_vote(device: Any) -> Callable[[bool, bool], tuple[bool, bool]] | None:
    """The ranks' vote for :func:`warm_up`'s ``agree``: (every rank of the default process group settled, any rank at
    its bound), one all-reduce MIN of two numbers on ``device`` (the backend's device) a step; None in a single
    process."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    flag = torch.zeros(2, device=device)

    def vote(settled: bool, bound: bool) -> tuple[bool, bool]:
        flag.copy_(torch.tensor([1.0 if settled else 0.0, 0.0 if bound else 1.0]))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        out = flag.tolist()
        return out[0] > 0.5, out[1] < 0.5

    return vote


def split_recorded(times: list[float], p: Protocol) -> dict[str, Any]:
    """:func:`measure_steps`' rule applied to step times a run recorded itself (the product's step events, where the
    benchmark cannot drive the steps): the warm-up ends at the first step count >= ``warmup_min`` whose last
    ``window`` times agree within ``tolerance`` (or at ``warmup_max`` steps or ``warmup_max_s`` seconds: ``steady:
    false``); the next ``p.steps``
    times are the timed ones.  Raises ValueError when the run recorded too few steps for that."""
    n, steady, spent = len(times), False, 0.0
    for k in range(1, len(times) + 1):  # warm_up's loop, step by step
        spent += times[k - 1]
        if k >= p.warmup_min and settled(times[:k], p.window, p.tolerance):
            n, steady = k, True
            break
        if k >= p.warmup_max or spent >= p.warmup_max_s:
            n = k
            break
    timed = times[n:n + p.steps]
    if len(timed) < p.steps:
        raise ValueError(f"{len(times)} recorded steps: {n} of warm-up leave {len(timed)} of the {p.steps} timed steps")
    return {"step_times": timed, "step_s": median(timed), "warmup_steps": n, "warmup_times": times[:n],
            "warmup_s": sum(times[:n]), "steady": steady}


def measure_steps(step: Callable[[], Any], cuda: bool, p: Protocol, clock: Callable[[], float] = time.perf_counter,
                  before_timing: Callable[[], Any] | None = None,
                  agree: Callable[[bool, bool], tuple[bool, bool]] | None = None) -> dict[str, Any]:
    """One process's measurement under ``p``: :func:`warm_up` (``agree``: the ranks' vote, required where ranks step
    together), then ``p.steps`` timed steps; the median step (``step_s``), every step time and the warm-up record.
    ``before_timing`` runs between the two (e.g. a reset of the peak-memory counters)."""
    warm = warm_up(step, cuda, p, clock, agree)
    if before_timing is not None:
        before_timing()
    times = time_steps(step, p.steps, cuda, clock)
    return {"step_times": times, "step_s": median(times), **warm}


def side(values: list[float]) -> dict[str, Any]:
    """One side's repeats (each a process's number, e.g. tokens/s): all of them, their median and spread
    ((max - min) / median)."""
    m = median(values)
    return {"repeats": values, "median": m, "min": min(values), "max": max(values), "spread": (max(values) - min(values)) / m}


def ratio(a: list[float], b: list[float], target: float | None = None) -> dict[str, Any]:
    """``a`` over ``b`` (higher is better on both, e.g. tokens/s): the ratio of the medians and its range over
    every pairing of a repeat of ``a`` with a repeat of ``b`` (worst: ``min(a) / max(b)``); ``met`` only when the
    worst pairing clears ``target`` (None: no target)."""
    worst, best = min(a) / max(b), max(a) / min(b)
    out: dict[str, Any] = {"ratio": median(a) / median(b), "worst": worst, "best": best,
                           "paired": [x / y for x, y in zip(a, b)]}  # repeat i of each side, run back to back
    if target is not None:
        out.update(target=target, met=worst >= target)
    return out


def interleaved(sides: dict[str, Callable[[int], dict[str, Any]]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each side's measurement ``repeats`` times, interleaved (A B A B ...): ``sides[name](i)`` runs repeat ``i``
    in a fresh process and returns its result; the wall seconds each took are added (``repeat_wall_s``: what
    a repeat costs, compile cache warm after the first)."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for i in range(repeats):
        for name, run_one in sides.items():
            t0 = time.perf_counter()
            res = run_one(i)
            res["repeat_wall_s"] = round(time.perf_counter() - t0, 1)
            out[name].append(res)
    return out


def compare(results: dict[str, list[dict[str, Any]]], over: str, base: str, key: str = "tokens_per_s",
            target: float | None = None) -> dict[str, Any] | None:
    """The protocol's comparison of side ``over`` against side ``base`` on ``key``: both sides' repeats and the
    ratio with its range; None when a repeat of either side has no number (its ``error`` says why)."""
    a = [r.get(key) for r in results[over]]
    b = [r.get(key) for r in results[base]]
    if not a or not b or any(x is None for x in a + b):
        return None
    return {over: side(a), base: side(b), **ratio(a, b, target)}



def add_protocol_args(ap: argparse.ArgumentParser) -> None:
    """The protocol's knobs on a benchmark's command line (defaults: :class:`Protocol`'s)."""
    d = Protocol()
    ap.add_argument("--steps", type=int, default=d.steps, help=f"timed steps per process (default {d.steps})")
    ap.add_argument("--repeats", type=int, default=d.repeats, help=f"fresh processes per side, interleaved (default {d.repeats})")
    ap.add_argument("--warmup", type=int, default=d.warmup_min, help=f"at least this many warm-up steps (default {d.warmup_min})")
    ap.add_argument("--warmup-max", type=int, default=d.warmup_max,
                    help=f"at most this many warm-up steps while step times have not settled (default {d.warmup_max})")


def protocol(a: argparse.Namespace) -> Protocol:
    """The protocol a benchmark's arguments ask for (``--cpu-smoke``: :data:`SMOKE`'s size, at most)."""
    if getattr(a, "cpu_smoke", False):
        return dataclasses.replace(SMOKE, steps=min(a.steps, SMOKE.steps), repeats=min(getattr(a, "repeats", 1), SMOKE.repeats))
    d = Protocol()
    return dataclasses.replace(d, steps=a.steps, repeats=getattr(a, "repeats", d.repeats), warmup_min=a.warmup,
                               warmup_max=max(getattr(a, "warmup_max", d.warmup_max), a.warmup))

# --------------------------------------------------------------------------- a family's one-GPU training rows


def bench_cfg(preset_name: str, smoke: bool, *, smoke_preset: str, **over: Any):
    """The run config of a family's throughput / planner row: the preset AS SHIPPED (its dropout, micro-batch,
    global batch, precision, kernels) on synthetic data, without eval, checkpoints or micro-batch timing;
    ``smoke``: ``smoke_preset`` on CPU, fp32, micro-batch 2, global batch 4.  ``over``: dotted overrides on top
    (a row at other settings names them: :data:`DROPOUT0`)."""
    from workbench.config import preset

    if smoke:
        base = {"data.source": "synthetic", "train.micro_batch_size": 2, "train.global_batch_size": 4, "train.eval_interval": 0,
                "checkpoint.save_on_exit": False, "parallel.device": "cpu", "train.precision": "fp32", "train.compile_kernels": False}
        return preset(smoke_preset, **{**base, **over})
    base = {"data.source": "synthetic", "train.eval_interval": 0, "checkpoint.save_on_exit": False,
            "train.microbatch_timing_interval": 0, "parallel.device": "cuda"}
    return preset(preset_name, **{**base, **over})


def settings(cfg: Any) -> dict[str, Any]:
    """What a throughput row trains with: dropout, batch, lengths, precision (stored with the row)."""
    from workbench.config import derive

    m, t = cfg.model, cfg.train
    return {"hidden_dropout": m.hidden_dropout, "attention_dropout": m.attention_dropout, "micro_batch_size": t.micro_batch_size,
            "microbatches": derive(cfg).num_microbatches, "seq_length": m.seq_length, "precision": t.precision}


def train_worker(kind: str, preset_name: str, cfg: Any, a: argparse.Namespace, *,
                 reference: Callable[..., Any], dataset: Callable[[Any], Any], tmp_prefix: str) -> dict[str, Any]:
    """One training measurement in this (torchrun) process: ``kind`` "reference" trains
    ``reference(cfg, device=, compile=, mode=)`` (a :class:`HFReference`) on 8 micro-batches of ``dataset(cfg)``
    cycled; anything else trains the workbench's ``Trainer`` and adds the planner's rank-0 peak.
    Measured by :func:`measure_steps` under :func:`protocol` ``(a)`` (warm-up until steady, then the timed
    steps): step times, median step, the warm-up record, tokens/s, peak memory and (GPU) MFU."""
    import torch

    from workbench.config import derive

    cuda = not a.cpu_smoke
    d = derive(cfg)
    out: dict[str, Any] = {"preset": preset_name, "kind": kind, "tokens_per_step": d.tokens_per_step, "flops_per_step": d.flops_per_step}
    if kind == "reference":
        dev = "cuda" if cuda else "cpu"
        mode = getattr(a, "reference_compile", "default")
        ref = reference(cfg, device=dev, compile=cuda, mode=None if mode == "default" else mode)
        import transformers

        out.update(reference_model=type(ref.model).__name__, reference_attention=getattr(ref, "attention", None),
                   reference_compile=mode if cuda else "eager", transformers=transformers.__version__)
        ds = dataset(cfg)
        mbs, k = cfg.train.micro_batch_size, d.num_microbatches
        pool = []
        for j in range(8):
            items = [ds[j * mbs + i] for i in range(mbs)]
            pool.append({key: torch.stack([it[key] for it in items]).to(dev) for key in items[0]})
        state = {"i": 0}

        first_losses = out.setdefault("first_losses", [])

        def step() -> float:
            i = state["i"]
            state["i"] += 1
            loss = ref.step([pool[(i * k + j) % len(pool)] for j in range(k)])
            if len(first_losses) < 5:  # the training itself, comparable across compile modes
                first_losses.append(loss)
            return loss

    else:
        from workbench import planner
        from workbench.rank.train import Trainer

        tr = Trainer(cfg, tempfile.mkdtemp(prefix=tmp_prefix))
        tr.setup()
        tr.collector.start()  # the training loop's garbage collection (this worker process ends with its row)
        step = tr.train_step
    measured = measure_steps(step, cuda, protocol(a), before_timing=torch.cuda.reset_peak_memory_stats if cuda else None)
    if getattr(a, "profile", False):  # after the timed steps: the profilers never slow a timed one
        from bench.profiling import host_profile, profile_steps

        out["profile"] = profile_steps(step, cuda, True)
        out["host_profile"] = host_profile(step, cuda, True)  # where the host's Python time goes
    if kind != "reference":
        plan = planner.predict(cfg)
        out["planner_peak_allocated"] = int(plan.stages[0].peak_allocated)
        out["kernel_path"] = tr.kernel_path
        if tr.step_graph is not None:  # a failed capture trains eagerly: such a row is not the step graph's
            out["step_graph"] = {"failed": tr.step_graph.failed, "eager_steps": tr.step_graph.eager_steps,
                                 "captured": tr.step_graph.captured}
    step_s = measured["step_s"]
    from torch._dynamo.utils import counters

    # where compiling fell short: graph breaks, and compiled graphs that cudagraph trees did not record
    out.update(graph_breaks=int(sum(counters["graph_break"].values())),
               cudagraph_skips=int(counters["inductor"].get("cudagraph_skips", 0)))
    out.update(measured, tokens_per_s=d.tokens_per_step / step_s,
               mem_peak=int(torch.cuda.max_memory_allocated()) if cuda else None,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    if cuda:
        from workbench.rank.metrics import peak_tflops

        peak = peak_tflops(out["device"], cfg.train.precision, None)
        out["mfu"] = d.flops_per_step / step_s / 1e12 / peak if peak else None
    return out


# --------------------------------------------------------------------------- launcher side

from bench.processes import check_gpus, gpu_strangers, run_group  # noqa: E402,F401  (the scripts call them as harness.*)


def torchrun(nproc: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``torch.distributed.run`` over ``nproc`` local processes, from the repository root, output captured."""
    from workbench.run.files import free_port

    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])  # keep carried wheels' site dir
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *args]
    return run_group(cmd, timeout, cwd=ROOT, env=env)


def measure(script: str, kind: str, preset_name: str, a: argparse.Namespace, over: dict[str, Any] | None = None,
            profile: bool = False) -> dict[str, Any]:
    """``script --worker kind`` in its own one-process torchrun: its result, or the log's tail as ``error``.
    ``over``: dotted config overrides the worker applies on top of the row's config (:func:`overrides`);
    ``profile``: a torch-profiler summary of a few steps after the timed ones (``profile`` in the result)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        res_path = fh.name
    extra = (["--cpu-smoke"] if a.cpu_smoke else []) + (["--set", json.dumps(over)] if over else []) + (["--profile"] if profile else [])
    if kind == "reference":  # the HF yardstick's compile mode (the workbench's own workers take none)
        extra += ["--reference-compile", getattr(a, "reference_compile", "default")]
    why = ""
    try:
        proc = torchrun(1, [str(Path(script).resolve()), "--worker", kind, "--preset", preset_name, "--result", res_path,
                            "--steps", str(a.steps), "--warmup", str(a.warmup), "--warmup-max", str(a.warmup_max), *extra], a.timeout)
    except subprocess.TimeoutExpired as e:  # this repeat has no number; the row goes on with the others (its log kept)
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.output, e.stderr)]
        proc, why = subprocess.CompletedProcess(e.cmd, -9, text[0], text[1]), f"[timed out after {a.timeout:g} s]\n"
    res = ({"kind": kind, "preset": preset_name, "error": why + proc.stdout[-1500:] + proc.stderr[-3000:]} if proc.returncode != 0
           else json.loads(Path(res_path).read_text()))
    if getattr(a, "out", None):  # each process's result as it comes (a row cut short still has its repeats)
        with open(Path(a.out).with_suffix(".partial.jsonl"), "a") as fh:
            fh.write(json.dumps({"kind": kind, "preset": preset_name, "over": over, "commit": os.environ.get("GIT_COMMIT"),
                                 **{k: res.get(k) for k in ("tokens_per_s", "step_s", "warmup_steps", "steady", "mfu", "device", "error",
                                                                 "step_times", "warmup_times", "profile", "host_profile",
                                                                 "reference_compile", "first_losses")}}) + "\n")
    return res


def throughput_row(script: str, preset_name: str, a: argparse.Namespace, cfg: Any, *, row: str = "throughput",
                   over: dict[str, Any] | None = None, target: float | None = 1.15, note: str | None = None) -> dict[str, Any]:
    """The workbench against the HF reference under the protocol: same config ``cfg`` (the preset as shipped, or
    ``over`` on top, which ``row`` then names), same batches, same GPU, each side ``repeats`` times in fresh
    processes, interleaved: every repeat's result, the tokens/s ratio of the medians with its range, and
    whether the worst pairing clears ``target`` (None: a row with no target, ``note`` says why)."""
    p = protocol(a)
    res = interleaved({kind: (lambda i, kind=kind: measure(script, kind, preset_name, a, over, profile=a.profile and i == 0))
                       for kind in ("workbench", "reference")}, p.repeats)
    cmp = compare(res, "workbench", "reference", target=target)
    return {"row": row, "preset": preset_name, "settings": settings(cfg), "protocol": p.record(),
            "workbench": res["workbench"], "reference": res["reference"], "comparison": cmp,
            "ratio": cmp["ratio"] if cmp else None, "range": [cmp["worst"], cmp["best"]] if cmp else None,
            "target": f">= {target:g} (worst pairing)" if target is not None else note, "met": cmp.get("met") if cmp else None}


def planner_row(script: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    """The planner's rank-0 peak against the measured peak allocated (target within 10%)."""
    wb = measure(script, "workbench", preset_name, a)
    pred, meas = wb.get("planner_peak_allocated"), wb.get("mem_peak")
    return {"row": "planner", "preset": preset_name, "predicted": pred, "measured": meas,
            "rel_error": (pred - meas) / meas if pred and meas else None, "target": "|rel_error| <= 0.10",
            "error": wb.get("error")}


def overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The dotted config overrides a worker was given (``--set``, a JSON object)."""
    return json.loads(a.set) if getattr(a, "set", None) else {}


#: dropout 0.1 (BERT's and T5's published setting, their presets' default): the ``dropout`` row trains it on each
#: attention backend
DROPOUT = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
#: the ``throughput-dropout0`` rows: no dropout on either side (not what the presets train with)
DROPOUT0 = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}


def dropout_row(script: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    """Under dropout 0.1: the workbench with ``attention_backend`` sdpa (the compiled layer), te (TE's layer) and
    ``auto``; ``te_vs_sdpa``: TE's tokens/s over SDPA's (TE's side is an ``error`` where TE is not importable)."""
    res = {b: measure(script, "workbench", preset_name, a, {**DROPOUT, "model.attention_backend": b}) for b in ("sdpa", "te", "auto")}
    tps = {b: r.get("tokens_per_s") for b, r in res.items()}
    return {"row": "dropout", "preset": preset_name, "measured": "one process per backend: not a protocol ratio", **{b: {k: r.get(k) for k in ("tokens_per_s", "mfu", "mem_peak", "kernel_path", "error")}
                                                       for b, r in res.items()},
            "te_vs_sdpa": tps["te"] / tps["sdpa"] if tps["te"] and tps["sdpa"] else None}


def wanted(a: argparse.Namespace) -> list[str]:
    """The row names of ``--rows``."""
    return [r.strip() for r in a.rows.split(",") if r.strip()]


def training_rows(script: str, a: argparse.Namespace, presets: list[str], cfg: Callable[..., Any]) -> list[dict[str, Any]]:
    """Those ``--rows`` asks for: ``throughput`` (each of ``presets`` as shipped against its HF yardstick: the
    headline rows), ``throughput-dropout0`` (the first preset with dropout 0 on both sides), ``planner`` (each
    preset) and ``dropout`` (the first preset on each attention backend).  ``cfg(name, **over)``: the row's config."""
    want = wanted(a)
    if getattr(a, "presets", None):
        unknown = [p for p in a.presets.split(",") if p not in presets]
        if unknown:  # (the smoke's tiny preset stands for them on CPU)
            print(f"--presets: {', '.join(unknown)} not among this benchmark's {', '.join(presets)}; fix: name some of "
                  f"those", file=sys.stderr)
            raise SystemExit(2)
        presets = a.presets.split(",")
    out = [throughput_row(script, name, a, cfg(name)) for name in presets] if "throughput" in want else []
    if "throughput-dropout0" in want:
        out.append(throughput_row(script, presets[0], a, cfg(presets[0], **DROPOUT0), row="throughput-dropout0",
                                  over=DROPOUT0, target=None, note="(dropout 0: not the presets' setting)"))
    if "planner" in want:
        out += [planner_row(script, name, a) for name in presets]
    if "dropout" in want:
        out.append(dropout_row(script, presets[0], a))
    return out


def parser(doc: str, *, rows: str, rows_help: str, smoke_help: str, out: str, preset: str) -> argparse.ArgumentParser:
    """A family benchmark's arguments (``--worker``, ``--preset``, ``--result``: the worker's, hidden)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rows", default=rows, help=rows_help)
    ap.add_argument("--presets", default=None, help="comma list: only these of the benchmark's presets (default: all)")
    add_protocol_args(ap)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--cpu-smoke", action="store_true", help=smoke_help)
    ap.add_argument("--profile", action="store_true",
                    help="throughput rows: torch-profiler and cProfile summaries of each side's first repeat")
    ap.add_argument("--reference-compile", default="default", choices=("default", "reduce-overhead"),
                    help="the HF reference's torch.compile mode (reduce-overhead: its forward and backward as CUDA graphs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / out))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preset", default=preset, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--set", default=None, help=argparse.SUPPRESS)  # the worker's config overrides, JSON
    return ap


def run(a: argparse.Namespace, worker: Callable[[argparse.Namespace], dict[str, Any]],
        rows: Callable[[argparse.Namespace], list[dict[str, Any]]]) -> int:
    """A family benchmark's main (``--cpu-smoke``: the protocol at :data:`SMOKE`'s size); a worker writes its result
    (rank 0); the launcher appends each of ``rows(a)`` to ``--out`` stamped with date, commit and
    ``cpu_smoke``, and prints a brief of each."""
    if a.worker:
        res = worker(a)
        if int(os.environ.get("RANK", "0")) == 0:
            Path(a.result).write_text(json.dumps(res))
        return 0
    from workbench.provenance import git_commit

    stamp = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
             "cpu_smoke": a.cpu_smoke}
    results = rows(a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as fh:
        for r in results:
            fh.write(json.dumps({**stamp, **r}) + "\n")
    for r in results:
        brief = {k: v for k, v in r.items() if k not in ("workbench", "reference", "losses", "comparison", "protocol")}
        if r["row"].startswith("throughput"):
            brief.update(mfu=[x.get("mfu") for x in r["workbench"]], steady=[x.get("steady") for x in r["workbench"] + r["reference"]],
                         repeat_wall_s=[x.get("repeat_wall_s") for x in r["workbench"] + r["reference"]],
                         errors=[x.get("error")[-500:] for x in r["workbench"] + r["reference"] if x.get("error")])
        print(json.dumps(brief, default=str))
    print_ratios(results)
    return 0


def print_ratios(results: list[dict[str, Any]]) -> None:
    """One line per throughput row: both sides' median tokens/s and spread, the ratio with its range, the verdict."""
    rows = [r for r in results if r["row"].startswith("throughput")]
    if rows:
        print(f"{'row':<20} {'preset':<14} {'dropout h/a':<12} {'batch':<8} {'workbench':>18} {'reference':>18} {'ratio [worst, best]':>22}  met")
    for r in rows:
        st, c = r["settings"], r.get("comparison")
        if not c:
            errors = [x.get("error", "")[-200:] for x in r["workbench"] + r["reference"] if x.get("error")]
            print(f"{r['row']:<20} {r['preset']:<14} error: {errors[:1]}")
            continue
        fmt = lambda sd: f"{sd['median'] / 1e3:9.1f}k ±{sd['spread'] * 50:4.1f}%"  # noqa: E731 (half the spread)
        rng = f"{c['ratio']:.2f}x [{c['worst']:.2f}, {c['best']:.2f}]"
        print(f"{r['row']:<20} {r['preset']:<14} {st['hidden_dropout']:g}/{st['attention_dropout']:<10g} "
              f"{st['micro_batch_size']}x{st['microbatches']:<6} {fmt(c['workbench']):>18} {fmt(c['reference']):>18} {rng:>22}  "
              f"{'-' if r.get('met') is None else ('yes' if r['met'] else 'NO')}")


# --------------------------------------------------------------------------- the HF references' step


class HFReference:
    """An HF model trained like the workbench's step: grad accumulation over micro-batches (each loss
    divided by their number), clip, fused AdamW on CUDA, autocast to the config's half precision over
    fp32 weights, the whole model under ``torch.compile`` (``compile``).  A subclass gives ``_loss(batch)``."""

    def __init__(self, model: Any, cfg: Any, device: str = "cuda", compile: bool = True, mode: str | None = None):
        import torch

        t = cfg.train
        self.device = torch.device(device)
        self.model = model.to(self.device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                                           weight_decay=t.weight_decay, fused=self.device.type == "cuda")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
        self.clip = t.clip_grad
        #: ``mode``: the ``torch.compile`` mode (None: the default).  "reduce-overhead" (cudagraph trees; unmeasured
        #: on GPU as of 2026-11-29: compare its ``first_losses`` with the default mode's before quoting a row): the gradients are
        #: allocated once and zeroed in place, so a graph's output never becomes a ``.grad`` that the next micro-batch's
        #: replay overwrites (torch refuses, or accumulates wrongly, when ``.grad`` is allocated during a capture)
        self.graphed = compile and mode == "reduce-overhead"
        if self.graphed:
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        self.forward = torch.compile(self.model, mode=mode) if compile else self.model

    def _loss(self, b: dict[str, Any]) -> Any:
        raise NotImplementedError

    def step(self, microbatches: list[dict[str, Any]]) -> float:
        """One optimizer step over ``microbatches``; the mean loss."""
        import torch

        self.optimizer.zero_grad(set_to_none=not self.graphed)
        total = 0.0
        for b in microbatches:
            with torch.autocast(self.device.type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None):
                loss = self._loss(b) / len(microbatches)
            loss.backward()
            total += loss.detach()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return float(total)
