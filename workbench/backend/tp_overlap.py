"""TP comm overlap, one per layer kind (:attr:`workbench.kernel_rule.KernelChoice.tp_overlap`).

- The compiled layer (``parallel.tp_comm_overlap``): an inductor post-grad pass that moves each backward
  graph's weight-gradient GEMMs under the next collective (used by :func:`workbench.backend.compiled_layer._compiled`).
- The compiled layer's chunked GEMMs (``parallel.tp_chunked``, :mod:`workbench.backend.tp_chunked`): a post-grad pass
  that moves each exchange's wait to its first use, so the GEMM written between them runs under it.
- Transformer Engine's layer (``parallel.te_userbuffers``): TE's userbuffers, set up once per training process
  (:func:`initialize_userbuffers`, Megatron-LM's ``_initialize_tp_communicators``) for megatron's
  ``tp_comm_overlap`` (``model.training_step_fields``), and freed at teardown.
"""

from __future__ import annotations

from typing import Any, Optional

from workbench import kernel_rule

__all__ = ["enable_async_tp", "sink_weight_gradients", "tp_overlap_pass", "sink_exchange_waits", "chunked_pass", "initialize_userbuffers",
           "destroy_userbuffers"]

_VIEW_OPS = ("view", "_unsafe_view", "reshape", "permute", "t", "transpose")
#: the GEMMs a weight gradient can be: bf16 (``mm``) or FP8 (``_scaled_mm``, train.fp8)
_GEMMS = ("mm", "_scaled_mm")
_COLLECTIVE_STARTS = ("all_reduce", "all_reduce_", "reduce_scatter_tensor", "all_gather_into_tensor")


def _op_name(node: Any) -> Optional[str]:
    """``"mm"`` for ``aten.mm.default``, ``"all_reduce_"`` for the in-place functional all-reduce,
    ...; None for anything that is not an aten / functional-collective call."""
    target = getattr(node, "target", None)
    packet = getattr(target, "_overloadpacket", None)
    if node.op != "call_function" or packet is None or getattr(target, "namespace", None) not in ("aten", "_c10d_functional"):
        return None
    return packet.__name__


def _weight_gradient_chain(mm: Any) -> Optional[list]:
    """``[mm, its views...]`` when the GEMM ``mm``'s result only leaves the graph (through views):
    a weight gradient, which nothing else in the backward waits for.  Else None."""
    chain, stack = [mm], list(mm.users)
    while stack:
        user = stack.pop()
        if user.op == "output":
            continue
        if _op_name(user) not in _VIEW_OPS:
            return None
        chain.append(user)
        stack.extend(user.users)
    return chain


def sink_weight_gradients(graph: Any) -> int:
    """Move each backward graph's weight-gradient GEMMs to just after the next collective's start.

    Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` does this by hand: the
    column-parallel input gradient's all-reduce (reduce-scatter under SP) is launched, the
    weight gradient is computed while it is in flight, then it is waited on.  Autograd puts
    the wgrad GEMMs before the collective and inductor's peak-memory reordering moves them to
    the end of the graph, so by default every TP collective in backward is exposed.  After
    this pass the layer's backward reads ``dgrad fc1, all-reduce, wgrad fc2, wgrad fc1, wait``
    and ``dgrad qkv, all-reduce, wgrad proj, wgrad qkv, wait`` (tests/backend/test_compiled_layer.py checks
    inductor's generated code).  Forward graphs (no ``tangents`` inputs) are left alone.
    Returns the number of GEMMs moved.
    """
    nodes = list(graph.nodes)
    if not any(n.op == "placeholder" and n.name.startswith("tangents") for n in nodes):
        return 0
    order = {n: i for i, n in enumerate(nodes)}
    moved, pending = 0, []
    for node in nodes:
        name = _op_name(node)
        if name in _GEMMS and (chain := _weight_gradient_chain(node)) is not None:
            pending.append(chain)
        elif name in _COLLECTIVE_STARTS and pending:
            anchor = node
            for chain in pending:
                for piece in sorted(chain, key=order.__getitem__):
                    anchor.append(piece)
                    anchor = piece
            moved += len(pending)
            pending = []
    if moved:
        graph.lint()
    return moved


