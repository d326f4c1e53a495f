"""The committed benchmark rows the advisor is calibrated and judged on.

The repository's throughput benchmarks (``bench/results/train_throughput.jsonl``,
``bench/results/layouts/*.jsonl``, and what ``tests/gpu_proofs/advisor_measure.py`` writes under
``evidence/advisor/``) hold one JSON line per measured layout with device, date and commit.
:func:`measured_rows` reads them and keeps the rows that measure the workbench as it trains now
(:data:`VARIANTS`: the default path, TP / SP / PP / DP / recompute / FP8 / eager layouts; the newest
row per device and variant), saying why each other row is left out.  :func:`row_config` rebuilds the
config a row trained (``bench/variants.py``'s ``bench_config``: the preset, its sequence,
bf16, synthetic data, the row's batch and overrides).  Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, RunConfig, preset

__all__ = ["MeasuredRow", "VARIANTS", "measured_rows", "row_config", "device_gpu", "REPO", "read_row", "fp8_measured_faster"]

REPO = Path(__file__).resolve().parents[2]
ROW_FILES = ("bench/results/train_throughput.jsonl", "bench/results/train_throughput_fp8.jsonl",
             "bench/results/train_throughput_te_present.jsonl", "bench/results/layouts/*.jsonl", "evidence/advisor/*.jsonl")
#: files of which only some variants are today's path: file name -> variant-name prefixes kept
ONLY = {"train_throughput_te_present.jsonl": ("workbench-fp8-",)}  # with TE importable; its FP8 rows are torch's (GPT-2 medium)

#: variant names (before "/model") whose rows measure a layout of today's training path
VARIANTS = ("workbench", "workbench-nograph", "workbench-eager", "recompute-selective", "recompute-full",
            "workbench-fp8-tensorwise", "workbench-fp8-rowwise", "workbench-fp8-delayed",
            "dp2", "dp2-distopt", "tp2", "tp2-sp", "tp2-no-overlap", "tp2-sp-no-overlap", "tp2-nograph",
            "pp1-m8", "pp2-m8", "pp2-vpp2-m8", "pp2-m8-nograph", "advisor",
            "workbench-16k", "workbench-32k", "cp2-16k", "cp2-32k")

#: rows measured while something else held the GPUs: (file name, line) -> why
CONTAMINATED = {
    ("call3_dc9a31f_partial.jsonl", i): "ran after the PP=2 phase hung; its ranks still held the GPUs (a02521c)"
    for i in (1, 2, 3, 4)
}

#: rows whose path has changed since they were measured: (file name, line) -> why
STALE = {
    ("train_throughput.jsonl", 39): "TP=2 without graphs at b666c9c, before TP layers became one compiled graph with their "
                                    "collectives (tp2 then: 75k tok/s; now 121k)",
    ("train_throughput.jsonl", 4): "first-day eager row (261d7bd), before the fused optimizer and gradient-accumulation kernels",
    ("train_throughput.jsonl", 6): "first-day eager row (261d7bd), before the fused optimizer and gradient-accumulation kernels",
}

#: overrides of settings that no longer exist (the row measured a path that is gone)
RETIRED = ("train.tp_collectives_in_graph", "train.tp_overlap_batch_halves", "parallel.tp_allreduce",
           "train.gradient_accumulation_fusion")


@dataclass
class MeasuredRow:
    source: str  # file:line
    device: str
    gpu: str  # planner GPU name
    date: str
    git_commit: str
    variant: str
    model: str
    gpus: int
    tokens_per_s: float
    config: RunConfig


def device_gpu(device: str) -> str | None:
    """Planner GPU name of a CUDA device name (None when the advisor ships no profile for it)."""
    d = device.upper()
    return "H200-141GB" if "H200" in d else "H100-80GB" if "H100" in d else None


def row_config(row: dict[str, Any]) -> RunConfig:
    """The config a benchmark row trained: ``bench/variants.py``'s ``bench_config`` for the row's model,
    batch, GPUs and overrides."""
    over = {"model.seq_length": int(row["seq_length"]), "train.precision": "bf16", "parallel.device": "cuda",
            "train.micro_batch_size": int(row["micro_batch_size"]), "train.global_batch_size": int(row["global_batch_size"]),
            "train.eval_interval": 0, "train.train_iters": 10_000, "train.lr_warmup_iters": 0,
            "train.lr_decay_style": "constant", "parallel.nproc_per_node": int(row["gpus"]),
            "data.source": "synthetic", "checkpoint.save_on_exit": False}
    over.update(row.get("overrides") or {})
    return preset(row["model"]).replace(**over)


def _why_not(row: dict[str, Any], fname: str, line: int) -> str | None:
    if (fname, line) in CONTAMINATED:
        return CONTAMINATED[(fname, line)]
    if (fname, line) in STALE:
        return STALE[(fname, line)]
    if row.get("kind") != "workbench" and row.get("kind") != "advisor":
        return "not the workbench (reference)"
    if not row.get("ok"):
        return "failed"
    if row.get("cpu_smoke"):
        return "CPU smoke"
    if row.get("bound"):
        return "diagnostic bound (not the maths)"
    if row.get("env"):
        return f"launch environment changed ({', '.join(row['env'])})"
    name = str(row.get("variant", "")).split("/")[0]
    if fname in ONLY and not name.startswith(ONLY[fname]):
        return f"only the {', '.join(ONLY[fname])} rows of {fname} are used"
    if name not in VARIANTS:
        return f"variant {name!r} is not a layout of today's path"
    over = row.get("overrides") or {}
    gone = [k for k in over if k in RETIRED or (k == "parallel.tp_comm_overlap" and isinstance(over[k], str))]
    if gone:
        return f"retired setting {gone[0]}"
    if device_gpu(str(row.get("device", ""))) is None:
        return f"no profile for {row.get('device')}"
    return None


def measured_rows(root: str | Path = REPO, newest: bool = True) -> tuple[list[MeasuredRow], list[tuple[str, str]]]:
    """(rows kept, [(source, why left out)]): the newest row per (device, variant) of the benchmark files."""
    root = Path(root)
    kept: dict[tuple[str, str], MeasuredRow] = {}
    left: list[tuple[str, str]] = []
    for pattern in ROW_FILES:
        for path in sorted(root.glob(pattern)):
            for i, line in enumerate(path.read_text().splitlines()):
                src = f"{path.relative_to(root)}:{i + 1}"
                try:
                    row = json.loads(line)
                except ValueError:
                    left.append((src, "not JSON"))
                    continue
                why = _why_not(row, path.name, i)
                if why:
                    left.append((src, why))
                    continue
                r = MeasuredRow(src, row["device"], device_gpu(row["device"]), row["date"], str(row.get("git_commit", ""))[:10],
                                row["variant"], row["model"], int(row["gpus"]), float(row["tokens_per_s"]), row_config(row))
                key = (r.gpu, r.variant)
                if newest and key in kept and kept[key].date > r.date:
                    left.append((src, f"older than {kept[key].source}"))
                    continue
                if newest and key in kept:
                    left.append((kept[key].source, f"older than {src}"))
                kept[key] = r
    return sorted(kept.values(), key=lambda r: (r.gpu, r.variant)), left


def read_row(ref: str, root: str | Path = REPO) -> dict[str, Any]:
    """The JSON row at ``file:line`` (1-based) under ``root``."""
    path, line = ref.rsplit(":", 1)
    return json.loads((Path(root) / path).read_text().splitlines()[int(line) - 1])


def _same_model(a: RunConfig, b: RunConfig) -> bool:
    """The same model (every model field but the sequence, which a benchmark row sets)."""
    def key(m: Any) -> Any:
        return dataclasses.replace(m, seq_length=0, max_position_embeddings=0)

    return key(a.model) == key(b.model)


@functools.lru_cache(maxsize=4)
def _bf16_and_fp8_rows(root: str) -> tuple[tuple[str, str, str, float, str], ...]:
    """(gpu, variant, model, tokens/s, file:line) of the newest kept default and FP8 rows per (gpu, variant): what
    :func:`measured_rows` keeps of those variants, without rebuilding every row's config."""
    newest: dict[tuple[str, str], tuple[str, tuple[str, str, str, float, str]]] = {}
    for pattern in ROW_FILES:
        for path in sorted(Path(root).glob(pattern)):
            for i, line in enumerate(path.read_text().splitlines()):
                if '"workbench' not in line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                name = str(row.get("variant", "")).split("/")[0]
                if not (name == "workbench" or name.startswith("workbench-fp8-")) or _why_not(row, path.name, i):
                    continue
                gpu = device_gpu(row["device"])
                key = (gpu, row["variant"])
                if key not in newest or newest[key][0] <= row["date"]:
                    newest[key] = (row["date"], (gpu, name, row["model"], float(row["tokens_per_s"]),
                                                 f"{path.relative_to(root)}:{i + 1}"))
    return tuple(v for _, v in newest.values())


