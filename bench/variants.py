"""The throughput benchmark's models and variants, and the RunConfig each variant trains.

Shared by ``bench/train_throughput.py`` (which plans the variants, launches and reports them) and the references it
launches (``bench/reference_fsdp2.py``, ``bench/reference_torchtitan.py``), so those need not import the benchmark:
``MODELS`` (model -> micro-batch), ``SEQ_LENGTH``, ``TINY_LLAMA`` (``--cpu-smoke``'s tiny Llama), :func:`is_llama`,
:class:`Variant` (one benchmark row) and :func:`bench_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

#: model -> micro-batch size (the issue's anchors: GPT-2 small mbs 16, medium mbs 8).  Llama rows
#: (seq 2048, 4 micro-batches) are sized for an 80 GB H100, reference and workbench alike: weights,
#: grads and AdamW state take 16 bytes/param in the reference and 18 in the workbench (its bf16
#: copy), i.e. 20 / 22 GB for 1B and 51 / 58 GB for 3B; the rest is activations and the
#: [mbs, 2048, 128256] logits.  The planner (H100-80GB, this config) predicts 39.5 GiB for 1B at
#: mbs 4 (largest that fits: 12) and 70.7 GiB for 3B at mbs 2 (largest: 3; mbs 4 = 86.9 GiB, OOM).
#: 1B at 4 is a conservative start (8 would be 58 GiB by the planner).  Measured on an H100 (session 10):
#: 1B 24.7 GiB allocated / 35.7 reserved, 3B 55.9 / 67.4 (reference 67.5 / 75.9).
MODELS = {"gpt2-small": 16, "gpt2-medium": 8, "gpt2-large": 8, "llama3.2-1b": 4, "llama3.2-3b": 2, "llama3.1-8b": 1}
#: sequence length per model (GPT-2's 1024 unless named)
SEQ_LENGTH = {"llama3.2-1b": 2048, "llama3.2-3b": 2048, "llama3.1-8b": 2048}
#: --cpu-smoke: the tiny stand-in of each model's architecture (a Llama model smokes the Llama reference)
TINY_LLAMA = {"model.position_embedding": "rope", "model.normalization": "rmsnorm", "model.activation": "swiglu",
              "model.attention_type": "grouped", "model.num_query_groups": 2, "model.add_bias_linear": False}


def is_llama(model: str) -> bool:
    return model.startswith(("llama", "tiny-llama"))


@dataclass
class Variant:
    """One benchmark row: what to build and how many GPUs it takes."""

    name: str
    kind: str  # "reference" | "workbench" | "fsdp2" (bench/reference_fsdp2.py) | "torchtitan" (bench/reference_torchtitan.py)
    model: str
    gpus: int = 1
    microbatches: int = 4  # per data-parallel rank and step
    overrides: dict[str, Any] = field(default_factory=dict)  # dotted RunConfig overrides
    baseline: Optional[str] = None  # row this one is compared against (scaling), same model
    #: the yardstick row of ``vs ref`` (``ratio_to_reference``) when it is not ``reference/<model>``
    reference: Optional[str] = None
    env: dict[str, str] = field(default_factory=dict)  # launch environment on top of ours
    #: "no-tp-comm": a diagnostic bound, not the model's maths: the compiled layer's TP
    #: collectives are skipped, so the row shows what TP=2 would give with free communication
    bound: Optional[str] = None


def bench_config(v: Variant, cpu_smoke: bool = False):
    """The RunConfig a variant trains (the reference reads the same config)."""
    from workbench.config import preset

    if cpu_smoke:
        cfg = preset("tiny", **(TINY_LLAMA if is_llama(v.model) else {}))
        mbs = cfg.train.micro_batch_size
        over = {"train.compile_kernels": False}
    else:
        cfg = preset(v.model)
        mbs = int(v.overrides.get("train.micro_batch_size", MODELS[v.model]))
        over = {"model.seq_length": SEQ_LENGTH.get(v.model, 1024), "train.precision": "bf16", "parallel.device": "cuda"}
    tp = int(v.overrides.get("parallel.tensor_parallel", 1))
    pp = int(v.overrides.get("parallel.pipeline_parallel", 1))
    cp = int(v.overrides.get("parallel.context_parallel", 1))
    dp = max(v.gpus // (tp * pp * cp), 1)
    over.update({
        "train.micro_batch_size": mbs,
        "train.global_batch_size": mbs * dp * v.microbatches,
        "train.eval_interval": 0,
        "train.train_iters": 10_000,
        "train.lr_warmup_iters": 0,
        "train.lr_decay_style": "constant",
        "parallel.nproc_per_node": v.gpus,
        "data.source": "synthetic",
        "checkpoint.save_on_exit": False,
    })
    over.update({k: val for k, val in v.overrides.items()})
    return cfg.replace(**over)
