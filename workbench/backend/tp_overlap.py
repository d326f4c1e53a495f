"""TP comm overlap for the compiled layer: an inductor post-grad pass that moves each backward graph's
weight-gradient GEMMs under the next collective (``parallel.tp_comm_overlap``; used by
:func:`workbench.backend.fusions._compiled`)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["sink_weight_gradients", "tp_overlap_pass"]

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
    and ``dgrad qkv, all-reduce, wgrad proj, wgrad qkv, wait`` (tests/test_fusions.py checks
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


def tp_overlap_pass() -> Any:
    """:func:`sink_weight_gradients` as inductor's post-grad custom pass (with a cache key)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _SinkWeightGradients(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            sink_weight_gradients(graph)

        def uuid(self) -> str:
            return "workbench.sink_weight_gradients.v1"

    return _SinkWeightGradients()
