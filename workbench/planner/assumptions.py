"""What the planner cannot read from a config (:class:`PlannerAssumptions`) and the kernels a plan assumes
(:func:`kernel_path`: the backend's own kernel rule, optionally pinned for what-if plans)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from workbench import kernel_rule
from workbench.config import RunConfig
from workbench.kernel_rule import KernelChoice
from workbench.planner.gpus import MiB

__all__ = ["PlannerAssumptions", "KernelPath", "kernel_path"]


@dataclass
class PlannerAssumptions:
    """Everything the planner cannot read from the config, with the reasoning for each default.

    Allocated (counted by ``torch.cuda.max_memory_allocated``):

    * ``cublas_workspace_bytes``: cuBLAS / cuBLASLt workspaces come from the caching
      allocator (torch sizes them 32 MiB per handle on Hopper; one stream, one handle each).
    * ``backward_overlap``: fraction of the gradients w.r.t. a layer's MLP intermediates
      (fc1 output + activation output) alive at the layer's backward peak on top of its kept
      tensors; autograd frees the MLP's saved tensors as it goes, so not all of them coexist.
      0.5 is what whole training steps of the real backend measured (CPU allocation tracker,
      ``tests/planner/test_planner_cpu_step.py``); 1.0 is the conservative bound.

    Not allocated (added for "fits"):

    * ``cuda_context_bytes``: CUDA context + kernels images of torch/NCCL (about 0.5 GiB with
      lazy module loading on CUDA 12).
    * ``nccl_bytes_per_group``: NCCL buffers per communicator this rank belongs to with more
      than one member (channels x NCCL_BUFFSIZE; ~0.1-0.3 GiB on NVLink).

    Reserved memory (what the caching allocator holds: ``max_memory_reserved``) is modelled term
    by term, not as a fraction: see :func:`workbench.planner.stage._reserved_terms`.

    * ``offload_lasting_bytes``: under optimizer CPU offload, the small allocations the first step leaves
      behind (64 MiB in 4 blocks, measured: GPT-2 small, DP=2, full offload on two H200s,
      ``evidence/planner_2gpu.jsonl``); created in a freed logits block, they strand the rest of it as
      Adam's moments do without offload.

    Kernel paths (None = what the backend picks on this machine, see :func:`kernel_path`):
    ``transformer_engine`` (TE installed where training runs), ``compiled_layer`` (the
    performance helper's compiled dense layer), ``optimizer`` ('foreach' torch AdamW keeps
    ``sqrt(v)`` of all its parameters, 'fused' kernel: no step temporaries, 'for-loop':
    torch's single-tensor AdamW off CUDA, two temporaries of the largest tensor).  ``deallocate_pipeline_outputs`` mirrors the
    backend's TransformerConfig (True on CUDA).  ``step_graph`` False: the graphed compiled layers replay one by one
    (torch's cudagraph trees) where the rule would capture the whole step (a run measured before the step graph).
    ``cuda_graphs`` False: no CUDA graphs where the rule would record some (a run measured while the rule kept them
    off, e.g. an MoE step before it was captured whole).  ``lm_head_every_position``: the LM head on every position
    of a sequence where the family's runs only the rows it needs (a run measured before BERT's masked-LM head ran on
    the masked positions only).
    """

    cublas_workspace_bytes: int = 64 * MiB
    backward_overlap: float = 0.5
    cuda_context_bytes: int = 512 * MiB
    nccl_bytes_per_group: int = 192 * MiB
    offload_lasting_bytes: int = 64 * MiB
    transformer_engine: bool | None = None
    compiled_layer: bool | None = None
    optimizer: Literal["auto", "foreach", "fused", "for-loop"] = "auto"
    deallocate_pipeline_outputs: bool = True
    step_graph: bool | None = None
    cuda_graphs: bool | None = None
    lm_head_every_position: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The kernels a plan assumes: the one kernel rule's answer (:func:`workbench.kernel_rule.choose`).
KernelPath = KernelChoice


def kernel_path(cfg: RunConfig, assumptions: PlannerAssumptions | None = None) -> KernelPath:
    """Which kernels a config trains with: :func:`workbench.kernel_rule.choose`, the backend's own rule.

    ``assumptions`` may pin Transformer Engine's presence (where training runs), the compiled
    layer or the optimizer kernel, for what-if plans and calibration runs of another path.
    """
    a = assumptions or PlannerAssumptions()
    kp = kernel_rule.choose(cfg, te=a.transformer_engine)
    if a.compiled_layer is not None and (a.compiled_layer != (kp.layer == "compiled")):
        kp = dataclasses.replace(kp, layer="compiled" if a.compiled_layer else "stock",
                                 layer_reason="" if a.compiled_layer else "pinned by PlannerAssumptions.compiled_layer",
                                 cuda_graphs_impl=kernel_rule.graphs_impl(cfg, "compiled") if kp.cuda_graphs and a.compiled_layer else "")
    if a.cuda_graphs is False and kp.cuda_graphs:
        kp = dataclasses.replace(kp, cuda_graphs_impl="", cuda_graphs_reason="pinned by PlannerAssumptions.cuda_graphs",
                                 grad_accumulation="workbench")
    if a.step_graph is False and kp.cuda_graphs_impl == "step":
        kp = dataclasses.replace(kp, cuda_graphs_impl="torch")
    if a.optimizer != "auto":
        kp = dataclasses.replace(kp, optimizer=a.optimizer)
    return kp
