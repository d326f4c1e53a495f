"""The one kernel rule: which kernels a run config trains with.

:func:`choose` decides, for a config and the packages importable where it runs, the core
attention (Transformer Engine, the workbench SDPA module or stock megatron), whether the
transformer layers run as the compiled dense layer or as megatron's stock layer (and why
not), the norm, the cross-entropy, the optimizer kernel, what ``recompute: selective``
recomputes and whether the compiled layers replay as CUDA graphs.  The backend's builder
(the families' specs in :mod:`workbench.models`, :mod:`workbench.backend.compiled_layer`), the planner and the
benchmarks call it; nothing else restates these rules.  ``tests/`` builds the real model
for a grid of configs and checks that what was built is what :func:`choose` said.

Transformer Engine: ``attention_backend: auto`` takes the compiled workbench layer whenever
it applies (GPT-2 medium on an H200: 1.9x the tokens/s of TE's stock layer, bench/README.md).
Where it does not (compiling off, per-document masks; ALiBi, which TE lacks, stays on SDPA)
``auto`` takes TE's layer when TE is usable and that layer replays as megatron's CUDA graphs (``train.cuda_graphs``, no recompute, no
pipeline), or where FP8 is asked for (no other layer runs it there); else megatron's stock layer on SDPA,
which beat TE's ungraphed layer in every measured row (:data:`AUTO_EVIDENCE`).
An explicit ``attention_backend: te`` builds TE's layer.  A TE that is installed but broken (its import
raises, e.g. without the ``transformer-engine`` distribution metadata) is found here before
megatron-core is imported, reported once, and hidden (:func:`guard_transformer_engine`) so
the run continues on the non-TE path instead of failing inside megatron's own import.

This module imports neither torch nor megatron-core (the planner calls it in a 10 ms loop).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from workbench.families import FAMILIES

__all__ = [
    "KernelChoice",
    "choose",
    "decided",
    "fast_paths_wanted",
    "layer_blocker",
    "graphs_off_reason",
    "moe_graphs_blocker",
    "te_status",
    "te_available",
    "apex_available",
    "guard_transformer_engine",
    "SP_OVERLAP_FIELDS",
    "pin_torch_cudnn_for_te",
    "allow_fast_paths_on_cpu",
    "fp8_problems",
    "chunked_problems",
    "userbuffer_problems",
    "async_tp_problems",
    "FP8_RECIPES",
    "SDPA_CUDNN_FIRST",
    "SELECTIVE_RECOMPUTE",
    "STEP_GRAPH_NOTE",
    "GPU_ONLY_FIELDS",
]

#: What ``parallel.recompute: selective`` recomputes on the workbench's own layers.  Stock
#: Megatron's default (``core_attn``) saves nothing with SDPA/flash attention, which keeps no
#: s x s scores; the workbench recomputes the dense MLP (fc1 output and activation) instead.
#: On the TE spec it keeps Megatron's meaning (core attention).
SELECTIVE_RECOMPUTE = "mlp (fc1 + activation rebuilt in backward)"

_FAST_ON_CPU = False

#: Config fields that act only on GPUs (``parallel.device: cuda``): on CPU the rule above ignores the
#: compiled layer, its CUDA graphs and its TP overlap (:func:`fast_paths_wanted`), and validation refuses
#: FP8, TE's userbuffers and communication overlap.  The config form shows them only on ``device: cuda``.
GPU_ONLY_FIELDS = ("train.compile_kernels", "train.cuda_graphs", "train.fp8", "parallel.tp_comm_overlap",
                   "parallel.te_userbuffers", "parallel.async_tp", "parallel.tp_chunked", "parallel.overlap_grad_reduce",
                   "parallel.overlap_param_gather", "parallel.optimizer_cpu_offload")

#: Training's TP overlaps that split sequence parallelism's collectives (each refused without TP >= 2 and SP:
#: :func:`_tp_sp_rules`).  Generation runs without SP and ignores them (``workbench.generation``).
SP_OVERLAP_FIELDS = ("parallel.tp_chunked", "parallel.async_tp", "parallel.te_userbuffers")


def allow_fast_paths_on_cpu(enabled: bool = True) -> None:
    """Tests: let the compiled fast paths run for ``parallel.device: cpu`` too (GPU-only otherwise)."""
    global _FAST_ON_CPU
    _FAST_ON_CPU = bool(enabled)


# --------------------------------------------------------------------------- optional packages


@lru_cache(maxsize=None)
def te_status() -> tuple[Literal["absent", "ok", "broken"], str]:
    """Whether Transformer Engine can be used here, without importing it.

    ``broken`` when the ``transformer_engine`` package is there but cannot import: its
    distribution metadata is missing (TE then fails its own check with ``AssertionError:
    Could not find transformer-engine``) or its torch extension is not installed.
    """
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return "absent", "transformer_engine is not installed"
    except (ImportError, ValueError):
        return "absent", "transformer_engine is hidden in this process"
    try:
        version = importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return "broken", ("the transformer_engine package has no 'transformer-engine' distribution metadata "
                          "(its import fails its own check); fix: pip install the 'transformer-engine' meta-package "
                          "of the same version, or uninstall transformer_engine")
    if not _te_torch_extension():
        return "broken", (f"transformer-engine {version} has no PyTorch extension (transformer_engine_torch); "
                          "fix: bash launch/install_te.sh, or uninstall transformer_engine")
    try:  # a PyPI install: TE asserts that the three packages' versions match
        ext_version = importlib.metadata.version("transformer_engine_torch")
    except importlib.metadata.PackageNotFoundError:
        return "ok", f"transformer-engine {version}"
    core = [importlib.metadata.version(n) for n in ("transformer_engine_cu13", "transformer_engine_cu12")
            if _has_dist(n)]
    if ext_version != version or (core and core[0] != version):
        return "broken", (f"transformer-engine {version}, its PyTorch extension {ext_version} and core "
                          f"{core[0] if core else 'missing'} differ (TE refuses mismatched versions); fix: "
                          "bash launch/install_te.sh (WORKBENCH_TE_VERSION one version for all), or uninstall transformer_engine")
    return "ok", f"transformer-engine {version}"


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _te_torch_extension() -> bool:
    """TE's PyTorch extension where TE itself looks for it (``transformer_engine.common``): a module on the
    path (source builds), or ``transformer_engine_torch*.so`` beside the package, in it, or in its
    ``wheel_lib`` folder (PyPI)."""
    if importlib.util.find_spec("transformer_engine_torch") is not None:
        return True
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return False
    import pathlib

    for loc in spec.submodule_search_locations:
        pkg = pathlib.Path(loc)
        for folder in (pkg.parent, pkg, pkg / "wheel_lib"):
            if folder.is_dir() and any(f.name.startswith("transformer_engine_torch") and f.suffix == ".so"
                                       for f in folder.iterdir()):
                return True
    return False


def te_available() -> bool:
    return te_status()[0] == "ok"


@lru_cache(maxsize=None)
def apex_available() -> bool:
    return importlib.util.find_spec("apex") is not None


_TE_REPORTED = False


def guard_transformer_engine(stream: Any = None) -> str | None:
    """Call before megatron-core is imported: hide a broken Transformer Engine from this process.

    megatron-core imports TE where it finds it, and a broken TE raises ``AssertionError`` from
    inside that import, failing the whole backend.  Here a broken TE is reported once (on
    ``stream``, default stderr) and replaced by ``None`` in ``sys.modules``, so every
    ``import transformer_engine`` raises ``ImportError`` and megatron takes its non-TE path.
    Returns the message when TE was hidden.
    """
    global _TE_REPORTED
    status, why = te_status()
    if status == "ok":
        pin_torch_cudnn_for_te()
    if status != "broken":
        return None
    for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
        del sys.modules[name]
    sys.modules["transformer_engine"] = None  # type: ignore[assignment]
    msg = f"[workbench] Transformer Engine is installed but unusable: {why}. Continuing without it."
    if not _TE_REPORTED:
        print(msg, file=stream or sys.stderr, flush=True)
        _TE_REPORTED = True
    return msg


def pin_torch_cudnn_for_te() -> str | None:
    """Point Transformer Engine at torch's own cuDNN (``CUDNN_PATH``), unless the user chose one.

    TE loads the first ``libcudnn.so*`` it finds under ``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``, ``CUDA_PATH``
    or ``/usr/local/cuda`` into the global symbol scope, before torch first needs cuDNN; torch then binds to
    that one, and where it is older than the one torch was built against every cuDNN call fails ("cuDNN
    version incompatibility", seen with an image's 9.14 beside torch's 9.19).  The folder of torch's wheel
    (``nvidia/cudnn`` on the path, the one torch loads) is the same file for both.  Set in this process's
    environment, so the ranks it starts inherit it; too late (and left alone) where TE was imported before
    ``workbench``.  Returns the folder set.
    """
    import os

    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH") or "transformer_engine" in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except (ImportError, ValueError):
        return None
    import pathlib

    for loc in (spec.submodule_search_locations or []) if spec else []:
        if any((pathlib.Path(loc) / "lib").glob("libcudnn.so*")):
            os.environ["CUDNN_PATH"] = str(loc)
            return str(loc)
    return None


# --------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one config trains with (where they differ in speed or in what they keep)."""

    #: te: Transformer Engine's spec (TE linears, norms, fused attention); sdpa: the workbench's
    #: torch SDPA module (flash/cuDNN); local: megatron's unfused DotProductAttention
    attention: Literal["te", "sdpa", "local"]
    #: compiled: the workbench's compiled dense layer (one graph per layer); stock: megatron's TransformerLayer
    layer: Literal["compiled", "stock"]
    #: why the layer is stock ("" when compiled)
    layer_reason: str
    norm: Literal["te", "apex", "workbench", "torch"]
    cross_entropy: Literal["compiled", "vocab_parallel"]
    optimizer: Literal["fused", "foreach", "for-loop"]
    #: what recompute: selective recomputes: the MLP (workbench layers) or core attention (TE spec)
    selective: Literal["mlp", "core_attn"]
    #: why CUDA graphs are off although train.cuda_graphs asks for them ("" otherwise)
    cuda_graphs_reason: str
    #: whether the rule found Transformer Engine usable
    transformer_engine: bool
    #: train.fp8's recipe where the layer runs it ("off" otherwise) ...
    fp8: Literal["off", "tensorwise", "rowwise", "delayed"] = "off"
    #: ... and by whom: torch (the compiled layer, workbench.backend.fp8) or te (TE's layer, megatron's fp8 config)
    fp8_impl: Literal["", "torch", "te"] = ""
    #: what to expect of that FP8 here ("" when nothing measured says otherwise): see :func:`_fp8_slot`
    fp8_note: str = ""
    #: torch SDPA's backend order for the process on Hopper and later ((): torch's own).  With TE importable,
    #: TE's core library loads the system's cuDNN; older than torch's own, torch stops preferring cuDNN's
    #: SDPA and takes flash (H100, system cuDNN 9.14 under torch's 9.19: SDPA forward+backward 0.57 vs 0.38 ms,
    #: GPT-2 medium 163k vs 176k tok/s, bench/results/te_presence.jsonl).  cuDNN first is torch's own order
    #: there without TE.  Torch prefers cuDNN's SDPA only from cuDNN 9.15.1, whose fix concerns sequence lengths
    #: that are not multiples of 128, so the order is set only where every training length is one, and only in
    #: the training ranks (not for generation, whose lengths vary).
    sdpa_order: tuple[str, ...] = ()
    #: who replays the layers as CUDA graphs: "step" (the whole forward-backward of a training step, every layer and
    #: micro-batch, one ``torch.cuda.CUDAGraph``: :mod:`workbench.backend.step_graph`, where
    #: :func:`step_graph_blocker` finds nothing), "torch" (the compiled layer's cudagraph trees, PP = 1), "megatron"
    #: (megatron's CudaGraphManager, ``cuda_graph_impl: local``: TE's layer, and the compiled layer under pipeline
    #: parallelism, where it records one graph per layer and micro-batch in the schedule's order and shares one
    #: memory pool; a graph-safe RNG tracker, TE's where TE is usable), "" (none)
    cuda_graphs_impl: Literal["", "step", "torch", "megatron"] = ""
    #: how TP > 1 hides its collectives: "compiled" (``parallel.tp_comm_overlap``, not under ``async_tp``: the
    #: compiled layer's backward computes weight gradients under the input-gradient collective), "userbuffers"
    #: (``parallel.te_userbuffers``:
    #: TE's layer through megatron's ``tp_comm_overlap``, GEMMs split and pipelined with the all-gather /
    #: reduce-scatter in TE's userbuffers), "chunked" (``parallel.tp_chunked``: TP = 2 + SP, the compiled layer's GEMMs
    #: in two row chunks, each exchange with the peer under the other chunk's GEMM), "" (none: TP = 1, or the layer's
    #: collectives are exposed)
    tp_overlap: Literal["", "compiled", "userbuffers", "chunked"] = ""
    #: ``parallel.async_tp``: the compiled layer's sequence-parallel all-gathers / reduce-scatters micro-pipelined
    #: with their GEMMs (inductor's ``_micro_pipeline_tp`` over symmetric memory; :func:`async_tp_problems`)
    async_tp: bool = False
    #: who adds each micro-batch's weight gradients into megatron DDP's fp32 main_grad: "workbench" (a copy for
    #: the step's first, a vectorised add after: workbench.backend.grad_accumulation) or "megatron" (its DDP hook's
    #: add_; where megatron's own CUDA graphs accumulate inside the graph)
    grad_accumulation: Literal["workbench", "megatron"] = "megatron"
    #: the compiled layer's weight-gradient GEMMs add their fp32 sums into ``main_grad`` themselves (cuBLAS's
    #: ``beta = 1``, :func:`workbench.backend.grad_accumulation.wgrad_into`; megatron's ``gradient_accumulation_fusion``
    #: without apex or TE): no 16-bit weight gradient written, no add after it.  Where the compiled layer runs without
    #: TP, FP8, recompute or inductor's cudagraph trees (they would skip a graph that changes an input), and without a
    #: custom ``train.forward_step`` (whose calls may take megatron's stock forward in some micro-batches: a stock
    #: call clears the flag that makes DDP's hook drop the placeholder ``.grad``, which holds only while a
    #: micro-batch's backward follows its forward); a tied embedding / LM head weight the same way (the head's GEMM
    #: and the lookup's row adds, :mod:`workbench.backend.tied_embedding`); its other weights (untied embeddings,
    #: norms, biases) as :attr:`grad_accumulation` says
    wgrad_fused: bool = False
    #: the compiled layer's hand-written Triton ops on CUDA, instead of inductor's fused point-wise kernels: SwiGLU
    #: (``model.activation: swiglu``, :mod:`workbench.backend.glu`), the QKV split + rotary + GQA repeat into
    #: SDPA's layout (rotary embeddings, :mod:`workbench.backend.qkv_rope`: its forward; its backward is torch's) and
    #: the TP = 1 cross-entropy (:mod:`workbench.backend.cross_entropy`: one read of the logits each way)
    triton_ops: bool = False
    #: MoE layers' experts ("" without): te_grouped (TE's grouped MLP, on TE's layer), torch_grouped (one
    #: ``grouped_mm`` per expert GEMM, :mod:`workbench.backend.moe_experts`), sequential (megatron's SequentialMLP)
    experts: Literal["", "sequential", "torch_grouped", "te_grouped"] = ""
    #: who permutes MoE layers' tokens to their experts and back ("" without experts): "workbench" (TP = 1,
    #: dropless, torch_grouped experts, no FP8, any EP: gathered and summed without atomics, no host sync on one
    #: rank, one all-to-all each way at EP > 1, :mod:`workbench.backend.moe_dispatch`) or "megatron" (its dispatcher)
    moe_dispatch: Literal["", "workbench", "megatron"] = ""
    #: whose context parallelism runs at ``parallel.context_parallel`` > 1 ("" at 1): "ring" (the workbench's K/V ring
    #: over SDPA blocks, :mod:`workbench.backend.context_parallel`) or "te" (megatron-core's, in Transformer Engine's
    #: attention: ``attention_backend: te``, its ``p2p`` ring over the same load-balanced chunks)
    context_parallel: Literal["", "ring", "te"] = ""
    #: who routes MoE tokens ("" without experts): "workbench" (where its dispatch runs, softmax scores with the
    #: Switch aux loss or none: megatron's maths in one function, compiled on CUDA,
    #: :mod:`workbench.backend.moe_router`) or "megatron" (its TopKRouter)
    moe_router: Literal["", "workbench", "megatron"] = ""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "cuda_graphs": self.cuda_graphs}

    @property
    def cuda_graphs(self) -> bool:
        """The layers replay as CUDA graphs (whoever records them: :attr:`cuda_graphs_impl`)."""
        return self.cuda_graphs_impl != ""

    @property
    def flash(self) -> bool:
        """Attention keeps no s x s scores (TE or SDPA)."""
        return self.attention != "local"

    def describe(self) -> str:
        layer = "compiled layer" if self.layer == "compiled" else f"stock layer ({self.layer_reason})"
        graphs = {"step": ", the step as one CUDA graph", "torch": ", CUDA graphs",
                  "megatron": ", megatron's CUDA graphs"}.get(self.cuda_graphs_impl, "")
        if self.tp_overlap == "userbuffers":
            graphs += ", TP comm overlap in TE's userbuffers"
        if self.async_tp:
            graphs += f", async TP [{ASYNC_TP_MEASURED}]"
        if self.fp8 != "off":
            layer += f" with FP8 GEMMs ({self.fp8}, {'Transformer Engine' if self.fp8_impl == 'te' else 'torch'})"
            layer += f" [{self.fp8_note}]" if self.fp8_note else ""
        experts = f", experts {self.experts}" if self.experts else ""
        experts += f", {self.moe_dispatch}'s token dispatch" if self.moe_dispatch else ""
        experts += f", {self.moe_router}'s router" if self.moe_router else ""
        experts += {"ring": ", context parallel on the workbench ring",
                    "te": ", context parallel in Transformer Engine (megatron-core's)"}.get(self.context_parallel, "")
        return (f"attention {self.attention}, {layer}{graphs}{experts}, norm {self.norm}, cross-entropy {self.cross_entropy}, "
                f"optimizer {self.optimizer}")


