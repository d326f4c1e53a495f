"""The multi-GPU yardstick for decoder training (issue #50): a plain FSDP2 Llama trainer, as strong as plain
PyTorch goes, for the workbench's layout rows to be measured against.

What a capable user would run instead of the workbench is torchtitan's Llama-3 trainer (FSDP2 + torch.compile).
No torchtitan release on PyPI of 0.3.x or newer runs on the GPU machines' torch 2.11.0+cu130 (checked 2026-11):

- torchtitan 0.3.0 (the only 0.3.x; pure Python, Requires-Python >= 3.11) fails at import:
  ``torchtitan/trainer.py`` -> ``components/validate.py`` -> ``distributed/full_dtensor.py`` line 23,
  ``from torch.distributed.fsdp import DataParallelMeshDims``:
  ``ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'``.  torch 2.11 has
  neither ``DataParallelMeshDims`` nor ``fully_shard(..., dp_mesh_dims=)`` (torch 2.14 has both); its
  ``torch_checkpointing`` dependency asks for torch >= 2.11, its code for a later one.  (torchtitan 0.2.2, of
  2026-02, older than the brief allows, does import on torch 2.11; its trainer was not tried.)

So this file is the yardstick the brief names in that case, trained the way torchtitan trains a Llama
(``torchtitan/models/llama3/parallelize.py`` and ``distributed/fsdp.py`` of 0.3.0, read for this):

- the architecture of :mod:`bench.reference_llama` (imported, not copied: RoPE, RMSNorm, SwiGLU, GQA, no biases,
  tied or untied head, the workbench's padded vocabulary; the same parameter count as ``derive(cfg)``), built on
  the meta device and initialised after sharding;
- per block (in this order, as torchtitan): optional activation checkpointing (``checkpoint_wrapper``, the whole
  block), ``torch.compile(fullgraph=True)`` of the block, ``fully_shard`` of the block; the embedding, final norm
  and head grouped as torchtitan groups them (one unit when tied; the head unit not resharded after forward),
  then the root;
- ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 sharded master weights, bf16 compute and
  all-gathers, fp32 gradient reduce-scatter; no autocast;
- fused AdamW over the DTensor shards with Megatron's weight-decay groups (:func:`bench.reference_gpt._param_groups`),
  global-norm clipping over the shards (torchtitan's way: the norm's ``full_tensor()``), the loss
  ``cross_entropy`` on fp32 logits, compiled; torch SDPA causal attention, cuDNN first on Hopper (as the one-GPU
  reference); loss averaged over micro-batches, gradients averaged over ranks by FSDP.

Data: synthetic tokens made on the ranks (a pool of 8 micro-batches per rank, different per rank; ``--fixed-batch``:
one batch everywhere, for a loss that must fall).  Measured under the benchmark protocol of :mod:`bench.harness`
(warm up until step times settle, agreed across ranks, then the timed steps); the result is the dict a
``harness.train_worker`` returns (preset, kind, tokens_per_step, flops_per_step, step_times, step_s, tokens_per_s,
mem_peak, device, mfu, graph_breaks, cudagraph_skips) with what ``train_throughput.run_reference`` returns
(warmup_s, first_loss, mem_reserved_peak, kernel_path) and this trainer's settings.  FLOPs and MFU are Megatron's
formula over ``derive(cfg)``, per GPU, as in ``bench/train_throughput.py``.

Run (GPU machine, repository root; nothing to install: torch is the image's, the workbench config is read from the
checkout without megatron-core)::

    python bench/reference_fsdp2.py --model llama3.2-3b --gpus 2 --seq 2048 --micro-batch 2 --global-batch 16
    python bench/reference_fsdp2.py --model llama3.1-8b --gpus 4 --seq 2048 --micro-batch 1 --global-batch 16
    python bench/reference_fsdp2.py --model llama3.1-8b --gpus 2 --seq 2048 --micro-batch 1 --global-batch 8 --ac full
    python bench/reference_fsdp2.py --cpu-smoke              # 2 processes, gloo, tiny Llama, fp32, no compile (CI)

(8B: fp32 weights, gradients and AdamW state are 16 bytes a parameter, 64 GB a GPU on two; its activations then need
``--ac full``, as torchtitan's own 8B recipe checkpoints.)

As a variant of ``bench/train_throughput.py``: :func:`run_variant` takes its ``Variant`` and arguments (the config
from ``bench_config`` of :mod:`bench.variants`, so shape and global batch are the workbench rows' own;
``parallel.recompute: full`` in the variant's overrides turns on the per-block activation checkpointing here).
"""