def fp8_measured_faster(cfg: RunConfig, gpu: str, root: str | Path = REPO) -> tuple[bool, str]:
    """Whether committed rows measured an FP8 recipe faster than bf16 for this config's model on ``gpu``, and why:
    the advisor lists FP8 layouts by default only then (FP8 is slower than bf16 below hidden 2048 in the rows)."""
    rows = [r for r in _bf16_and_fp8_rows(str(root)) if r[0] == gpu]
    for model in sorted({r[2] for r in rows}):
        try:
            same = _same_model(cfg, preset(model))
        except ConfigError:  # a row of a preset that no longer exists
            same = False
        if not same:
            continue
        bf16 = next((r for r in rows if r[2] == model and r[1] == "workbench"), None)
        fp8 = max((r for r in rows if r[2] == model and r[1] != "workbench"), key=lambda r: r[3], default=None)
        if bf16 is None or fp8 is None:
            return False, f"{model} on {gpu} has no measured pair of bf16 and FP8 rows"
        faster = fp8[3] > bf16[3]
        return faster, (f"{model} on {gpu}: {fp8[1].removeprefix('workbench-')} {fp8[3]:,.0f} tok/s ({fp8[4]}) vs bf16 "
                        f"{bf16[3]:,.0f} ({bf16[4]})")
    return False, f"no committed FP8 measurement of this model on {gpu}"