#: what a run's kernel path says (``fast_cuda_graphs``) when the step is captured as one graph
#: (``workbench.backend.step_graph``; the planner re-plans a measured run on the graphs it reported)
STEP_GRAPH_NOTE = ("the training step's forward+backward (every layer and micro-batch) captured as one CUDA graph "
                   "after the eager warm-up steps, replayed each step (workbench.backend.step_graph; micro-batch "
                   "timing is not sampled)")
#: why context parallelism keeps CUDA graphs off: the compiled layer runs the ring attention eagerly between its
#: compiled pieces (``compiled_layer._ring_context``), and its point-to-point exchanges are not captured ...
CP_BLOCKER = "context parallel: the ring attention's point-to-point exchanges run eagerly between the compiled pieces"
#: ... and TE's ring (``attention_backend: te``) under megatron's CUDA graphs is not verified here
CP_TE_BLOCKER = "context parallel in Transformer Engine: its ring under megatron's CUDA graphs is not verified here"
#: what async TP measured (Llama-3.2-3B, TP=2 + SP, 2 H200s, aedb434: docs/performance.md)
ASYNC_TP_MEASURED = ("measured 0.53-0.58x TP=2 + SP without it on 2 H200s without NVLink multicast: symmetric-memory "
                     "barriers between each GEMM's pieces")
