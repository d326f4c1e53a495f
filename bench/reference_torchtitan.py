"""The torchtitan yardstick for decoder training (issue #50): torchtitan's own Llama-3 model, parallelize function
(FSDP2 + torch.compile, its activation checkpointing only when asked), loss and optimizer, driven step by step under
the benchmark protocol of :mod:`bench.harness` at the workbench row's shape, sequence length, global batch and GPUs.

What runs is torchtitan's code (``pip install torchtitan==0.3.0``, the carried wheels of ``.whl/titan``); only the
loop is this file's, because torchtitan's ``Trainer`` cannot be stepped from outside (its ``train()`` owns the loop,
the data loader and the tokenizer).  The loop is ``Trainer.train_step`` of 0.3.0 without its logging,
checkpointing and data loading:

- the model: ``torchtitan.models.llama3.model_registry(<flavor>)`` (``1B``, ``3B``, ``8B``: Meta's shapes, the
  workbench presets' shapes; the parameter count is checked against the workbench's ``derive(cfg)``), the tiny CPU
  stand-in built with the same module's layer builder; built on the meta device under the training dtype (fp32),
  RoPE caches sized to the sequence length as ``update_from_config`` does;
- ``parallelize_llama`` with ``ParallelDims(dp_shard=N)``, ``TrainingConfig`` (``mixed_precision_param=bfloat16``,
  ``mixed_precision_reduce=float32``: torchtitan's defaults), ``ParallelismConfig`` (``fsdp_reshard_after_forward=
  "default"``), ``CompileConfig(enable=True, components=["model", "loss"])`` and ``ac_config`` ``None`` (the brief:
  checkpointing only where the shape needs it; ``--ac full|selective``: torchtitan's ``FullAC`` / ``SelectiveAC``);
  then ``to_empty`` + ``init_weights`` as the trainer;
- the loss: torchtitan's ``CrossEntropyLoss`` (compiled with the model: ``components=["model", "loss"]``) on the
  model's logits, normalised by the global count of valid tokens as the trainer does.  The Llama recipes of 0.3.0 wrap
  it in ``ChunkedLossWrapper`` (lm_head applied per chunk inside the loss); ``--loss chunked`` does so, but its
  backward (``_DecoderOutputGradientBackProp``) ends the process with SIGSEGV on torch 2.11 (CPU, FSDP2 on one or
  two gloo ranks; the plain loss on the same model runs; on torch 2.14 the chunked loss runs), so it is not the
  default;
- ``default_adamw(lr)`` (AdamW, betas 0.9/0.95, eps 1e-8, weight decay 0.1, ``implementation="fused"``) built by
  torchtitan's ``OptimizersContainer``; ``dist_utils.clip_grad_norm_`` (max norm 1.0); the learning rate constant;
- attention: ``flex`` (torchtitan's default backend), the block mask from per-sequence positions built each
  micro-batch as ``post_dataloading_process`` does (``--attn varlen`` / ``flex_flash`` also; ``--attn sdpa``:
  torchtitan's ``ScaledDotProductAttention`` module, causal without a mask, which 0.3.0's registry no longer offers
  language models: the CPU smoke's, as FlexAttention has no backward on CPU);
- context parallelism (``Options.cp`` > 1; a variant whose config has ``parallel.context_parallel`` > 1):
  ``ParallelismConfig(context_parallel_degree=cp, data_parallel_shard_degree=world / cp)``, so ``parallelize_llama``
  wraps every block's inner attention with ``apply_cp_to_forward`` on the ``cp`` mesh and FSDP shards over DP x CP,
  and each micro-batch goes through ``prepare_context_parallel_input`` (0.3.0's ``Trainer.post_dataloading_process``:
  inputs, labels, positions and the block mask sharded, the ``headtail`` load balancer, the workbench's order too);
  the CP ranks of a DP rank draw the same tokens; the loss is normalised by the full sequences' token count, as the
  trainer counts it before the sharding.  Not run on a GPU yet (bench/scale_call.sh CALL=12 / 13);
- CUDA graphs: the 0.3.0 trainer captures its forward+backward by default (``training.disable_cuda_graphs=False``,
  ``distributed/cudagraph.wrap_with_cuda_graph``); off here unless ``--cuda-graphs`` (the row records which).

Data: synthetic tokens made on the ranks (a pool of 8 micro-batches per rank, different per rank), labels the
inputs shifted by one; no tokenizer, no hub.

torch 2.11 (the GPU machines' image): torchtitan 0.3.0 imports ``DataParallelMeshDims`` from
``torch.distributed.fsdp`` at module level (``distributed/fsdp.py:13``, ``distributed/full_dtensor.py:23``), which
torch 2.11 lacks: ``from torchtitan.models.llama3 import parallelize_llama`` fails with ``ImportError: cannot import
name 'DataParallelMeshDims' from 'torch.distributed.fsdp'``.  The class is used only on 0.3.0's ``spmd_types`` /
``full_dtensor`` backends (``fully_shard(..., dp_mesh_dims=)``, also torch >= 2.12 only); its ``partial_dtensor``
backend (DTensor on model-parallel axes only: for FSDP alone, the classic per-block ``fully_shard`` on a 1-D mesh,
``dp_mesh_dims=None``) needs neither.  So on a torch without the name this file sets a stand-in class before importing
torchtitan, and ``spmd_backend="partial_dtensor"`` is selected on every torch (one code path wherever the row is
measured; ``--spmd-backend spmd_types``, 0.3.0's default, only on a torch that has the class: on torch 2.14 the
CPU smoke then stops in ``fully_shard`` with "When dp_mesh_dims is provided, all parameters must be DTensors on the
full SPMD mesh"); both are recorded in the row (``torchtitan_shims``, ``kernel_path.spmd_backend``).

Run (GPU machine, repository root, the wheels installed as ``bench/README.md`` says)::

    python bench/reference_torchtitan.py --model llama3.2-3b --gpus 2 --micro-batch 2 --global-batch 16
    python bench/reference_torchtitan.py --cpu-smoke        # 2 processes, gloo, tiny Llama, fp32, eager (CI)

As a variant of ``bench/train_throughput.py`` (``torchtitan/<model>``, 2 GPUs): :func:`run_variant`.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from bench import reference_fsdp2 as fsdp2  # noqa: E402

#: workbench preset -> torchtitan llama3 flavor (the same shapes)
FLAVORS = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "llama3.1-8b": "8B"}
ATTN = ("flex", "flex_flash", "varlen", "sdpa")
AC = ("none", "full", "selective")


@dataclass
class Options:
    compile: bool = True  # CompileConfig(enable=True, components=["model", "loss"])
    ac: str = "none"  # "none" | "full" | "selective": torchtitan's ActivationCheckpointingConfig
    attn: str = "flex"  # torchtitan's attention backend
    cuda_graphs: bool = False  # torchtitan's wrap_with_cuda_graph of forward+backward (the 0.3.0 trainer's default)
    spmd_backend: str | None = None  # None: "partial_dtensor" (runs on torch 2.11; 0.3.0's default is "spmd_types")
    reshard: str = "default"  # parallelism.fsdp_reshard_after_forward
    loss: str = "plain"  # "plain": CrossEntropyLoss on the logits; "chunked": the recipes' ChunkedLossWrapper
    pool: int = 8
    cp: int = 1  # parallelism.context_parallel_degree (the rest of the world: FSDP's data_parallel_shard_degree)


# --------------------------------------------------------------------------- torchtitan, imported


def import_torchtitan() -> dict[str, Any]:
    """Import torchtitan (after the stand-in for ``DataParallelMeshDims`` where the running torch lacks it); its
    version, the shims set and whether the default ``spmd_types`` backend can run.  Raises ImportError (with
    torchtitan's own message) when it cannot be imported."""
    import importlib.metadata as md

    import torch.distributed.fsdp as tfsdp

    shims: list[str] = []
    native = hasattr(tfsdp, "DataParallelMeshDims")
    if not native:
        @dataclass(frozen=True)
        class DataParallelMeshDims:  # what torchtitan 0.3.0 imports; used only by fully_shard(dp_mesh_dims=) paths
            shard: Any = None
            replicate: Any = None

        DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
        tfsdp.DataParallelMeshDims = DataParallelMeshDims
        shims.append("torch.distributed.fsdp.DataParallelMeshDims: stand-in class (this torch lacks it; torchtitan "
                     "imports it at module level, uses it only on the spmd_types/full_dtensor backends, not taken)")
    import torchtitan  # noqa: F401
    from torchtitan.models.llama3 import parallelize_llama  # noqa: F401  (the import that fails on torch 2.11 unshimmed)

    import inspect

    from torch.nn.attention.flex_attention import create_block_mask

    if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
        # torchtitan 0.3.0 passes create_block_mask(..., separate_full_blocks=not batch_invariant); torch 2.11's has no
        # such argument and always separates full blocks (flex_attention.py: _convert_mask_to_block_mask(...,
        # separate_full_blocks=True)), so True is dropped (the same mask) and False refused
        import torchtitan.models.common.attention as tta

        compiled = tta._compiled_create_block_mask

        def create_block_mask_211(*args: Any, separate_full_blocks: bool = True, **kwargs: Any):
            if not separate_full_blocks:
                raise NotImplementedError("this torch's create_block_mask always separates full blocks "
                                          "(torchtitan's batch-invariant mode needs a newer torch)")
            return compiled(*args, **kwargs)

        tta._compiled_create_block_mask = create_block_mask_211
        shims.append("torchtitan.models.common.attention: create_block_mask called without separate_full_blocks=True "
                     "(this torch lacks the argument and always separates full blocks: the same BlockMask)")

    return {"version": md.version("torchtitan"), "shims": shims, "dp_mesh_dims_native": native}


def titan_model_config(cfg, opts: Options, preset_name: str):
    """torchtitan's ``Llama3Model.Config`` at the row's shape: the registry flavor of the preset, or (tiny CPU
    stand-in) one built with torchtitan's llama3 layer builder at the config's shape; RoPE caches sized to the
    sequence length (``Decoder.Config.update_from_config``)."""
    import dataclasses as dc

    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    m = cfg.model
    seq = m.seq_length
    flavor = FLAVORS.get(preset_name)
    backend = "flex" if opts.attn == "sdpa" else opts.attn  # sdpa: swapped in below (0.3.0's registry refuses it)
    if flavor is not None:
        mc = L.llama3_configs[flavor](attn_backend=backend)
    else:
        from workbench.config import derive

        dim, vocab = m.hidden_size, derive(cfg).padded_vocab_size
        mc = L.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=bool(m.tie_embeddings),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=L._EMBEDDING_SKIP_INIT if m.tie_embeddings else L._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
            layers=L._build_llama3_layers(
                fuse_qkv=True, n_layers=m.num_layers, dim=dim, n_heads=m.num_attention_heads, n_kv_heads=m.query_groups,
                hidden_dim=m.ffn_size, attn_backend=backend,
                rope=ComplexRoPE.Config(dim=m.head_dim, max_seq_len=max(seq, 2048), theta=m.rotary_base, scaling="none")))
    for layer in mc.layers:  # update_from_config's RoPE resize (it does so only for a Trainer.Config)
        att = getattr(layer, "attention", None)
        if att is not None:
            if opts.attn == "sdpa":  # torchtitan's ScaledDotProductAttention (causal, no mask): the CPU smoke's, as
                from torchtitan.models.common.attention import ScaledDotProductAttention  # flex has no CPU backward

                att.inner_attention = ScaledDotProductAttention.Config()
            if seq > att.rope.max_seq_len:
                raise ValueError(f"sequence length {seq} exceeds torchtitan's RoPE maximum {att.rope.max_seq_len}")
            att.rope = dc.replace(att.rope, max_seq_len=seq)
    return flavor, mc