# Wheels.  The FSDP2 yardstick above needs none: the device image's torch 2.11 and this checkout.
# torchtitan 0.3.0 and what the device image lacks of its dependencies (einops, pillow, tensorboard, tokenizers,
# safetensors, pyarrow, pandas, xxhash, huggingface-hub, fsspec are in the image; wandb is imported only when
# enabled), for an image whose torch has DataParallelMeshDims; 10 wheels, 2.7 MB (2,683,189 bytes) in all, downloaded
# here on 2026-11-28 (with torch 2.14.1 here, torchtitan.trainer imports from them):
#
#   P="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#      --platform manylinux2014_x86_64 --platform any --only-binary=:all: --no-deps"
#   python3 -m pip download -q $P -d .whl/torchtitan torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 \
#       spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 \
#       multiprocess==0.70.18
#   # on the device (carry .whl/torchtitan):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tt .whl/torchtitan/*.whl
#
# On torch 2.11 the import then fails as the docstring says.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

#: what was found of torchtitan (stored with every result)
TORCHTITAN = {
    "tried": "0.3.0",
    "runs_on_torch_2_11": False,
    "error": "ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp' "
             "(torchtitan/distributed/full_dtensor.py:23, imported by trainer.py via components/validate.py)",
}

#: --model: the workbench presets this trains (Llama layout), and short names for them
MODELS = ("llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "tiny-llama")
ALIASES = {"1b": "llama3.2-1b", "3b": "llama3.2-3b", "8b": "llama3.1-8b", "tiny": "tiny-llama"}
RESHARD = ("default", "always", "never")  # torchtitan's fsdp_reshard_after_forward policies


@dataclass
class Options:
    """How the yardstick trains (beyond the config's shape, batch and optimizer settings)."""

    compile: bool = True  # per-block torch.compile and the compiled loss
    ac: str = "none"  # "none" | "full": per-block activation checkpointing
    reshard: str = "default"  # torchtitan's policy: "default" (blocks resharded after forward; no PP here), "always", "never"
    grad_sync: str = "every"  # "every" micro-batch reduce-scatters (torchtitan), "last": only the step's last one
    fixed_batch: bool = False  # one batch for every micro-batch on every rank (a loss that must fall)
    pool: int = 8  # synthetic micro-batches per rank, cycled


def canonical(model: str) -> str:
    m = ALIASES.get(model.lower(), model)
    if m not in MODELS:
        raise ValueError(f"--model {model!r}: not one of {', '.join(MODELS)} (or {', '.join(ALIASES)})")
    return m


def bench_cfg(model: str, *, gpus: int, seq: int | None = None, micro_batch: int | None = None,
              global_batch: int | None = None, cpu: bool = False):
    """The workbench RunConfig of a row: the preset's shape (``tiny-llama``: the tiny preset in the Llama layout, as
    ``train_throughput --cpu-smoke`` smokes Llama models), ``seq`` / ``micro_batch`` / ``global_batch`` on top, world
    size ``gpus``; bf16 on GPUs, fp32 on CPU; synthetic data, constant learning rate."""
    from workbench.config import derive, preset

    model = canonical(model)
    if model == "tiny-llama":
        from bench.variants import TINY_LLAMA

        cfg = preset("tiny", **TINY_LLAMA)
    else:
        cfg = preset(model)
    t = cfg.train
    mbs = micro_batch or t.micro_batch_size
    over: dict[str, Any] = {
        "model.seq_length": seq or cfg.model.seq_length,
        "train.micro_batch_size": mbs,
        "train.global_batch_size": global_batch or mbs * gpus,
        "train.precision": "fp32" if cpu else "bf16",
        "train.lr_warmup_iters": 0, "train.lr_decay_style": "constant", "train.train_iters": 10_000, "train.eval_interval": 0,
        "parallel.nproc_per_node": gpus, "parallel.device": "cpu" if cpu else "cuda",
        "data.source": "synthetic", "checkpoint.save_on_exit": False,
    }
    if over["model.seq_length"] > cfg.model.max_position_embeddings:
        over["model.max_position_embeddings"] = over["model.seq_length"]
    cfg = cfg.replace(**over)
    if cfg.train.global_batch_size % (mbs * gpus):
        raise ValueError(f"global batch {cfg.train.global_batch_size} is not a multiple of micro-batch {mbs} x {gpus} GPUs")
    derive(cfg)
    return cfg


# --------------------------------------------------------------------------- the model, sharded


def _sdpa_cudnn_first() -> list[str] | None:
    """torch SDPA's backends cuDNN, flash, efficient, math first on Hopper and later (what the one-GPU reference sets
    through ``workbench.backend.attention.apply_sdpa_order``; inlined: that module imports megatron-core)."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9 or not hasattr(torch._C, "_set_sdp_priority_order"):
        return None
    wanted = [3, 1, 2, 0]  # cudnn, flash, efficient, math (torch's SDPBackend numbers)
    rest = [b for b in torch._C._get_sdp_priority_order() if b not in wanted]
    torch._C._set_sdp_priority_order(wanted + rest)
    return ["cudnn", "flash", "efficient", "math"]


def build(cfg, opts: Options, mesh, device):
    """(spec, model): :class:`bench.reference_llama.ReferenceLlama` on the meta device, each block checkpointed
    (``opts.ac``), compiled and sharded, the rest grouped as torchtitan's ``apply_fsdp_to_decoder`` groups it, then
    materialised on ``device`` and initialised (the reference's init: N(0, std), output projections scaled)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from bench.reference_llama import ReferenceLlama, spec_from_config

    spec = spec_from_config(cfg)
    with torch.device("meta"):
        model = ReferenceLlama(spec)
    for i, block in enumerate(model.blocks):
        if opts.ac == "full":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if opts.compile:
            block.compile(fullgraph=True)
        model.blocks[i] = block
    bf16 = cfg.train.precision == "bf16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False) if bf16 \
        else MixedPrecisionPolicy()
    kw = {"mesh": mesh, "mp_policy": mp}
    after_forward = opts.reshard != "never"  # "default" without pipelining: True
    head_after_forward = opts.reshard == "always"  # the head is needed again first in backward: kept by default
    if spec.tie_embeddings:  # one unit: the tied weight gathered once
        fully_shard([model.wte, model.norm_f, model.lm_head], **kw, reshard_after_forward=head_after_forward)
    else:
        fully_shard(model.wte, **kw, reshard_after_forward=after_forward)
        fully_shard([model.norm_f, model.lm_head], **kw, reshard_after_forward=head_after_forward)
    for block in model.blocks:
        fully_shard(block, **kw, reshard_after_forward=after_forward)
    fully_shard(model, **kw)
    model.to_empty(device=device)
    init_weights(model, spec, device)
    return spec, model


def init_weights(model, spec, device) -> None:
    """The reference's initialisation on the sharded (DTensor) parameters, and the rotary tables (buffers, which
    ``to_empty`` left uninitialised)."""
    import math

    import torch
    import torch.nn as nn

    from bench.reference_llama import rope_tables

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                scaled = name.endswith(("o_proj.weight", "down.weight"))
                nn.init.normal_(p, 0.0, spec.init_std / math.sqrt(2 * spec.num_layers) if scaled else spec.init_std)
            else:  # the RMSNorm weights
                nn.init.ones_(p)
    model.rope_cos, model.rope_sin = rope_tables(spec, spec.seq_length, torch.device(device))


def _clip(params: list, max_norm: float) -> None:
    """Global-norm clipping over the shards: the DTensor norm made whole first (torchtitan's ``clip_grad_norm_``)."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)


# --------------------------------------------------------------------------- the measurement


def train(cfg, opts: Options, measure: Any, *, kind: str = "fsdp2", preset_name: str | None = None) -> dict[str, Any]:
    """One measurement in this torchrun process (every rank calls it; rank 0's result is the row's): build the sharded
    model, warm up and time steps under ``measure`` (a ``harness.Protocol``); the
    ``harness.train_worker`` dict plus this trainer's settings, losses and the torchtitan finding."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from bench.reference_gpt import _param_groups
    from workbench.config import derive

    cuda = cfg.parallel.device == "cuda"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world != cfg.parallel.world_size:
        raise ValueError(f"the config is for {cfg.parallel.world_size} ranks, torchrun started {world}")
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    sdpa = _sdpa_cudnn_first() if cuda else None
    torch.manual_seed(cfg.train.seed)  # the same on every rank: DTensor's random init stays consistent
    t_build = time.perf_counter()
    spec, model = build(cfg, opts, mesh, device)
    build_s = time.perf_counter() - t_build
    model.train()

    t = cfg.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(_param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                  eps=t.adam_eps, fused=True)

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    loss_fn = torch.compile(loss_of) if opts.compile else loss_of
    d = derive(cfg)
    k, mbs, seq, vocab = d.num_microbatches, t.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator(device="cpu").manual_seed(1234 + (0 if opts.fixed_batch else rank))
    pool = []
    for _ in range(1 if opts.fixed_batch else opts.pool):
        x = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        pool.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    state = {"i": 0}
    losses: list[torch.Tensor] = []

    def step() -> None:
        i = state["i"]
        state["i"] += 1
        total = torch.zeros((), device=device)
        for j in range(k):
            if opts.grad_sync == "last":
                model.set_requires_gradient_sync(j == k - 1)
            tokens, labels = pool[(i * k + j) % len(pool)]
            loss = loss_fn(model(tokens), labels) / k
            loss.backward()
            total += loss.detach()
        if t.clip_grad > 0:
            _clip(params, t.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)

    dist.barrier()
    measured = harness.measure_steps(step, cuda, measure, before_timing=torch.cuda.reset_peak_memory_stats if cuda else None,
                                     agree=harness.rank_vote(device))
    step_s = measured["step_s"]
    mem = [int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())] if cuda else [0, 0]
    peak = torch.tensor(mem, dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {
        "preset": preset_name or cfg.name, "kind": kind, "yardstick": "plain FSDP2 (torchtitan's recipe)",
        "tokens_per_step": d.tokens_per_step, "flops_per_step": d.flops_per_step,
        "gpus": world, "micro_batch_size": mbs, "microbatches": k, "global_batch_size": t.global_batch_size, "seq_length": seq,
        "precision": t.precision, "options": asdict(opts), "measure": asdict(measure) if hasattr(measure, "__dataclass_fields__") else dict(vars(measure)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        "compiled_graphs": int(counters["stats"].get("unique_graphs", 0)),  # one block graph and the loss's, if none recompiled
        **measured,
        "tokens_per_s": d.tokens_per_step / step_s,
        "first_loss": float(losses[0]) if losses else None,
        "losses": [float(x) for x in losses],
        "mem_peak": mem[0] if cuda else None, "mem_reserved_peak": mem[1] if cuda else None,
        "mem_peak_max_rank": int(peak[0]) if cuda else None, "mem_reserved_peak_max_rank": int(peak[1]) if cuda else None,
        "params_total": sum(p.numel() for p in params), "params_local_rank0": local_params, "params_derived": d.params.total,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "build_s": build_s,
        "kernel_path": {"model": "bench.reference_llama.ReferenceLlama", "parallel": f"FSDP2 fully_shard per block over {world} ranks",
                        "mixed_precision": "param bf16, reduce fp32" if t.precision == "bf16" else "fp32",
                        "attention": "torch SDPA causal" + (f" ({', '.join(sdpa)} first)" if sdpa else ""),
                        "optimizer": "torch fused AdamW (DTensor shards)",
                        "compile": "torch.compile per block (fullgraph) + loss" if opts.compile else "eager",
                        "activation_checkpointing": "per block" if opts.ac == "full" else "none",
                        "reshard_after_forward": opts.reshard, "grad_sync": opts.grad_sync},
        "torchtitan": TORCHTITAN,
    }
    if cuda:
        try:
            from workbench.rank.metrics import peak_tflops

            pk = peak_tflops(out["device"], t.precision, None)
        except ImportError:  # (it reads no megatron-core today; the H100's and H200's dense bf16 peak otherwise)
            pk = 989.0 if any(n in out["device"] for n in ("H100", "H200")) else None
        out["peak_tflops"] = pk
        out["mfu"] = d.flops_per_step / step_s / world / 1e12 / pk if pk else None
    return out


def run_variant(v: Any, a: argparse.Namespace, opts: Options | None = None) -> dict[str, Any]:
    """``bench/train_throughput.py``'s worker entry for an FSDP2 variant (``Variant(kind="fsdp2", gpus=N, ...)``): the
    variant's own config (``bench_config``: shape, micro-batch, global batch = micro-batch x GPUs x micro-batches),
    measured under the harness protocol of ``a``; ``parallel.recompute: full`` in the overrides checkpoints every
    block.  Returns what ``run_reference`` returns (step_times, warmup_s, first_loss, mem_peak, mem_reserved_peak,
    kernel_path) and the rest of :func:`train`'s dict."""
    from bench.variants import bench_config

    cfg = bench_config(v, a.cpu_smoke)
    if opts is None:
        opts = Options(compile=not a.cpu_smoke and not getattr(a, "no_compile_reference", False),
                       ac="full" if cfg.parallel.recompute == "full" else "none")
    return train(cfg, opts, harness.protocol(a), kind=v.kind, preset_name=v.model)


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"{', '.join(MODELS)} (or {', '.join(ALIASES)}; default llama3.2-3b, "
                    "--cpu-smoke: tiny-llama)")
    ap.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU; --cpu-smoke: 2 processes)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's, 2048)")
    ap.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (default: the preset's)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks (default: micro-batch x ranks)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --cpu-smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="at least this many warm-up steps (default 5; --cpu-smoke 2)")
    ap.add_argument("--warmup-max", type=int, default=None, help="at most this many while step times do not settle (default 60)")
    ap.add_argument("--ac", choices=("none", "full"), default="none", help="per-block activation checkpointing")
    ap.add_argument("--reshard", choices=RESHARD, default="default", help="FSDP reshard after forward (torchtitan's policy names)")
    ap.add_argument("--grad-sync", choices=("every", "last"), default="every",
                    help="reduce-scatter gradients after every micro-batch (torchtitan) or only the last")
    ap.add_argument("--no-compile", action="store_true", help="eager (no per-block compile)")
    ap.add_argument("--compile", action="store_true", help="compile also under --cpu-smoke (inductor's C++ backend)")
    ap.add_argument("--set", default=None, help='dotted config overrides on top, JSON (e.g. \'{"model.tie_embeddings": false}\')')
    ap.add_argument("--fixed-batch", action="store_true", help="train one batch over and over (the loss must fall)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, 2 processes, tiny Llama, fp32, no compile (CI)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds before the launch is ended")
    ap.add_argument("--out", default=None, help="append the result (stamped with date, commit) to this JSON-lines file")
    ap.add_argument("--result", default=None, help="write the result (JSON) here as well")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _settings(a: argparse.Namespace) -> tuple[Any, Options, harness.Protocol]:
    cpu = a.cpu_smoke
    gpus = a.gpus or (2 if cpu else int(os.environ.get("WORLD_SIZE", "0")) or _visible_gpus())
    cfg = bench_cfg(a.model, gpus=gpus, seq=a.seq, micro_batch=a.micro_batch, cpu=cpu,
                    global_batch=a.global_batch or (2 * 2 * gpus if cpu and not a.micro_batch else None))
    if a.set:
        from workbench.config import derive

        cfg = cfg.replace(**json.loads(a.set))
        derive(cfg)
    opts = Options(compile=a.compile or not (a.no_compile or cpu), ac=a.ac, reshard=a.reshard, grad_sync=a.grad_sync, fixed_batch=a.fixed_batch)
    base = harness.SMOKE if cpu else harness.Protocol()
    m = dataclasses.replace(base, steps=a.steps or base.steps, warmup_min=a.warmup or base.warmup_min,
                            warmup_max=max(a.warmup_max or base.warmup_max, a.warmup or base.warmup_min))
    return cfg, opts, m


def _visible_gpus() -> int:
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        raise SystemExit("no CUDA GPU visible: run on a GPU machine, or use --cpu-smoke")
    return n


def launch(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """This script's worker under torchrun on ``--gpus`` local ranks (the launch's own rendezvous on a loopback port
    the OS picks); the rank-0 result, or ``{"ok": False, "error": ...}`` with the log's tail."""
    from workbench.launch.stores import MODULE, one_node_args

    cfg, _, _ = _settings(argparse.Namespace(**vars(a)))
    n = cfg.parallel.world_size
    with tempfile.TemporaryDirectory(prefix="fsdp2-") as tmp:
        result = Path(tmp) / "result.json"
        worker_args = _drop_values(argv, ("--result", "--out"))
        cmd = [sys.executable, "-m", MODULE, *one_node_args(), "--nproc-per-node", str(n), str(Path(__file__).resolve()),
               *worker_args, "--gpus", str(n), "--worker", "--result", str(result)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               "PYTHONWARNINGS": "ignore"}
        env.setdefault("OMP_NUM_THREADS", "1" if a.cpu_smoke else "8")
        for key, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
            env.setdefault(key, val)  # never NVLink multicast on shared hosts
        t0 = time.perf_counter()
        try:
            proc = harness.run_group(cmd, a.timeout, env=env, cwd=ROOT)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = 124, f"timed out after {a.timeout}s\n" + ((e.output or "") + (e.stderr or ""))[-4000:]
        if rc == 0 and result.exists():
            res = {"ok": True, **json.loads(result.read_text())}
        else:
            res = {"ok": False, "error": f"exit {rc}", "log_tail": tail}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def _drop_values(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` (``--x v`` and ``--x=v``) and without ``--gpus``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in (*names, "--gpus"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def run_cli(argv: list[str] | None, ap: argparse.ArgumentParser, settings: Any, train_fn: Any, launch_fn: Any,
            brief_keys: tuple[str, ...]) -> int:
    """The command line of a multi-GPU reference (this file's and ``bench/reference_torchtitan.py``'s): parse and
    check the arguments; as ``--worker`` (a torchrun rank) train and write the result; else launch the ranks, stamp
    the result (date, commit), write ``--result`` / append ``--out`` and print the ``brief_keys`` of it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    try:
        a.model = canonical(a.model or ("tiny-llama" if a.cpu_smoke else "llama3.2-3b"))
    except ValueError as e:
        ap.error(str(e))
    if (a.steps is not None and a.steps < 1) or (a.warmup is not None and a.warmup < 1):
        ap.error("--steps and --warmup must be >= 1")
    if a.worker:
        cfg, opts, m = settings(a)
        res = train_fn(cfg, opts, m, preset_name=a.model)
        if int(os.environ.get("RANK", "0")) == 0 and a.result:
            Path(a.result).write_text(json.dumps(res))
        import torch.distributed as dist

        # every rank done with the group before any tears it down: a rank that destroyed its gloo pairs while a peer
        # still used them aborted once in CI ("terminate called without an active exception", SIGABRT, dea880c)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    try:
        settings(argparse.Namespace(**vars(a)))  # a wrong shape or batch is an argument error, before any launch
    except ValueError as e:
        ap.error(str(e))
    res = launch_fn(a, argv)
    from workbench.provenance import git_commit

    res.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
               cpu_smoke=a.cpu_smoke)
    if a.result:
        Path(a.result).write_text(json.dumps(res))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as fh:
            fh.write(json.dumps(res) + "\n")
    print(json.dumps({k: res.get(k) for k in brief_keys}))
    if not res["ok"]:
        print(res.get("log_tail", ""), file=sys.stderr)
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, parser(), _settings, train, launch,
                   ("ok", "preset", "gpus", "seq_length", "micro_batch_size", "microbatches", "global_batch_size",
                    "tokens_per_s", "step_s", "mfu", "mem_peak", "mem_peak_max_rank", "steady", "warmup_steps",
                    "first_loss", "graph_breaks", "device", "torch", "wall_s", "error"))


if __name__ == "__main__":
    sys.exit(main())