#: why ``parallel.async_tp`` runs without CUDA graphs
ASYNC_TP_BLOCKER = "async TP: the symmetric-memory kernels' capture is unproven here (parallel.async_tp)"


#: why a mixture-of-experts layer at TP > 1 keeps megatron's layer: at TP = 1 the compiled layer serves its attention
#: half (its MLP half is megatron's); megatron's MoE takes the sequence-parallel input its own way, not yet checked
#: against the compiled half
MOE_TP_BLOCKER = "mixture of experts at TP > 1"
#: why an MoE model under ``train.fp8`` keeps megatron's layer: TE's layer (or megatron's FP8 experts) runs the experts'
#: GEMMs, most of the FLOPs, in FP8; the compiled layer's FP8 covers its own GEMMs only, not the experts'
MOE_FP8_BLOCKER = "mixture of experts with FP8 (the experts' GEMMs run FP8 on megatron's layer, not the compiled one)"


def fast_paths_wanted(cfg: Any) -> bool:
    """``train.compile_kernels`` on a GPU (or on CPU where tests allowed it)."""
    return bool(cfg.train.compile_kernels) and (cfg.parallel.device == "cuda" or _FAST_ON_CPU)


def layer_blocker(cfg: Any) -> str | None:
    """Why the compiled dense layer cannot serve this config's layers, whatever the attention (None: it can).

    The model-level counterpart of ``layer_rules.fast_path_blocker``, which checks a built layer.
    """
    m, p = cfg.model, cfg.parallel
    family = FAMILIES.get(m.arch)
    if family is not None and family.supports.compiled_layer_blocker:
        return family.supports.compiled_layer_blocker
    if getattr(getattr(m, "moe", None), "num_experts", 0):
        if p.tensor_parallel > 1:
            return MOE_TP_BLOCKER
        if cfg.train.fp8 != "off":
            return MOE_FP8_BLOCKER
    if getattr(m, "qk_layernorm", False):
        if getattr(m, "qk_norm_scope", "head") == "all_heads":
            return "q/k RMSNorms over all heads (qk_norm_scope all_heads: megatron's attention with the workbench's norms)"
        return "q/k layernorm (megatron's attention normalises each query / key head)"
    if m.query_groups < p.tensor_parallel:
        return "fewer KV groups than TP ranks"
    if m.position_embedding == "alibi":
        return "ALiBi"
    if getattr(cfg.data, "reset_attention_mask", False):
        return "per-document attention mask (data.reset_attention_mask)"
    return None


