"""Import an HF Accelerate config (its ``megatron_lm_config`` section) as a workbench RunConfig.

The reference guide configures Megatron-LM through ``accelerate config``; this maps that file onto
the typed run config (``workbench config from-accelerate ACC.yaml -o FILE``).
"""

from __future__ import annotations

from pathlib import Path

from workbench.config import ConfigError, Problem, RunConfig
from workbench.config import did_you_mean as closest
from workbench.config_text import ConfigTextError, read_config_file
from workbench.layout import Layout

__all__ = ["from_accelerate"]


def from_accelerate(path_or_dict: str | Path | dict, base: RunConfig | None = None) -> RunConfig:
    """Convert an Accelerate config (with a ``megatron_lm_config`` section) into a workbench config.

    Mapping: tp/pp degree, micro-batch count (-> global batch = micro * mbs * dp), sequence
    parallelism, recompute_activations (-> selective), distributed optimizer, gradient
    clipping, mixed precision, num_processes / num_machines.
    """
    if isinstance(path_or_dict, dict):
        acc, source = path_or_dict, "<dict>"
    else:
        source = str(path_or_dict)
        try:  # strict: duplicate keys, alias bombs, empty or non-UTF-8 files are refused
            acc = read_config_file(path_or_dict)
        except ConfigTextError as e:
            raise ConfigError([Problem(source, e.rule, e.fix)]) from None
    mlm = acc.get("megatron_lm_config") if isinstance(acc, dict) else None
    if not isinstance(mlm, dict):
        raise ConfigError([Problem("megatron_lm_config", "missing from the Accelerate config", "run `accelerate config` and answer yes to Megatron-LM")], source)
    known = {
        "megatron_lm_gradient_clipping", "megatron_lm_num_micro_batches", "megatron_lm_pp_degree",
        "megatron_lm_recompute_activations", "megatron_lm_sequence_parallelism", "megatron_lm_tp_degree",
        "megatron_lm_use_distributed_optimizer",
    }
    unknown = [k for k in mlm if k not in known]
    if unknown:
        raise ConfigError([Problem(f"megatron_lm_config.{k}", "not understood by the importer", closest(k, sorted(known))) for k in unknown], source)
    cfg = base or RunConfig()
    d = cfg.to_dict()
    par, tr = d["parallel"], d["train"]
    par["tensor_parallel"] = int(mlm.get("megatron_lm_tp_degree", 1))
    par["pipeline_parallel"] = int(mlm.get("megatron_lm_pp_degree", 1))
    par["sequence_parallel"] = bool(mlm.get("megatron_lm_sequence_parallelism", False))
    par["distributed_optimizer"] = bool(mlm.get("megatron_lm_use_distributed_optimizer", False))
    par["recompute"] = "selective" if mlm.get("megatron_lm_recompute_activations") else "none"
    machines = int(acc.get("num_machines", 1) or 1)
    procs = int(acc.get("num_processes", 1) or 1)
    par["nnodes"] = machines
    par["nproc_per_node"] = max(procs // machines, 1)
    par["device"] = "cpu" if acc.get("use_cpu") else "cuda"
    tr["clip_grad"] = float(mlm.get("megatron_lm_gradient_clipping", 1.0))
    mp = acc.get("mixed_precision", "no")
    tr["precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(str(mp), "fp32")
    micro = int(mlm.get("megatron_lm_num_micro_batches", 1))
    dp = Layout(world=procs, tp=par["tensor_parallel"], pp=par["pipeline_parallel"]).dp
    tr["global_batch_size"] = micro * tr["micro_batch_size"] * dp
    return RunConfig.from_dict(d, source)