# --------------------------------------------------------------------------- the measurement


def train(cfg, opts: Options, measure: Any, *, kind: str = "torchtitan", preset_name: str | None = None) -> dict[str, Any]:
    """One measurement in this torchrun process (every rank calls it; rank 0's result is the row's)."""
    found = import_torchtitan()
    import torch
    import torch.distributed as dist

    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    from workbench.config import derive

    name = preset_name or cfg.name
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

    t = cfg.train
    d = derive(cfg)
    k, mbs, seq = d.num_microbatches, t.micro_batch_size, cfg.model.seq_length
    backend = opts.spmd_backend or "partial_dtensor"
    bf16 = t.precision == "bf16"
    training = TrainingConfig(local_batch_size=mbs, global_batch_size=t.global_batch_size, seq_len=seq,
                              max_norm=t.clip_grad if t.clip_grad > 0 else 1.0, dtype="float32",
                              mixed_precision_param="bfloat16" if bf16 else "float32", mixed_precision_reduce="float32",
                              disable_cuda_graphs=not opts.cuda_graphs)
    if opts.cp < 1 or world % opts.cp:
        raise ValueError(f"context parallel degree {opts.cp} does not divide the {world} ranks")
    parallelism = ParallelismConfig(data_parallel_shard_degree=world // opts.cp, context_parallel_degree=opts.cp,
                                    fsdp_reshard_after_forward=opts.reshard, spmd_backend=backend)
    compile_config = CompileConfig(enable=opts.compile, components=["model", "loss"])
    ac_config = None
    if opts.ac != "none":
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        ac_config = FullAC.Config() if opts.ac == "full" else SelectiveAC.Config()
    if not cuda:  # torchtitan takes "cuda" as the device type when no accelerator is present (tools/utils.py)
        import torchtitan.distributed.parallel_dims as _pd
        import torchtitan.tools.utils as _tu

        for mod in (_tu, _pd, dist_utils):
            if getattr(mod, "device_type", "cpu") != "cpu":
                mod.device_type = "cpu"
        found["shims"].append("CPU only: torchtitan's device_type set to 'cpu' (it assumes 'cuda' without an accelerator)")
    parallel_dims = ParallelDims.from_config(parallelism, world)

    flavor, mc = titan_model_config(cfg, opts, name)
    torch.manual_seed(t.seed)
    t_build = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    with torch.device("meta"):
        model = mc.build()
    torch.set_default_dtype(prev)
    params_total = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="titan-dump-") as dump:
        model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                  compile_config=compile_config, ac_config=ac_config, dump_folder=dump)
    if not cuda:  # gloo has no PREMUL_SUM (what FSDP2 reduce-scatters with under torchtitan's divide factor 1.0)
        from torch.distributed.fsdp import FSDPModule

        for mod in model.modules():
            if isinstance(mod, FSDPModule):
                mod.set_force_sum_reduction_for_comms(True)
        found["shims"].append("CPU only: FSDP set_force_sum_reduction_for_comms (gloo has no PREMUL_SUM; factor 1.0)")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    ce = CrossEntropyLoss.Config(global_vocab_size=mc.vocab_size)
    if opts.loss == "chunked":  # the recipes' loss: lm_head applied per chunk inside the loss (trainer.py's wiring)
        loss_fn = ChunkedLossWrapper.Config(loss_fn=ce).build(compile_config=compile_config)
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    else:  # torchtitan's CrossEntropyLoss on the model's logits (lm_head in forward)
        loss_fn = ce.build(compile_config=compile_config)
    optim_cfg = default_adamw(lr=t.lr)
    optim_cfg.implementation = "fused"
    optimizers = optim_cfg.build(model_parts=[model])
    build_s = time.perf_counter() - t_build

    fwd_bwd_label = "eager"

    def fwd_bwd(inputs, labels, global_valid_tokens, extra):  # Trainer._forward_backward_body
        pred = model(inputs, **extra)
        if opts.loss == "chunked":
            loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra["positions"])
        else:
            loss, _ = loss_fn(pred, labels, global_valid_tokens)
        del pred
        loss.backward()
        return loss

    if opts.cuda_graphs:
        from torchtitan.distributed.cudagraph import wrap_with_cuda_graph

        fwd_bwd = wrap_with_cuda_graph(fwd_bwd)
        fwd_bwd_label = "cuda graph (torchtitan wrap_with_cuda_graph)"

    vocab = cfg.model.vocab_size
    g = torch.Generator(device="cpu").manual_seed(1234 + rank // opts.cp)  # the CP ranks of a DP rank: one batch
    pool = []
    for _ in range(opts.pool):
        x = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        pool.append((x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)))
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, seq).contiguous()
    masked = opts.attn in ("flex", "flex_flash", "varlen")
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None
    shard = None
    if opts.cp > 1:  # Trainer.post_dataloading_process: shard inputs, labels, positions and masks over the cp mesh
        from torchtitan.distributed.context_parallel.api import prepare_context_parallel_input

        cp_mesh = parallel_dims.get_mesh("cp")

        def shard(tokens, labels, extra):
            return prepare_context_parallel_input(tokens, labels, extra, cp_mesh, device,
                                                  parallelism.context_parallel_load_balancer, None)
    state = {"i": 0}
    losses: list[torch.Tensor] = []
    params = [p for p in model.parameters()]

    def step() -> None:  # Trainer.train_step
        i = state["i"]
        state["i"] += 1
        optimizers.zero_grad(set_to_none=not opts.cuda_graphs)
        local_valid = torch.tensor(k * mbs * seq, dtype=torch.int64)
        gvt = local_valid.to(device)
        if batch_mesh is not None:
            gvt = dist_utils.dist_sum_tensor(gvt, batch_mesh)
        total = None
        for j in range(k):
            tokens, labels = pool[(i * k + j) % len(pool)]
            extra: dict[str, Any] = {"positions": positions}
            if masked:
                extra["attention_masks"] = model.get_attention_masks(positions=positions)
            if shard is not None:
                tokens, labels, extra = shard(tokens, labels, extra)
            loss = fwd_bwd(tokens, labels, gvt, extra).detach()
            total = loss.clone() if total is None else total.add_(loss)
        dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        losses.append(total)

    dist.barrier()
    measured = harness.measure_steps(step, cuda, measure, before_timing=torch.cuda.reset_peak_memory_stats if cuda else None,
                                     agree=harness.rank_vote(device))
    step_s = measured["step_s"]
    mem = [int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())] if cuda else [0, 0]
    peak = torch.tensor(mem, dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    loss_sum = [float(x) for x in losses]  # rank-local sum / global tokens: the global mean is the sum over ranks
    lt = torch.tensor(loss_sum, dtype=torch.float64, device=device)
    dist.all_reduce(lt)
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {
        "preset": name, "kind": kind, "yardstick": f"torchtitan {found['version']} (Llama-3, parallelize_llama: FSDP2"
        f"{' + compile' if opts.compile else ''}{', AC ' + opts.ac if opts.ac != 'none' else ''}"
        f"{', CP ' + str(opts.cp) if opts.cp > 1 else ''})",
        "torchtitan_version": found["version"], "torchtitan_shims": found["shims"],
        "torchtitan_flavor": flavor,
        "tokens_per_step": d.tokens_per_step, "flops_per_step": d.flops_per_step,
        "gpus": world, "context_parallel": opts.cp, "micro_batch_size": mbs, "microbatches": k, "global_batch_size": t.global_batch_size,
        "seq_length": seq, "precision": t.precision, "options": asdict(opts),
        "measure": asdict(measure) if hasattr(measure, "__dataclass_fields__") else dict(vars(measure)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
        **measured,
        "tokens_per_s": d.tokens_per_step / step_s,
        "first_loss": float(lt[0]) if len(loss_sum) else None,
        "losses": [float(x) for x in lt],
        "mem_peak": mem[0] if cuda else None, "mem_reserved_peak": mem[1] if cuda else None,
        "mem_peak_max_rank": int(peak[0]) if cuda else None, "mem_reserved_peak_max_rank": int(peak[1]) if cuda else None,
        "params_total": params_total, "params_derived": d.params.total,
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "build_s": build_s,
        "kernel_path": {"model": f"torchtitan.models.llama3 ({flavor or 'tiny, torchtitan layer builder'})",
                        "parallel": f"torchtitan parallelize_llama: apply_fsdp_to_decoder over {world} ranks",
                        "spmd_backend": backend,
                        "mixed_precision": f"param {training.mixed_precision_param}, reduce {training.mixed_precision_reduce}",
                        "attention": opts.attn, "loss": "ChunkedLossWrapper(CrossEntropyLoss)" if opts.loss == "chunked" else "CrossEntropyLoss",
                        "optimizer": "torchtitan OptimizersContainer AdamW (fused)",
                        "compile": "torchtitan apply_compile per block + loss" if opts.compile else "eager",
                        "activation_checkpointing": opts.ac, "reshard_after_forward": opts.reshard,
                        "fwd_bwd": fwd_bwd_label},
    }
    if cuda:
        try:
            from workbench.rank.metrics import peak_tflops

            pk = peak_tflops(out["device"], t.precision, None)
        except ImportError:
            pk = 989.0 if any(n in out["device"] for n in ("H100", "H200")) else None
        out["peak_tflops"] = pk
        out["mfu"] = d.flops_per_step / step_s / world / 1e12 / pk if pk else None
    return out


def run_variant(v: Any, a: argparse.Namespace, opts: Options | None = None) -> dict[str, Any]:
    """``bench/train_throughput.py``'s worker entry for ``Variant(kind="torchtitan", gpus=N)``: the variant's own
    config (``bench_config``); ``parallel.recompute: full`` in its overrides turns on torchtitan's FullAC,
    ``parallel.context_parallel`` its context parallelism (``Options.cp``)."""
    from bench.variants import bench_config

    cfg = bench_config(v, a.cpu_smoke)
    if opts is None:
        opts = Options(compile=not a.cpu_smoke and not getattr(a, "no_compile_reference", False),
                       ac="full" if cfg.parallel.recompute == "full" else "none", attn="sdpa" if a.cpu_smoke else "flex",
                       cp=max(int(cfg.parallel.context_parallel or 1), 1))
    return train(cfg, opts, harness.protocol(a), kind=v.kind, preset_name=v.model)


# --------------------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help=f"{', '.join(fsdp2.MODELS)} (default llama3.2-3b; --cpu-smoke: tiny-llama)")
    ap.add_argument("--gpus", type=int, default=None, help="ranks (default: every visible GPU; --cpu-smoke: 2 processes)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: the preset's, 2048)")
    ap.add_argument("--micro-batch", type=int, default=None, help="micro-batch per rank (default: the preset's)")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step over all ranks")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --cpu-smoke 2)")
    ap.add_argument("--warmup", type=int, default=None, help="at least this many warm-up steps")
    ap.add_argument("--warmup-max", type=int, default=None, help="at most this many while step times do not settle")
    ap.add_argument("--ac", choices=AC, default="none", help="torchtitan's activation checkpointing")
    ap.add_argument("--attn", choices=ATTN, default=None, help="torchtitan's attention backend (default flex; --cpu-smoke: sdpa)")
    ap.add_argument("--cuda-graphs", action="store_true", help="torchtitan's CUDA-graph capture of forward+backward")
    ap.add_argument("--spmd-backend", choices=("partial_dtensor", "full_dtensor", "spmd_types"), default=None)
    ap.add_argument("--reshard", choices=fsdp2.RESHARD, default="default")
    ap.add_argument("--loss", choices=("plain", "chunked"), default="plain",
                    help="torchtitan's CrossEntropyLoss on the logits (default) or the recipes' ChunkedLossWrapper "
                         "(its backward crashes torch 2.11 on CPU with SIGSEGV; runs on torch 2.14)")
    ap.add_argument("--no-compile", action="store_true", help="eager")
    ap.add_argument("--compile", action="store_true", help="compile also under --cpu-smoke")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, gloo, 2 processes, tiny Llama, fp32, eager (CI)")
    ap.add_argument("--timeout", type=float, default=1500.0)
    ap.add_argument("--out", default=None, help="append the result (stamped with date, commit) to this JSON-lines file")
    ap.add_argument("--result", default=None, help="write the result (JSON) here as well")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def _settings(a: argparse.Namespace):
    cpu = a.cpu_smoke
    gpus = a.gpus or (2 if cpu else int(os.environ.get("WORLD_SIZE", "0")) or fsdp2._visible_gpus())
    cfg = fsdp2.bench_cfg(a.model, gpus=gpus, seq=a.seq, micro_batch=a.micro_batch, cpu=cpu,
                          global_batch=a.global_batch or (2 * 2 * gpus if cpu and not a.micro_batch else None))
    opts = Options(compile=a.compile or not (a.no_compile or cpu), ac=a.ac, attn=a.attn or ("sdpa" if cpu else "flex"), cuda_graphs=a.cuda_graphs,
                   spmd_backend=a.spmd_backend, reshard=a.reshard, loss=a.loss)
    base = harness.SMOKE if cpu else harness.Protocol()
    m = dataclasses.replace(base, steps=a.steps or base.steps, warmup_min=a.warmup or base.warmup_min,
                            warmup_max=max(a.warmup_max or base.warmup_max, a.warmup or base.warmup_min))
    return cfg, opts, m


def launch(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """This script's worker under torchrun on ``--gpus`` local ranks; the rank-0 result or ``{"ok": False, ...}``."""
    from workbench.launch.stores import MODULE, one_node_args

    cfg, _, _ = _settings(argparse.Namespace(**vars(a)))
    n = cfg.parallel.world_size
    with tempfile.TemporaryDirectory(prefix="titan-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", MODULE, *one_node_args(), "--nproc-per-node", str(n), str(Path(__file__).resolve()),
               *fsdp2._drop_values(argv, ("--result", "--out")), "--gpus", str(n), "--worker", "--result", str(result)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               "PYTHONWARNINGS": "ignore"}
        env.setdefault("OMP_NUM_THREADS", "1" if a.cpu_smoke else "8")
        for key, val in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
            env.setdefault(key, val)
        t0 = time.perf_counter()
        try:
            proc = harness.run_group(cmd, a.timeout, env=env, cwd=ROOT)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
        except subprocess.TimeoutExpired as e:
            rc, tail = 124, f"timed out after {a.timeout}s\n" + ((e.output or "") + (e.stderr or ""))[-4000:]
        res = {"ok": True, **json.loads(result.read_text())} if rc == 0 and result.exists() else \
            {"ok": False, "error": f"exit {rc}", "log_tail": tail}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    return fsdp2.run_cli(argv, parser(), _settings, train, launch,
                         ("ok", "preset", "torchtitan_version", "gpus", "seq_length", "micro_batch_size", "microbatches",
                          "global_batch_size", "tokens_per_s", "step_s", "mfu", "mem_peak_max_rank", "steady", "warmup_steps",
                          "first_loss", "params_total", "params_derived", "device", "torch", "wall_s", "error"))


if __name__ == "__main__":
    sys.exit(main())