def graphs_off_reason(cfg: Any) -> str | None:
    """Why a layout keeps CUDA graphs off although ``train.cuda_graphs`` asks for them.

    Pipeline parallelism: torch's cudagraph trees of a 1F1B step measured 0.04x the ungraphed speed (PP=2, m=8,
    GPT-2 medium, 2 H200s), and megatron's CudaGraphManager around the compiled layer (:func:`graphs_impl`) did not
    finish its first step within 270 s (2 H100s, dc9a31f): both are off until one is shown to work.  Full
    recompute: megatron's checkpoint runs every layer forward twice per step, once without grad, so no step
    follows one path.
    """
    if int(getattr(cfg.parallel, "context_parallel", 1) or 1) > 1:
        return CP_BLOCKER
    if int(cfg.parallel.pipeline_parallel) > 1:
        return "pipeline parallel (cudagraph trees measured 0.04x under 1F1B; megatron's manager hung at capture)"
    if cfg.parallel.recompute == "full":
        return "full recompute (each layer runs forward twice per step)"
    if getattr(getattr(cfg.model, "moe", None), "num_experts", 0):
        return moe_graphs_blocker(cfg)
    return None


#: why an MoE model's layers are not replayed one by one (cudagraph trees, megatron's manager): the tokens each
#: expert receives change every step, and megatron's dispatcher reads them on the host
MOE_GRAPHS_BLOCKER = "mixture of experts (token counts per expert change every step)"