def sink_exchange_waits(graph: Any) -> int:
    """Start each all-to-all of a backward graph (:mod:`workbench.backend.tp_chunked`'s exchanges) as early as its input
    allows, and wait for every all-to-all just before the first node that uses its result.  Traced, a functional collective is waited at once, and the
    partitioner may put the GEMM meant to run under it first; after this pass the exchange's input chain comes as
    early as its own inputs allow, then the exchange, then everything independent of it, then its wait.  Other
    collectives are left alone.  Returns the number of exchanges placed."""
    placed = 0
    backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
    for node in list(graph.nodes):
        if _op_name(node) != "all_to_all_single":
            continue
        if backward:  # (forward: the traced order already starts each exchange before the GEMM that runs under it)
            _hoist(graph, node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for wait in [u for u in node.users if _op_name(u) == "wait_tensor"]:
            first = min(wait.users, key=order.__getitem__, default=None)
            if first is not None:
                first.prepend(wait)
        placed += 1
    if placed:
        graph.lint()
    return placed


def _hoist(graph: Any, node: Any) -> None:
    """Move ``node`` and the ancestors it needs to just after their latest input, earliest first (a placeholder or
    anything else without inputs stays where it is)."""
    needed, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in needed or n.op != "call_function":
            continue
        needed.add(n)
        stack.extend(a for a in n.all_input_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(needed, key=order.__getitem__):
        inputs = n.all_input_nodes
        if not inputs:
            continue
        order = {m: i for i, m in enumerate(graph.nodes)}
        latest = max(inputs, key=order.__getitem__)
        if order[latest] + 1 < order[n]:
            latest.append(n)


def _custom_pass(fn: Any, uuid: str) -> Any:
    """``fn(graph)`` as an inductor post-grad custom pass whose cache key is ``uuid``."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            fn(graph)

        def uuid(self) -> str:
            return uuid

    return _Pass()


def chunked_pass() -> Any:
    """:func:`sink_exchange_waits` as inductor's post-grad custom pass."""
    return _custom_pass(sink_exchange_waits, "workbench.sink_exchange_waits.v2")


def tp_overlap_pass() -> Any:
    """:func:`sink_weight_gradients` as inductor's post-grad custom pass."""
    return _custom_pass(sink_weight_gradients, "workbench.sink_weight_gradients.v1")


_UB_LIVE = False


def initialize_userbuffers(cfg: Any, kernels: Any = None) -> Optional[str]:
    """TE's userbuffers for the training step, where the kernel rule runs them; a line for the kernel path
    (None where it does not).  Every rank calls it, after megatron's groups exist and before the model is
    built: TE bootstraps its communicators over NCCL (``bootstrap_backend``; no MPI needed) across the world.

    One buffer shape for every TE linear of the TP layers, ``(seq_length x micro_batch_size, hidden)`` (the
    full sequence: TE gathers into it), in the training precision, plus FP8 buffers where TE runs FP8.
    Evaluation uses the training micro-batch, so the same buffers serve it; generation builds without
    ``tp_comm_overlap`` and never touches them.  With ``UB_SKIPMC=1`` (:func:`workbench.config.rank_environment`)
    TE exchanges through CUDA IPC instead of NVLink multicast.
    """
    global _UB_LIVE
    choice = kernels or kernel_rule.choose(cfg)  # kernels: the trainer's decision
    if choice.tp_overlap != "userbuffers":
        return None
    import os

    import torch
    from transformer_engine.pytorch.module import base as te_base

    m, p, t = cfg.model, cfg.parallel, cfg.train
    shape = [m.seq_length * t.micro_batch_size, m.hidden_size]
    dtype = torch.float16 if t.precision == "fp16" else torch.bfloat16
    modes = [te_base.UserBufferQuantizationMode.FP8 if choice.fp8_impl == "te" else te_base.UserBufferQuantizationMode.NONE]
    _UB_LIVE = True  # before the call: TE registers its communicators as it goes, and teardown must free a partial set
    te_base.initialize_ub(shape=shape, tp_size=p.tensor_parallel, quantization_modes=modes, dtype=dtype,
                          bootstrap_backend="nccl")
    ipc = ", CUDA IPC (UB_SKIPMC=1)" if os.environ.get("UB_SKIPMC") == "1" else ""
    return (f"buffers {shape[0]} x {shape[1]} ({'FP8' if choice.fp8_impl == 'te' else str(dtype).removeprefix('torch.')}), "
            f"TP {p.tensor_parallel}{ipc}")


def destroy_userbuffers() -> None:
    """Free TE's userbuffer communicators (idempotent; never raises: teardown of a failed run)."""
    global _UB_LIVE
    if not _UB_LIVE:
        return
    _UB_LIVE = False
    try:
        from transformer_engine.pytorch.module import base as te_base

        te_base.destroy_ub()
    except Exception:
        pass


def enable_async_tp(group_name: str) -> None:
    """Symmetric memory for the TP group ``group_name`` (what inductor's micro-pipeline TP pass asks for before it
    fuses a collective with its GEMM); idempotent.  NVLink multicast is never asked for (the fused ops copy through
    the copy engines; hosts that share GPUs keep ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``)."""
    import warnings

    from torch.distributed import _symmetric_memory as symm_mem

    if not symm_mem.is_symm_mem_enabled_for_group(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch >= 2.12 deprecates the call; 2.11 needs it
            symm_mem.enable_symm_mem_for_group(group_name)
