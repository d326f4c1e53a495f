"""The training loop every rank runs: megatron-core schedules, DDP, optimizer, events, checkpoints.

``Trainer(cfg, run_dir, hooks=None).run() -> exit code``.  Pieces (all real megatron-core):
- model chunks from :func:`workbench.rank.build.build_model` (one per virtual pipeline
  stage), ``Float16Module`` for bf16/fp16, mcore ``DistributedDataParallel`` (fp32 grad
  reduction by default, optional distributed optimizer / overlap);
- ``get_megatron_optimizer`` (Adam, grad clipping, dynamic or static fp16 loss scaling) and
  ``OptimizerParamScheduler`` (linear warmup, then linear / cosine / constant decay,
  stepped once per iteration);
- ``get_forward_backward_func()``: no-pipelining, 1F1B, or interleaved 1F1B when VPP > 1,
  over ``derive(cfg).num_microbatches`` micro-batches;
- eval every ``train.eval_interval`` iterations (loss, perplexity) on the validation set;
- checkpoints through :mod:`workbench.checkpoint` (interval, on clean exit and
  on a graceful stop), resume from ``checkpoint.load_dir`` continuing iteration, LR
  schedule and data position (``consumed_samples``); ``checkpoint.finetune`` loads weights only;
- events (:mod:`workbench.run.events`): run_start, step, microbatch, eval, checkpoint, error, run_end; with
  ``train.tensorboard`` the rank that logs also writes the step and eval records as TensorBoard scalars
  (:mod:`workbench.run.tensorboard`, flushed at each logged step);
- SIGTERM/SIGINT: all ranks agree to stop at the same step boundary (a non-blocking tiny
  all-reduce per step, read one step later; see ``_agree_stop``), a checkpoint is saved if
  ``checkpoint.save_on_exit``, ``run_end`` says "stopped", and the exit code is 143 / 130.
  A second signal, or max(15 s, 5 step times)
  without reaching a step boundary (a rank blocked in a collective), exits at once.  Any exception -> ``error`` event, ``run_end`` "failed",
  exit code 1, so torchrun tears the job down.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from workbench import kernel_rule
from workbench.backend import compiled_layer, distributed, grad_accumulation, step_graph, tied_embedding
from workbench.backend.attention import apply_sdpa_order
from workbench.backend.model import kernel_path, training_step_fields, transformer_config
from workbench.backend.optimizer_paths import offload_fields, offload_threads, prepare_optimizer, release_offload_startup
from workbench.backend.tp_overlap import initialize_userbuffers
from workbench.checkpoint import hook_note, load_checkpoint, load_problems, save_checkpoint
from workbench.config import ConfigError, RunConfig, derive, load_config
from workbench.hooks import Batch, TrainHooks, load_hooks
from workbench.models.parts import parts_of
from workbench.provenance import git_commit
from workbench.rank.collector import StepCollector
from workbench.run import writer
from workbench.run.events import Checkpoint, Error, Eval, EvalProgress, EventWriter, Microbatch, RunEnd, RunStart, Step, fusion_entries
from workbench.run.nodes import LAUNCH_FILE
from workbench.run.tensorboard import TensorBoardLog, tensorboard_dir

__all__ = ["Trainer", "main"]

STOP_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}
#: while an evaluation runs, every rank writes an ``eval_progress`` event at most this often (the supervisor's
#: stall watch counts it as progress: a long first evaluation is not a hung rank)
EVAL_PROGRESS_SECONDS = 30.0


def _versions() -> dict[str, str]:
    import megatron.core

    out = {"python": platform.python_version(), "torch": torch.__version__, "megatron_core": getattr(megatron.core, "__version__", "?")}
    for name in ("transformer_engine", "apex", "transformers"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "present")
        except Exception:
            pass
    out["git_commit"] = git_commit()
    return out


def _experts_note(paths: dict[str, int]) -> str:
    """The kernel path's words for :func:`workbench.backend.grad_accumulation.install_experts`'s layers by path."""
    return (f"{sum(paths.values())} grouped expert layers add their stacked weight gradients into main_grad themselves ("
            + "; ".join(f"{n}: {grad_accumulation.EXPERT_PATHS.get(k, k)}" for k, n in sorted(paths.items())) + ")")


class Trainer:
    """One rank's training run. See the module docstring."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, hooks: Optional[TrainHooks] = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.hooks = hooks if hooks is not None else load_hooks(cfg)
        #: the family's default train step; its LOSS_NAME is the reported key of the main loss
        self.step = parts_of(cfg).step()
        self.loss_name = self.step.LOSS_NAME
        self.rank = int(os.environ.get("RANK", "0"))
        self.events = EventWriter(self.run_dir, self.rank)
        self.iteration = 0
        self.consumed_samples = 0
        self.stop_signal: Optional[int] = None
        self.t0 = time.time()
        self.last_logits: list[torch.Tensor] = []  # last stage, return_logits: this step's logits per micro-batch
        self.last_loss: Optional[float] = None
        self._ended = False
        self._last_step_time = 0.0
        self._stop_pending: Optional[tuple[Any, torch.Tensor]] = None  # (work, flag) of the lagged stop agreement
        self.monitor: Any = None  # the family's per-step monitor (setup)
        self.tensorboard: Any = None  # train.tensorboard on the rank that logs: a workbench.run.tensorboard.TensorBoardLog
        #: Python's garbage collector: once at the end of each step while the loop runs (``with self.collector``)
        self.collector = StepCollector()

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Everything before the first step: process groups, the kernel rule's decision (made once here), the model
        chunks, optimizer and scheduler, the schedule's callbacks, the kernel path the run reports, a resume, the
        family's monitor and the data streams."""
        from megatron.core import parallel_state

        cfg = self.cfg
        self.coords = distributed.initialize(cfg)
        self.device = distributed.device(cfg)
        self.cuda = cfg.parallel.device == "cuda"
        self.derived = derive(cfg)
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.is_logging_rank = self.is_last_stage and self.coords.tp == 0 and self.coords.dp == 0 and self.coords.cp == 0
        # the one kernel rule's decision for this process (workbench.kernel_rule.choose), what the planner assumed:
        # made once here, carried by the TransformerConfig to every builder of the model (kernel_rule.decided)
        choice = kernel_rule.choose(cfg, cuda_available=torch.cuda.is_available())
        h = self.hooks
        if choice.cuda_graphs_impl == "step" and (h.forward_step or h.loss_func or h.return_logits):
            # hooks handed to the Trainer in Python (the rule saw the config's, which keep the step eager): a capture
            # would freeze their Python, so the layers graph themselves, as kernel_rule.step_graph_blocker says
            choice = dataclasses.replace(choice, cuda_graphs_impl="torch")
        if choice.cuda_graphs_impl == "step" and self.cuda:
            step_graph.own_stream()  # before DDP makes the parameters' gradient-accumulation nodes
        userbuffers = initialize_userbuffers(cfg, choice)  # TE's layer at TP > 1: before the model's TE linears are built
        hooked = self._build_model(choice)
        self._build_optimizer()
        self._wire_schedule()
        self._describe_kernels(choice, hooked, userbuffers)
        self._maybe_load()
        # the family's per-step monitor (GPT's MoE router statistics), if it has one for this config
        monitor = parts_of(cfg).monitor()
        self.monitor = monitor.step_monitor(cfg, [getattr(m, "module", m) for m in self.model]) if monitor else None
        self._build_data()

    def _build_model(self, choice: Any) -> int:
        """The model chunks (one per virtual stage) on the kernel rule's ``choice``, wrapped for mixed precision and
        megatron's DDP; returns how many parameters the workbench's gradient accumulation took over."""
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        from workbench.rank.build import build_model

        cfg, p, t = self.cfg, self.cfg.parallel, self.cfg.train
        tc = transformer_config(cfg, choice, **training_step_fields(cfg, choice))
        self.tconfig = tc
        chunks = []
        for i in range(p.vpp):
            vp = i if p.vpp > 1 else None
            pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
            post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
            chunks.append(build_model(cfg, pre_process=pre, post_process=post, vp_stage=vp, config=tc))
        if self.cuda:  # the kernel rule's SDPA backend order, for this training process (kernel_rule.KernelChoice.sdpa_order)
            apply_sdpa_order(choice.sdpa_order)
        if tc.fp16 or tc.bf16:
            chunks = [Float16Module(tc, c) for c in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=t.grad_reduce_in_fp32,
            overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
            use_distributed_optimizer=p.distributed_optimizer,
        )
        self.model = [DistributedDataParallel(config=tc, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
                      for i, c in enumerate(chunks)]
        hooked, self._direct_experts = 0, {}
        self._tied_fused = tied_embedding.install(self.model) if choice.wgrad_fused else 0  # (before the hooks)
        if choice.grad_accumulation == "workbench":  # before megatron's hooks fire (kernel_rule.KernelChoice.grad_accumulation)
            hooked = grad_accumulation.install(self.model)
            self._direct_experts = grad_accumulation.install_experts(self.model)
        for m in self.model:
            m.broadcast_params()
        self._chunk_of = {id(m): i for i, m in enumerate(self.model)}
        return hooked

    def _build_optimizer(self) -> None:
        """Megatron's optimizer (mixed precision, distributed over DP when asked) with the workbench's kernel paths,
        and its LR / weight-decay scheduler."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        cfg, p, t, tc = self.cfg, self.cfg.parallel, self.cfg.train, self.tconfig
        offload = offload_fields(p)  # parallel.optimizer_cpu_offload (the validator allows it on CUDA only)
        self._offload_threads = offload_threads() if offload else 0
        ocfg = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
            clip_grad=t.clip_grad, bf16=tc.bf16, fp16=tc.fp16, params_dtype=tc.params_dtype,
            loss_scale=t.loss_scale, initial_loss_scale=2.0 ** 16,
            use_distributed_optimizer=p.distributed_optimizer, **offload,
        )
        self.optimizer = get_megatron_optimizer(ocfg, self.model)
        if offload:
            release_offload_startup()
        # [perf hook] compiled cross-entropy, foreach multi-tensor ops, fused AdamW (no-ops unless
        # train.compile_kernels on CUDA): workbench.backend.compiled_layer, workbench.backend.optimizer_paths
        compiled_layer.prepare_model(self.model, cfg)
        prepare_optimizer(self.optimizer, cfg)
        decay = t.lr_decay_iters or t.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.lr_warmup_iters,
            lr_decay_steps=decay, lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=decay, wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
        )

    def _wire_schedule(self) -> None:
        """Megatron's training.py wiring of the schedule callbacks (loss scale, grad finalisation, no-sync), the
        forward-backward function and the micro-batch timer."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from workbench.rank import timing

        tc, p = self.tconfig, self.cfg.parallel
        tc.grad_scale_func = self.optimizer.scale_loss
        tc.finalize_model_grads_func = finalize_model_grads
        if p.overlap_grad_reduce:  # (param-gather hooks are the DDP wrapper's own in mcore 0.19)
            tc.no_sync_func = [m.no_sync for m in self.model]
            tc.no_sync_func = tc.no_sync_func[0] if len(self.model) == 1 else tc.no_sync_func
        self.forward_backward = get_forward_backward_func()
        # the whole training step as one CUDA graph where the kernel rule (setup) chose it
        graphed = kernel_rule.decided(self.cfg, tc).cuda_graphs_impl == "step" and self.cuda
        self.step_graph = step_graph.StepGraph(self.forward_backward, tc, log=self._log) if graphed else None
        self.timer = timing.MicrobatchTimer(cuda=self.cuda)
        timing.install()

    def _describe_kernels(self, choice: Any, hooked: int, userbuffers: Optional[str]) -> None:
        """The kernel path the run reports (run_start): the rule's choice, the optimizer, fusions, gradient
        accumulation, the schedule, TP overlap."""
        cfg, p = self.cfg, self.cfg.parallel
        self.kernel_path = kernel_path(cfg, choice)
        self.kernel_choice = choice.to_dict()
        self.kernel_path["optimizer"] = self._optimizer_path()
        self.kernel_path.update(fusion_entries(compiled_layer.summary()))
        self.kernel_path["grad_accumulation"] = (
            f"workbench on {hooked} large parameters: weight gradients into DDP's fp32 main_grad, copied at a step's "
            "first micro-batch, then added (vectorised); megatron DDP's hook (main_grad.add_) on the rest"
            + (f"; {_experts_note(self._direct_experts)}" if self._direct_experts else "")
            if choice.grad_accumulation == "workbench" else "megatron DDP's hook (main_grad.add_)")
        if choice.wgrad_fused:
            self.kernel_path["grad_accumulation"] = (
                "the compiled layers' GEMM weights: their weight-gradient GEMMs add into DDP's fp32 main_grad "
                "(addmm with out_dtype, beta 1)" + ("; the tied embedding / LM head weight: the head's GEMM and the "
                "lookup's row adds into main_grad" if self._tied_fused else "") + "; " + self.kernel_path["grad_accumulation"])
        self.kernel_path["schedule"] = ("interleaved 1F1B" if p.vpp > 1 else "1F1B") if p.pipeline_parallel > 1 else "no pipelining"
        overlap = [x for x in (self.kernel_path.get("tp_comm_overlap"), userbuffers, distributed.hardware_queue_note(cfg)) if x]
        if overlap:
            self.kernel_path["tp_comm_overlap"] = "; ".join(overlap)
        allocator = distributed.allocator_note(cfg) if p.device == "cuda" else None
        if allocator:
            self.kernel_path["allocator"] = allocator

    def _build_data(self) -> None:
        """The train / validation datasets and one micro-batch stream per virtual stage."""
        from workbench.rank.data import MicroBatchStream, build_datasets, loader_workers

        cfg = self.cfg
        train_ds, valid_ds, self.data_desc = build_datasets(cfg, self.run_dir, log=self._log)
        self.train_ds, self.valid_ds = train_ds, valid_ds
        workers = loader_workers(cfg)
        # a replayed step reads all its micro-batches first: the loader's workers hold a whole step ahead
        ahead = -(-self.derived.num_microbatches // max(workers, 1)) if self.step_graph is not None else 2
        self.train_iters = [MicroBatchStream(train_ds, cfg, self.coords.dp, self.consumed_samples, self.device, workers,
                                             ahead=max(ahead, 2)) for _ in range(cfg.parallel.vpp)]

    def _optimizer_path(self) -> str:
        opts = getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]
        names = []
        for o in opts:
            inner = getattr(o, "optimizer", None)
            if inner is None:
                continue
            d = inner.defaults if hasattr(inner, "defaults") else {}
            mode = "fused" if d.get("fused") else ("foreach" if d.get("foreach") or (d.get("foreach") is None and self.cuda) else "for-loop")
            names.append(f"{type(inner).__module__}.{type(inner).__name__} ({mode}); {type(o).__name__}")
        if self._offload_threads:
            names.append(f"optimizer CPU offload: {self.cfg.parallel.optimizer_cpu_offload:g} of the shard stepped by the host "
                         f"on {self._offload_threads} threads")
        return "; ".join(names) or type(self.optimizer).__name__

    def _maybe_load(self) -> None:
        c = self.cfg.checkpoint
        if not c.load_dir:
            return
        meta = load_checkpoint(c.load_dir, self.model, optimizer=None if c.finetune else self.optimizer,
                               scheduler=None if c.finetune else self.scheduler, load_optimizer=not c.finetune,
                               fresh_heads=c.finetune, load_rng=not c.finetune)
        note = hook_note(self.cfg, meta)  # this run imported its own config's hooks, never the checkpoint's
        if note:
            self._log(f"[workbench] {note}")
        if c.finetune:
            # the optimizer was built before the load: under bf16/fp16 (and the distributed optimizer) it holds fp32
            # main copies of the freshly initialised weights, and its first step would write those (plus the update)
            # back over the loaded ones.  Megatron's own loader refreshes them when it loads no optimizer state.
            self.optimizer.reload_model_params()
            fresh = f"; initialised fresh: {', '.join(meta['fresh'])}" if meta.get("fresh") else ""
            self._log(f"[workbench] loaded weights from {meta['path']} (finetune: iteration 0, fresh optimizer{fresh})")
            return
        self.iteration = int(meta["iteration"])
        extra = meta.get("extra") or {}
        self.consumed_samples = int(extra.get("consumed_samples", self.iteration * self.cfg.train.global_batch_size))
        self._log(f"[workbench] resumed from {meta['path']} at iteration {self.iteration}, consumed_samples {self.consumed_samples}; "
                  f"random states: {meta.get('rng')}")

    # ------------------------------------------------------------------ steps
    def _log(self, msg: str) -> None:
        if self.rank == 0 or getattr(self, "is_logging_rank", False):
            print(msg, flush=True)

    def _to_batch(self, raw: dict) -> Batch:
        return Batch(tokens=raw.get("tokens"), labels=raw.get("labels"), loss_mask=raw.get("loss_mask"),
                     position_ids=raw.get("position_ids"), attention_mask=raw.get("attention_mask"),
                     extra={k: v for k, v in raw.items() if k not in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")},
                     family_step=self.step)  # the run's context: workbench.hooks.default_forward_step runs it

    def _make_forward_step(self, train: bool):
        from megatron.core import tensor_parallel

        hooks = self.hooks
        step = self.step  # the family's default forward step and loss
        loss_name = self.loss_name
        fwd = hooks.forward_step or step.forward_step
        counters = [0] * len(self.model)
        timer = self.timer if train else None
        return_logits = hooks.return_logits
        logits_store = self.last_logits

        from megatron.core import parallel_state

        from workbench.rank.data import shard_batch

        cp = parallel_state.get_context_parallel_world_size()
        cp_rank = parallel_state.get_context_parallel_rank()
        cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None

        def loss_func(batch: Batch, mb: int, chunk: int, output_tensor: torch.Tensor):
            if return_logits:
                logits = output_tensor
                if train:
                    logits_store.append(logits.detach())
                batch.logits = logits
                losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), batch.labels)
            else:
                losses = output_tensor
            if train and hooks.loss_func is not None:
                res = hooks.loss_func(batch, losses, **hooks.kwargs)
                loss, extras = (res if isinstance(res, tuple) else (res, {}))
                report = {loss_name: loss.detach().clone().float()}
                report.update({k: torch.as_tensor(v).detach().float() for k, v in extras.items()})
                if timer is not None:
                    timer.remember(loss, mb, chunk)
                return loss, report
            loss_sum, num_tokens, report = step.loss(batch, losses)
            if cp_group is not None:
                # context parallel: the schedule divides by num_tokens and DDP averages the gradients over DP x CP, so
                # each CP rank's sum is divided by the token count of the whole sequence (summed over the CP group) and
                # multiplied by cp: the CP ranks' halves are weighted by their tokens, as one rank holding it all
                num_tokens = num_tokens.detach().clone()
                dist.all_reduce(num_tokens, group=cp_group)
                loss_sum = loss_sum * cp
            if timer is not None:
                timer.remember(loss_sum, mb, chunk)
            return loss_sum, num_tokens, report

        def forward_step(data_iterator, model):
            chunk = self._chunk_of.get(id(model), 0)
            mb = counters[chunk]
            counters[chunk] += 1
            # CP: this rank's sequence slice (a family's step may name its own per-token keys: PER_TOKEN_KEYS)
            batch = self._to_batch(shard_batch(next(data_iterator), cp_rank, cp, getattr(step, "PER_TOKEN_KEYS", ())))
            op = timer.forward_start(mb, chunk) if timer is not None else None
            if fwd is step.forward_step:
                out = fwd(batch, model, return_logits=return_logits)
            else:
                out = fwd(batch, model, **{**hooks.kwargs, **({"return_logits": True} if return_logits else {})})
            if timer is not None:
                timer.forward_end(op, out)
            return out, partial(loss_func, batch, mb, chunk)

        return forward_step

    def _reduce_loss(self, reports: list[dict]) -> dict[str, float]:
        """Average the last stage's reported losses across micro-batches and DP x CP ranks (None elsewhere)."""
        from megatron.core import parallel_state

        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True) or not reports:
            return {}
        out = {}
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)  # CP ranks hold parts of a sequence
        size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        for key in reports[0]:
            vals = torch.stack([r[key].float().reshape(-1) for r in reports]).to(self.device)
            if vals.shape[1] == 2:  # [sum, tokens] per micro-batch: token-weighted mean
                tot = vals.sum(dim=0)
                dist.all_reduce(tot, group=group)
                out[key] = float(tot[0] / tot[1].clamp(min=1))
            else:
                v = vals.mean().reshape(1)
                dist.all_reduce(v, group=group)
                out[key] = float(v / size)
        return out

    def _data_iter(self, its: list):
        return its if len(its) > 1 else its[0]

    def train_step(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        sample = (t.microbatch_timing_interval > 0 and (self.iteration + 1) % t.microbatch_timing_interval == 0
                  and (self.step_graph is None or bool(self.step_graph.failed)))  # a replay records no events
        for m in self.model:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.last_logits.clear()
        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self.timer.begin_step(sample)
        # [perf hook] a new path through the CUDA-graph trees; weights fixed (FP8 copies cast once) until it ends
        with compiled_layer.training_step():
            reports = (self.step_graph or self.forward_backward)(
                forward_step_func=self._make_forward_step(train=True),
                data_iterator=self._data_iter(self.train_iters),
                model=self.model if len(self.model) > 1 else self.model[0],
                num_microbatches=self.derived.num_microbatches,
                seq_length=cfg.model.seq_length,
                micro_batch_size=t.micro_batch_size,
                forward_only=False,
            )
        for stream in self.train_iters:  # next step's first micro-batch, built while the GPU works
            stream.prefetch()
        ok, grad_norm, _zeros = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.collector.after_step()  # while the device runs the optimizer's kernels (nothing waited on it yet)
        losses = self._reduce_loss(reports)
        if self.cuda:
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        # micro-batch timings resolve after the step's own sync: reading them costs no extra
        # device sync (one before the optimizer would idle the GPU while the host launches it)
        ops = self.timer.end_step()
        self._last_step_time = step_time
        self.iteration += 1
        self.consumed_samples += t.global_batch_size
        return {"losses": losses, "grad_norm": grad_norm, "skipped": not ok, "step_time": step_time, "ops": ops,
                "step_graph": self.step_graph.last if self.step_graph is not None else None}

    def evaluate(self) -> Optional[dict[str, float]]:
        from workbench.rank.data import MicroBatchStream

        t = self.cfg.train
        if t.eval_iters <= 0 or self.valid_ds is None or len(self.valid_ds) == 0:
            return None
        for m in self.model:
            m.eval()
        its = [MicroBatchStream(self.valid_ds, self.cfg, self.coords.dp, 0, self.device) for _ in self.model]
        reports: list[dict] = []
        last_note = time.time()
        with torch.no_grad():
            for done in range(t.eval_iters):
                if time.time() - last_note >= EVAL_PROGRESS_SECONDS:
                    self.events.write(EvalProgress(iteration=self.iteration, done=done, total=t.eval_iters))
                    last_note = time.time()
                reports += self.forward_backward(
                    forward_step_func=self._make_forward_step(train=False),
                    data_iterator=self._data_iter(its),
                    model=self.model if len(self.model) > 1 else self.model[0],
                    num_microbatches=self.derived.num_microbatches,
                    seq_length=self.cfg.model.seq_length,
                    micro_batch_size=t.micro_batch_size,
                    forward_only=True,
                )
        for m in self.model:
            m.train()
        losses = self._reduce_loss(reports)
        if self.loss_name not in losses:
            return None
        loss = losses[self.loss_name]
        # the family's other reported metrics (e.g. BERT's sentence-order loss, masked-token accuracy)
        return {"loss": loss, "ppl": math.exp(min(loss, 80.0)), "metrics": {k: v for k, v in losses.items() if k != self.loss_name}}

    def save(self) -> Path:
        root = Path(self.cfg.checkpoint.save_dir or (self.run_dir / "checkpoints"))
        t0 = time.time()
        path = save_checkpoint(root, self.iteration, self.model, self.cfg, optimizer=self.optimizer, scheduler=self.scheduler,
                               extra={"consumed_samples": self.consumed_samples}, tokenizer=self.cfg.data.tokenizer, rng=True)
        self.events.write(Checkpoint(iteration=self.iteration, path=str(path), seconds=time.time() - t0))
        self._log(f"[workbench] saved checkpoint {path}")
        return path

    # ------------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, _frame):
            if self.stop_signal is not None:  # second signal: leave now
                self._end("stopped", STOP_CODES.get(signum, 1), leaving=True)
                os._exit(STOP_CODES.get(signum, 1))
            self.stop_signal = signum
            print(f"[workbench] rank {self.rank}: received signal {signum}; stopping at the next step boundary all ranks agree on", file=sys.stderr, flush=True)

            def watchdog():
                time.sleep(max(15.0, 5.0 * self._last_step_time))  # the agreement lands within two steps
                self._end("stopped", STOP_CODES.get(signum, 1), leaving=True)
                os._exit(STOP_CODES.get(signum, 1))

            threading.Thread(target=watchdog, daemon=True).start()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _agree_stop(self) -> bool:
        """Whether every rank stops after this step; all ranks always give the same answer.

        One process: its own flag.  Several: each step boundary starts a non-blocking MAX
        all-reduce of the ranks' flags and reads the one started at the previous boundary,
        which has long finished (the step in between ended with a device sync).  So a stop
        lands one step after the signal, and no step waits on a collective of its own.
        """
        local = 1.0 if self.stop_signal is not None else 0.0
        if self.coords.world_size == 1:
            return local > 0
        if self._finish_stop_agreement():
            if self.stop_signal is None:
                self.stop_signal = signal.SIGTERM  # another rank was signalled
            return True
        flag = torch.full((1,), local, device=self.device)  # a fill kernel: no host-to-device copy, no sync
        self._stop_pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return False

    def _finish_stop_agreement(self) -> bool:
        """Wait for the outstanding stop all-reduce, if any (every rank has the same sequence); its result."""
        pending, self._stop_pending = self._stop_pending, None
        if pending is None:
            return False
        work, flag = pending
        work.wait()
        return flag.item() > 0

    def _end(self, status: str, code: int, *, leaving: bool = False) -> None:
        """The run's end record; then the data loader's workers are ended, unless the process is ``leaving`` at once
        (``os._exit``: a stuck rank must not wait on their join; they see their parent gone and exit)."""
        if self._ended:
            return
        self._ended = True
        try:
            self.events.write(RunEnd(status=status, iteration=self.iteration, seconds=time.time() - self.t0, exit_code=code))
            self.events.close()
        except Exception:
            pass
        try:
            if self.tensorboard is not None:
                self.tensorboard.close()
        except Exception:
            pass
        for stream in () if leaving else getattr(self, "train_iters", ()):
            try:
                stream.close()
            except Exception:
                pass

    def _tensorboard(self, rec: Any) -> None:
        """A step or eval record into the TensorBoard log, flushed (a killed run keeps it); nothing without one."""
        if self.tensorboard is not None:
            self.tensorboard.write(rec)
            self.tensorboard.flush()

    # ------------------------------------------------------------------ main loop
    def run(self) -> int:
        """Set up, train, evaluate, checkpoint. Returns the process exit code."""
        self._install_signals()
        try:
            self.setup()
            with self.collector:
                return self._loop()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the event stream
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            try:
                self.events.write(Error(message=str(e), traceback=tb, exception=type(e).__name__))
            except Exception:
                pass
            self._end("failed", 1)
            return 1

    def _loop(self) -> int:
        from tqdm import tqdm

        from workbench.rank.metrics import memory_stats, peak_tflops

        cfg, t, c = self.cfg, self.cfg.train, self.cfg.checkpoint
        dev_name = torch.cuda.get_device_name() if self.cuda else f"cpu ({platform.processor() or platform.machine()})"
        self.events.write(RunStart(
            config=cfg.to_dict(), versions=_versions(), device=dev_name, hostname=socket.gethostname(),
            world_size=self.coords.world_size, coords={"tp": self.coords.tp, "pp": self.coords.pp, "dp": self.coords.dp,
                                                        **({"cp": self.coords.cp} if self.coords.cp_size > 1 else {})},
            kernel_path=self.kernel_path, kernels=self.kernel_choice, data=self.data_desc, start_iteration=self.iteration,
        ))
        if t.tensorboard and self.is_logging_rank:  # the rank holding the loss; a resume drops the earlier points after it
            self.tensorboard = TensorBoardLog(tensorboard_dir(self.run_dir), purge_step=self.iteration + 1 if self.iteration else None)
        peak = peak_tflops(dev_name, t.precision, t.peak_tflops) if self.cuda else t.peak_tflops
        flops = self.derived.flops_per_step
        tokens = self.derived.tokens_per_step
        world = self.coords.world_size
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        bar = tqdm(total=t.train_iters, initial=self.iteration, desc="train", disable=not self.is_logging_rank,
                   mininterval=2.0, file=sys.stderr, dynamic_ncols=True)
        saved_at = -1
        while self.iteration < t.train_iters:
            res = self.train_step()
            it = self.iteration
            loss = res["losses"].get(self.loss_name)
            self.last_loss = loss
            if it % t.log_interval == 0 or it == t.train_iters:
                tflops = flops / res["step_time"] / world / 1e12
                self._tensorboard(self.events.write(Step(
                    iteration=it, loss=loss, lr=self.scheduler.get_lr(self.optimizer.param_groups[0]),
                    grad_norm=None if res["grad_norm"] is None else float(res["grad_norm"]), skipped=res["skipped"],
                    step_time=res["step_time"], tokens_per_s=tokens / res["step_time"], tflops_per_gpu=tflops,
                    mfu=(tflops / peak) if peak else None, consumed_samples=self.consumed_samples,
                    step_graph=res["step_graph"], **memory_stats(self.cuda),
                    extra={k: v for k, v in res["losses"].items() if k != self.loss_name},
                )))
            for rec in self.monitor.after_step(it, self.derived.num_microbatches) if self.monitor else ():
                if self.is_logging_rank:
                    self.events.write(rec)
            if res["ops"]:
                self.events.write(Microbatch(iteration=it, ops=res["ops"], pp_rank=self.coords.pp,
                                             num_microbatches=self.derived.num_microbatches, num_chunks=len(self.model)))
            bar.update(1)
            if loss is not None:
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if t.eval_interval and it % t.eval_interval == 0:
                ev = self.evaluate()
                if ev is not None:
                    self._tensorboard(self.events.write(Eval(iteration=it, loss=ev["loss"], ppl=ev["ppl"], extra=ev["metrics"])))
                    self._log(f"[workbench] eval @ {it}: loss {ev['loss']:.4f} ppl {ev['ppl']:.2f}")
            if c.save_interval and it % c.save_interval == 0:
                self.save()
                saved_at = it
            if self._agree_stop():
                code = STOP_CODES.get(self.stop_signal, 143)
                if c.save_on_exit and saved_at != it:
                    self.save()
                bar.close()
                self._end("stopped", code)
                return code
        bar.close()
        self._finish_stop_agreement()  # the run ends here anyway; no collective may be left in flight
        if c.save_on_exit and saved_at != self.iteration:
            self.save()
        self._end("finished", 0)
        return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m workbench.rank --config RUN.json --run-dir DIR`` (under torchrun).  Exit 2 before any step for
    what the launch would refuse too: a config, a resume's checkpoint (``load_problems``) or, on global rank 0, a
    ``checkpoint.save_dir`` another live run writes (:mod:`workbench.run.writer`)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.rank", description="Workbench training backend (one rank; start with torchrun).")
    ap.add_argument("--config", required=True, help="RunConfig JSON/YAML")
    ap.add_argument("--run-dir", required=True, help="run directory (events/, checkpoints/, exit_status.json)")
    args = ap.parse_args(argv)
    # `kill -USR1 <pid>` prints every thread's Python stack to this rank's log: where a hung rank waits
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    try:
        cfg = load_config(args.config)
        cfg.check()
        # a resume's checkpoint as the launch checks it; its files' checksums only on rank 0 of a run that no
        # `workbench launch` started (a launch writes launch.json after hashing them; every rank's load hashes its own)
        hashes = int(os.environ.get("RANK", "0")) == 0 and not (Path(args.run_dir) / LAUNCH_FILE).exists()
        if problems := load_problems(cfg, hashes=hashes):
            raise ConfigError(problems)
        notes = writer.rank_claim(cfg, args.run_dir)  # one writer per checkpoint folder: global rank 0, before any step
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for note in notes:
        print(f"[workbench] note: {note}", flush=True)
    trainer = Trainer(cfg, args.run_dir)
    code = trainer.run()
    writer.release(cfg, args.run_dir, pid=os.getpid())  # rank 0's own claim only; a launch's is its supervisor's to give back
    if code == 1:
        # another rank may be blocked in a collective; do not wait for process-group teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return teardown(code)


def teardown(code: int, timeout_s: float = 60.0) -> int:
    """Destroy the process groups and return ``code``; if that hangs (a driver or NCCL fault:
    a finished run must still end), leave the process with ``code`` after ``timeout_s``."""
    def leave() -> None:
        print(f"[workbench] process-group teardown hung for {timeout_s:g} s; exiting with {code}", file=sys.stderr, flush=True)
        os._exit(code)

    guard = threading.Timer(timeout_s, leave)
    guard.daemon = True
    guard.start()
    distributed.destroy()
    guard.cancel()
    return code