def moe_graphs_blocker(cfg: Any) -> str | None:
    """Why an MoE config's step is not graphed (None: it is captured whole, :mod:`workbench.backend.step_graph`).

    The whole step holds an MoE step where nothing in it reads the routing on the host: one process (no expert
    parallel exchange, whose split sizes the host reads), the workbench's router and token dispatch on the compiled
    layer (the counts per expert stay on the device, the grouped GEMMs take their offsets from there, the tokens
    per micro-batch are fixed) and nothing else :func:`step_graph_blocker` refuses.  The router monitor's counts and
    megatron's metrics tracker accumulate in tensors made in the eager warm-up and zeroed in place after each step,
    so a replay adds into them as the eager step did.  Layers replayed one by one stay off for every MoE config."""
    if step_graph_blocker(cfg) is not None or layer_blocker(cfg) is not None or not fast_paths_wanted(cfg):
        return MOE_GRAPHS_BLOCKER
    if cfg.model.attention_backend not in ("auto", "sdpa"):
        return MOE_GRAPHS_BLOCKER
    experts = _experts_slot(cfg, "sdpa", True)
    if _router_slot(cfg, _dispatch_slot(cfg, experts)) != "workbench":
        return MOE_GRAPHS_BLOCKER + " with megatron's router or token dispatch (it reads them on the host)"
    return None


def step_graph_blocker(cfg: Any) -> str | None:
    """Why a compiled-layer run without pipelining does not capture its whole training step as one CUDA graph
    (None: it does, :mod:`workbench.backend.step_graph`).  A captured step replays what the host did once: every
    condition below is host-side work that differs between steps or that a capture cannot hold.

    Why the step: BERT-base as shipped (8 micro-batches of 8 x 512) ran 81 ms of kernels in a 236 ms step on an
    H200 with per-layer graphs (b534cf8, ``bench/results/bert_train.jsonl:12``): the host, launching the
    trees' replays, the hooks and the schedule's Python for 96 layer calls a step, was the step."""
    p, t = cfg.parallel, cfg.train
    if p.world_size > 1:
        return "more than one process (collectives inside one captured step are not proven here)"
    if p.overlap_grad_reduce or p.overlap_param_gather:
        return "parallel.overlap_grad_reduce / overlap_param_gather (megatron's bucket collectives start inside the backward)"
    if p.optimizer_cpu_offload:
        return "parallel.optimizer_cpu_offload (the optimizer steps on the host: a capture cannot hold it)"
    if t.precision == "fp16":
        return "fp16 (megatron's dynamic loss scale replaces its scale tensor between steps)"
    if t.fp8 != "off":
        return "train.fp8 (the FP8 weight copies are cast on the host's schedule once a step)"
    if t.forward_step or t.loss_func or t.return_logits:
        return "a custom train step (train.forward_step / loss_func / return_logits: Python a capture would freeze)"
    return None


def graphs_impl(cfg: Any, layer: str) -> Literal["step", "torch", "megatron"]:
    """Who records a graphed layer: the whole step as one graph for the compiled layer without pipelining where
    :func:`step_graph_blocker` finds nothing; else torch's cudagraph trees for the compiled layer without
    pipelining (one stable path per step, parameters as static inputs); megatron's CudaGraphManager for TE's layer
    and for the compiled layer under pipeline parallelism, where 1F1B / interleaving keep several micro-batches in
    flight: it records one graph per layer and micro-batch in the order the schedule ran them, in one pool."""
    if layer == "compiled" and int(cfg.parallel.pipeline_parallel) == 1:
        return "torch" if step_graph_blocker(cfg) else "step"
    return "megatron"


def _te_graphs_off(cfg: Any, te_spec: bool) -> str:
    """Why TE's layer would not replay as megatron's CUDA graphs for this layout ("": it would)."""
    if not te_spec:
        return "this family's TE layer is not graphed (its cross-attention mask pair)"
    if getattr(getattr(cfg.model, "moe", None), "num_experts", 0):
        return MOE_GRAPHS_BLOCKER
    if cfg.parallel.recompute != "none":
        return "recompute on TE's layer (megatron's CUDA graphs capture the layer whole)"
    if int(cfg.parallel.pipeline_parallel) > 1:
        return "pipeline parallel on TE's layer (not measured graphed; the compiled layer is graphed there)"
    return graphs_off_reason(cfg) or ""


def choose(cfg: Any, *, te: bool | None = None, apex: bool | None = None, cuda_available: bool = True) -> KernelChoice:
    """The kernels ``cfg`` trains with. ``te`` / ``apex``: whether they are usable where the run
    trains (default: here); ``cuda_available``: whether the training process sees a GPU."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    cuda = p.device == "cuda"
    te = te_available() if te is None else bool(te)
    apex = apex_available() if apex is None else bool(apex)
    fast = fast_paths_wanted(cfg)
    blocker = layer_blocker(cfg)
    family = FAMILIES.get(m.arch)
    te_spec = family is None or family.supports.transformer_engine

    te_graphs_off = _te_graphs_off(cfg, te_spec)
    cp = int(getattr(p, "context_parallel", 1) or 1)  # context parallel: the workbench ring, or TE's (attention te)
    if m.attention_backend == "auto":
        if fast and blocker is None:
            attention = "sdpa"  # the compiled layer: 1.9x TE's stock layer on GPT-2 medium (H200)
        elif te and cuda and te_spec and m.position_embedding != "alibi" and cp == 1 and (
                t.fp8 != "off" or (t.cuda_graphs and not te_graphs_off)):
            attention = "te"  # FP8 (only TE's layer runs it here), or TE's layer replayed as CUDA graphs (AUTO_EVIDENCE)
        else:
            attention = "sdpa"  # megatron's stock layer on SDPA: faster than TE's ungraphed layer (AUTO_EVIDENCE)
    else:
        attention = m.attention_backend

    if not t.compile_kernels:
        reason = "train.compile_kernels is off"
    elif not fast:
        reason = "fast paths are GPU-only (parallel.device: cpu)"
    elif attention != "sdpa":
        reason = f"attention_backend {attention}"
    else:
        reason = blocker or ""
    layer = "stock" if reason else "compiled"

    if attention == "te":
        norm = "te"
    elif layer == "stock" and apex and cuda and m.normalization == "layernorm":
        norm = "apex"
    elif attention == "local" and cuda and not p.sequence_parallel and not apex:
        norm = "torch"  # megatron's local spec as it is
    else:
        norm = "workbench"

    if not cuda:
        optimizer = "for-loop"  # torch's AdamW runs its single-tensor loop off CUDA
    elif fast or te or apex:
        optimizer = "fused"
    else:
        optimizer = "foreach"

    graphs_reason = ""
    graphed_layer = layer == "compiled" or attention == "te"
    if t.cuda_graphs and graphed_layer:
        graphs_reason = (te_graphs_off if attention == "te" else graphs_off_reason(cfg)) or (
            "" if cuda and cuda_available else "no GPU")
    if t.cuda_graphs and cp > 1:
        graphs_reason = CP_TE_BLOCKER if attention == "te" else CP_BLOCKER
    async_tp = bool(p.async_tp) and layer == "compiled" and not _async_tp_rules(cfg)
    if t.cuda_graphs and async_tp and not graphs_reason:
        graphs_reason = ASYNC_TP_BLOCKER
    graphs = bool(t.cuda_graphs) and graphed_layer and not graphs_reason
    impl = graphs_impl(cfg, layer) if graphs else ""
    tp_overlap = ""
    if p.tp_chunked and layer == "compiled" and not _chunked_rules(cfg):
        tp_overlap = "chunked"
    elif p.tensor_parallel > 1 and layer == "compiled" and p.tp_comm_overlap and not async_tp:
        tp_overlap = "compiled"  # (async TP leaves the backward no plain collective to move GEMMs under)
    elif p.te_userbuffers and not _userbuffer_rules(cfg, attention):
        tp_overlap = "userbuffers"
    return KernelChoice(
        attention=attention, layer=layer, layer_reason=reason, norm=norm,
        cross_entropy="compiled" if fast and p.tensor_parallel == 1 else "vocab_parallel",
        optimizer=optimizer, selective="core_attn" if attention == "te" else "mlp",
        cuda_graphs_reason=graphs_reason, cuda_graphs_impl=impl, transformer_engine=te,
        tp_overlap=tp_overlap, async_tp=async_tp, grad_accumulation="megatron" if impl == "megatron" else "workbench",
        wgrad_fused=(layer == "compiled" and p.tensor_parallel == 1 and not tp_overlap and t.fp8 == "off"
                     and p.recompute == "none" and impl in ("", "step") and not t.forward_step),
        triton_ops=layer == "compiled" and cuda,
        sdpa_order=SDPA_CUDNN_FIRST if (attention == "sdpa" and cuda and te
                                        and all(n % 128 == 0 for n in (m.seq_length, m.decoder_seq))) else (),
        experts=(experts := _experts_slot(cfg, attention, fast)),
        moe_dispatch=(dispatch := _dispatch_slot(cfg, experts)),
        moe_router=_router_slot(cfg, dispatch),
        context_parallel={"te": "te", "sdpa": "ring"}.get(attention, "") if cp > 1 else "",
        **_fp8_slot(t.fp8, layer, attention, m.hidden_size),
    )


def decided(cfg: Any, config: Any = None) -> KernelChoice:
    """The decision a model was built with: the one its TransformerConfig carries (``workbench_kernels``: made once
    by ``workbench.backend.model.transformer_config``, the trainer's own for a training run), else :func:`choose`'s
    for ``cfg`` now.  Spec builders and the compiled layer's summary read it instead of deciding again."""
    made = getattr(config, "workbench_kernels", None)
    return made if made is not None else choose(cfg)


def _experts_slot(cfg: Any, attention: str, fast: bool) -> str:
    """Which expert implementation an MoE config's layers get (:attr:`KernelChoice.experts`): TE's grouped MLP on
    TE's layer; torch's ``grouped_mm`` where the fast paths run (CUDA in bf16 -- its grouped GEMM kernels are bf16
    -- or CPU where tests allow the fast paths); else megatron's SequentialMLP.  ``model.moe.grouped_gemm: false``
    always takes SequentialMLP."""
    moe = getattr(cfg.model, "moe", None)
    if moe is None or not moe.num_experts:
        return ""
    if not moe.grouped_gemm:
        return "sequential"
    if attention == "te":
        return "te_grouped"
    if fast and (cfg.train.precision == "bf16" or cfg.parallel.device == "cpu"):
        return "torch_grouped"
    return "sequential"


def _dispatch_slot(cfg: Any, experts: str) -> str:
    """Who permutes an MoE config's tokens (:attr:`KernelChoice.moe_dispatch`): the workbench's gathers (and
    all-to-all at EP > 1) in place of megatron's all-to-all dispatcher (``model.moe.token_dispatcher: alltoall``, the
    default) for torch's grouped-GEMM experts without TP, dropless, without FP8; megatron's otherwise."""
    if not experts:
        return ""
    moe, p = cfg.model.moe, cfg.parallel
    ours = (moe.token_dispatcher == "alltoall" and p.tensor_parallel == 1 and (p.expert_tensor_parallel or 1) == 1
            and moe.capacity_factor is None and not moe.pad_to_capacity and cfg.train.fp8 == "off")
    return "workbench" if experts == "torch_grouped" and ours else "megatron"


def _router_slot(cfg: Any, dispatch: str) -> str:
    """Who routes an MoE config's tokens (:attr:`KernelChoice.moe_router`): the workbench's router where its token
    dispatch runs and the load-balancing loss is the Switch one over the micro-batch (or none); megatron's
    ``TopKRouter`` otherwise (the router itself also hands what it cannot do to megatron's code)."""
    if not dispatch:
        return ""
    ours = dispatch == "workbench" and cfg.model.moe.load_balancing in ("aux_loss", "none")
    return "workbench" if ours else "megatron"


#: ``auto``'s choice where the compiled layer does not apply, by measurement: tokens/s of TE's layer over
#: megatron's stock layer on SDPA, one H100, TE 2.20.2 (bench/results/train_throughput_te_present.jsonl,
#: bert_train.jsonl, t5_bench.jsonl).  Ungraphed (f3ba5f7) TE's layer is host-bound (GPT-2 medium: 193 ms of
#: device time in a 480 ms step) and loses; replayed as megatron's CUDA graphs (746c451) it wins.
AUTO_EVIDENCE = {
    "ungraphed": {"gpt2-medium, dropout 0.1": 0.66, "llama3.2-1b, dropout 0.1": 0.96, "bert-base, dropout 0.1": 0.77,
                  "t5-base, dropout 0.1": 0.83},
    "graphed": {"gpt2-medium, dropout 0.1": 1.78, "llama3.2-1b, dropout 0.1": 1.02, "bert-base, dropout 0.1": 2.77},
}

#: torch SDPA's order where TE's cuDNN would demote cuDNN (:attr:`KernelChoice.sdpa_order`)
SDPA_CUDNN_FIRST = ("cudnn", "flash", "efficient", "math")


#: the recipes each FP8 implementation has: torch's (compiled layer) and Transformer Engine's (on Hopper;
#: TE's MXFP8 needs Blackwell and its block scaling is not the same recipe as row-wise)
FP8_RECIPES = {"torch": ("tensorwise", "rowwise", "delayed"), "te": ("tensorwise", "delayed")}


def _fp8_impl(layer: str, attention: str) -> str:
    """Who runs FP8 GEMMs on this layer: torch (the compiled layer), te (TE's layer), or nobody ("")."""
    return "torch" if layer == "compiled" else ("te" if attention == "te" else "")


#: torch-native FP8 (the casts are memory-bound, the GEMM savings grow with the hidden size) measured slower than
#: bf16 below this hidden size: GPT-2 medium (1024) 0.77x / 0.79x, Llama-3.2-1B (2048) 1.14-1.15x (bench/README.md)
FP8_TORCH_PAYS_FROM_HIDDEN = 2048


def _fp8_slot(recipe: str, layer: str, attention: str, hidden: int) -> dict[str, str]:
    impl = _fp8_impl(layer, attention)
    if recipe == "off" or recipe not in FP8_RECIPES.get(impl, ()):
        return {"fp8": "off", "fp8_impl": ""}
    note = ""
    if impl == "torch" and hidden < FP8_TORCH_PAYS_FROM_HIDDEN:
        note = (f"expect it slower than bf16 at hidden {hidden}: measured 0.77x at 1024, 1.15x from "
                f"{FP8_TORCH_PAYS_FROM_HIDDEN} (the casts cost more than the smaller GEMMs save)")
    return {"fp8": recipe, "fp8_impl": impl, "fp8_note": note}


def _te_version() -> tuple[int, ...]:
    """(major, minor) of the installed transformer-engine; (99,) when its metadata is missing (nothing to check)."""
    try:
        v = importlib.metadata.version("transformer-engine")
    except importlib.metadata.PackageNotFoundError:
        return (99,)
    return tuple(int(x) for x in v.split("+")[0].split(".")[:2] if x.isdigit())


def fp8_problems(cfg: Any) -> list[tuple[str, str, str]]:
    """``(field, rule, fix)`` for a ``train.fp8`` this config cannot train with (config validation calls it).

    FP8 runs on the compiled layer through torch (tensorwise, rowwise, delayed) or on Transformer Engine's layer
    through megatron's fp8 config (tensorwise, delayed), never on megatron's stock local layer (its FP8 is a
    silent no-op without TE); in bf16, with every GEMM dimension a multiple of 16 (FP8 GEMMs need it).
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if t.fp8 == "off":
        return []
    out = []
    if t.precision != "bf16":
        out.append(("train.fp8", f"FP8 GEMMs train under bf16 (precision is {t.precision})", "set precision: bf16, or fp8: off"))
    choice = choose(cfg)
    impl = _fp8_impl(choice.layer, choice.attention)
    if not impl:
        out.append(("train.fp8", f"FP8 GEMMs run on the compiled layer or on Transformer Engine's; this config uses neither "
                                 f"({choice.layer_reason})", "remove what keeps the layer stock, or set fp8: off"))
    elif t.fp8 not in FP8_RECIPES[impl]:
        where = "the compiled layer (torch)" if impl == "torch" else "Transformer Engine's layer"
        other = "attention_backend: te with TE installed" if impl == "torch" else "the compiled layer"
        out.append(("train.fp8", f"the '{t.fp8}' recipe does not run on {where}, which this config uses",
                    f"use one of {', '.join(FP8_RECIPES[impl])}, or {other} for '{t.fp8}', or fp8: off"))
    if impl == "te" and t.fp8 == "tensorwise" and _te_version() < (2, 2):
        out.append(("train.fp8", "Transformer Engine's current (tensorwise) scaling needs transformer-engine >= 2.2",
                    "bash launch/install_te.sh (2.20.2), or fp8: delayed"))
    tp = max(1, p.tensor_parallel)
    kv, groups = m.head_dim, m.query_groups
    dims = {"model.hidden_size": m.hidden_size,
            "model.ffn_hidden_size (fc1 output per TP rank)": m.ffn_size * (2 if m.gated_mlp else 1) // tp,
            "model.ffn_hidden_size (per TP rank)": m.ffn_size // tp,
            "model.kv_channels x heads (per TP rank)": kv * m.num_attention_heads // tp,
            "QKV width kv_channels x (heads + 2 x query groups) (per TP rank)": kv * (m.num_attention_heads + 2 * groups) // tp,
            "model.seq_length / parallel.context_parallel x train.micro_batch_size (tokens per GEMM)":
                m.seq_length // max(1, int(getattr(p, "context_parallel", 1) or 1)) * t.micro_batch_size,
            "decoder sequence length x train.micro_batch_size (tokens per decoder GEMM)": m.decoder_seq * t.micro_batch_size}
    bad = [f"{name} = {v}" for name, v in dims.items() if v % 16]
    if bad:
        out.append(("train.fp8", f"FP8 GEMMs need sizes that are multiples of 16: {', '.join(bad)}",
                    "use sizes that are multiples of 16, or fp8: off"))
    return out


def _tp_sp_rules(cfg: Any, field: str, tp_rule: str, sp_rule: str) -> list[tuple[str, str]]:
    """``(rule, fix)`` where a TP-overlap field (``parallel.<field>``) lacks what it overlaps: TP > 1, and
    sequence parallelism's all-gather / reduce-scatter."""
    out = []
    if cfg.parallel.tensor_parallel < 2:
        out.append((f"{tp_rule}; tensor_parallel is 1", f"set tensor_parallel >= 2, or {field}: false"))
    if not cfg.parallel.sequence_parallel:
        out.append((sp_rule, f"set sequence_parallel: true, or {field}: false"))
    return out


def _userbuffer_rules(cfg: Any, attention: str) -> list[tuple[str, str]]:
    """``(rule, fix)`` for each reason ``parallel.te_userbuffers`` cannot run with this config on ``attention``
    (the one predicate :func:`choose` and :func:`userbuffer_problems` share)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = _tp_sp_rules(cfg, "te_userbuffers", "TE's userbuffers overlap tensor-parallel communication",
                       "TE's userbuffers overlap sequence parallelism's all-gather / reduce-scatter (megatron refuses "
                       "tp_comm_overlap without it)")
    if p.device != "cuda":
        out.append(("TE's userbuffers need GPUs", "set te_userbuffers: false on device: cpu"))
    if t.precision == "fp32":
        out.append(("TE's userbuffers carry bf16 / fp16 activations (precision is fp32)",
                    "set precision: bf16, or te_userbuffers: false"))
    if attention != "te":
        out.append((f"TE's userbuffers run on Transformer Engine's layer; attention_backend resolves to {attention}",
                    "set attention_backend: te, or te_userbuffers: false"))
    family = FAMILIES.get(m.arch)
    if family is not None and family.supports.te_userbuffers_blocker:
        out.append((family.supports.te_userbuffers_blocker, "set te_userbuffers: false"))
    if _te_version() < (2, 7):
        out.append(("TE's userbuffers need transformer-engine >= 2.7 (its UserBufferQuantizationMode)",
                    "bash launch/install_te.sh (2.20.2), or te_userbuffers: false"))
    return out


def _async_tp_rules(cfg: Any) -> list[tuple[str, str]]:
    """``(rule, fix)`` for each reason ``parallel.async_tp`` cannot run with this config (:func:`choose` and
    :func:`async_tp_problems` share it); the layer itself is judged by :func:`choose`."""
    p, t = cfg.parallel, cfg.train
    out = _tp_sp_rules(cfg, "async_tp", "async TP pipelines tensor-parallel collectives",
                       "async TP splits sequence parallelism's all-gather / reduce-scatter with their GEMMs")
    if p.device != "cuda":
        out.append(("async TP runs on symmetric GPU memory", "set async_tp: false on device: cpu"))
    if t.fp8 != "off":
        out.append(("async TP with FP8 GEMMs is not supported here", "set fp8: off, or async_tp: false"))
    if not t.compile_kernels:
        out.append(("async TP is a pass of the compiled layer's graph (train.compile_kernels is off)",
                    "set compile_kernels: true, or async_tp: false"))
    return out


def _chunked_rules(cfg: Any) -> list[tuple[str, str]]:
    """``(rule, fix)`` for each reason ``parallel.tp_chunked`` cannot run with this config (:func:`choose` and
    :func:`chunked_problems` share it); the layer itself is judged by :func:`choose`."""
    p, t = cfg.parallel, cfg.train
    out = _tp_sp_rules(cfg, "tp_chunked", "tp_chunked splits tensor-parallel collectives",
                       "tp_chunked splits sequence parallelism's all-gather / reduce-scatter with their GEMMs")
    if p.tensor_parallel > 2:
        out.append((f"tp_chunked exchanges with one peer: tensor_parallel is {p.tensor_parallel}",
                    "set tensor_parallel: 2, or tp_chunked: false"))
    if t.fp8 != "off":
        out.append(("tp_chunked runs bf16 / fp32 GEMMs (fp8 is on)", "set fp8: off, or tp_chunked: false"))
    if p.async_tp:
        out.append(("tp_chunked and async_tp both split the same collectives", "set one of them false"))
    return out


def _compiled_layer_field_problems(cfg: Any, field: str, what: str, rules: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """``(field, rule, fix)`` for a compiled-layer TP option ``parallel.<field>`` that is on: its ``rules``, else a
    layer the kernel rule keeps stock (attention backend, family), with that reason."""
    out = [(f"parallel.{field}", rule, fix) for rule, fix in rules]
    if not out and (k := choose(cfg)).layer != "compiled":
        out.append((f"parallel.{field}", f"{what} runs on the compiled layer; this run's layer is stock ({k.layer_reason})",
                    f"set {field}: false"))
    return out


def chunked_problems(cfg: Any) -> list[tuple[str, str, str]]:
    """``(field, rule, fix)`` where ``parallel.tp_chunked`` cannot run (config validation calls it): TP = 2, sequence
    parallelism, no FP8, no async TP, the compiled layer."""
    if not cfg.parallel.tp_chunked:
        return []
    return _compiled_layer_field_problems(cfg, "tp_chunked", "tp_chunked", _chunked_rules(cfg))


def async_tp_problems(cfg: Any) -> list[tuple[str, str, str]]:
    """``(field, rule, fix)`` where ``parallel.async_tp`` cannot run (config validation calls it): TP > 1, sequence
    parallelism, CUDA, bf16 or fp32 GEMMs, the compiled layer; a layer the kernel rule keeps stock (attention
    backend, family) is refused too, with that reason."""
    if not cfg.parallel.async_tp:
        return []
    return _compiled_layer_field_problems(cfg, "async_tp", "async TP", _async_tp_rules(cfg))


def userbuffer_problems(cfg: Any) -> list[tuple[str, str, str]]:
    """``(field, rule, fix)`` where ``parallel.te_userbuffers`` cannot run (config validation calls it).

    TE's userbuffers overlap the TP all-gather / reduce-scatter of sequence parallelism with TE's GEMMs
    (megatron's ``tp_comm_overlap``; TE's ``initialize_ub``): they need TE's layer, TP > 1, sequence
    parallelism, CUDA and bf16 / fp16.  The layer is judged as on a machine with TE (the config's own question);
    whether TE is usable where it runs is the machine's (``launch.launch_problems``).
    """
    if not cfg.parallel.te_userbuffers:
        return []
    return [("parallel.te_userbuffers", rule, fix) for rule, fix in _userbuffer_rules(cfg, choose(cfg, te=True).attention)]
