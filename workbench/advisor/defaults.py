"""The numbers of the shipped H100 / H200 profiles, computed from rows the repository already holds.

Each rate is computed here from a named benchmark row (``file:line``: its torch-profiler summary
``profile.by_category_ms`` and its config, :func:`workbench.advisor.calibration.row_config`) or probe row,
so a profile says exactly where each number came from.  Numbers that no row measures are estimates and
are marked so (``estimate: true`` with the reasoning in ``source``):

* GEMM TFLOP/s = the row's dense GEMM FLOPs per GPU and step (the family's FLOPs, :func:`perf_model.flop_split`)
  over its profiled ``gemm`` milliseconds; the shape class is one forward GEMM's GFLOP.
* attention TFLOP/s = the attention FLOPs over the profiled ``attention`` milliseconds.
* optimizer ns/param = profiled ``optimizer / multi-tensor`` milliseconds over the rank's parameters.
* FP8 speed-up = profiled GEMM milliseconds of a bf16 row over those of its FP8 row (same model, commit).
* TP all-reduce bus bandwidth on H100 = a TP=2 row's profiled ``communication`` milliseconds over its
  ``4 x layers x micro-batches`` all-reduces of the ``[s, b, h]`` activation (an upper bound on time:
  it includes waits for the peer); on H200 the NCCL probe (``bench/allreduce_probe.py``).
"""

from __future__ import annotations

from typing import Any

from workbench.advisor.perf_model import flop_split
from workbench.advisor.rows import REPO, read_row, row_config

__all__ = ["default_profile_dicts", "SOURCES"]

TT = "bench/results/train_throughput.jsonl"
FP8 = "bench/results/train_throughput_fp8.jsonl"
CALL1 = "bench/results/layouts/call1_26ad672.jsonl"
PROBE = "bench/results/allreduce_probe.jsonl"

#: which rows feed which numbers (file:line, 1-based)
SOURCES = {
    "H100-80GB": {"gemm": [f"{TT}:30", f"{CALL1}:5", f"{TT}:148", f"{CALL1}:6"],
                  "attention": [f"{TT}:30", f"{TT}:148"],
                  "optimizer": [f"{TT}:30", f"{CALL1}:5", f"{TT}:148"],
                  "fp8": (f"{FP8}:2", f"{FP8}:3"), "tp_comm": f"{CALL1}:6"},
    "H200-141GB": {"gemm": [f"{TT}:89", f"{TT}:117"], "attention": [f"{TT}:89", f"{TT}:202"],
                   "optimizer": [f"{TT}:89", f"{TT}:117"], "probe": [f"{PROBE}:{i}" for i in range(1, 9)]},
}
DEVICE = {"H100-80GB": "NVIDIA H100 80GB HBM3", "H200-141GB": "NVIDIA H200"}
#: memory bandwidth: 90% of the data-sheet number (no row measures a large copy yet: `workbench calibrate` does)
MEMORY_GBS = {"H100-80GB": 0.9 * 3350, "H200-141GB": 0.9 * 4800}
PEAK_TFLOPS = 989.0  # dense bf16, SXM (the benchmarks' MFU denominator)


def _row(ref: str) -> dict[str, Any]:
    return read_row(ref, REPO)


def _pt(x: float, value: float, source: str, estimate: bool = False) -> dict[str, Any]:
    return {"x": round(x, 4), "value": round(value, 4), "source": source, "estimate": estimate}


def _profiled(ref: str) -> tuple[dict[str, Any], Any, dict[str, float]]:
    row = _row(ref)
    cfg = row_config(row)
    tp = cfg.parallel.tensor_parallel
    fl = flop_split(cfg, tp)
    tokens = row["tokens_per_step"] / max(row["dp"], 1)  # per GPU (DP splits the batch, TP the FLOPs)
    layers = cfg.model.num_layers
    per_call = fl["layer_dense"] * cfg.train.micro_batch_size * cfg.model.seq_length / tp / 3 / 4 / 1e9
    return row, cfg, {"dense": (layers * fl["layer_dense"] + fl["head_dense"]) * tokens / tp,
                      "attention": (layers * fl["layer_attn"] + fl["head_attn"]) * tokens / tp, "per_call": per_call}


def _where(ref: str, row: dict[str, Any]) -> str:
    return f"{ref} ({row['variant']}, {row['device']}, {row['date'][:10]}, {str(row['git_commit'])[:7]})"


def _rates(gpu: str) -> dict[str, Any]:
    src = SOURCES[gpu]
    gemm, attn, opt = [], [], []
    for ref in src["gemm"]:
        row, cfg, f = _profiled(ref)
        gemm.append(_pt(f["per_call"], f["dense"] / (row["profile"]["by_category_ms"]["gemm"] * 1e-3) / 1e12,
                        f"{_where(ref, row)}: dense GEMM FLOPs / profiled gemm ms"))
    for ref in src["attention"]:
        row, cfg, f = _profiled(ref)
        attn.append(_pt(cfg.model.seq_length, f["attention"] / (row["profile"]["by_category_ms"]["attention"] * 1e-3) / 1e12,
                        f"{_where(ref, row)}: attention FLOPs / profiled attention ms"))
    for ref in src["optimizer"]:
        row, cfg, _ = _profiled(ref)
        params = cfg.derived().params.total / cfg.parallel.tensor_parallel
        opt.append(row["profile"]["by_category_ms"]["optimizer / multi-tensor"] * 1e-3 / params * 1e9)
    opt_src = ", ".join(src["optimizer"])
    return {"gemm": gemm, "attention": attn,
            "optimizer": _pt(0, sum(opt) / len(opt), f"mean over {opt_src}: profiled optimizer ms / parameters per GPU")}


def _probe_curves() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list] = {"all_reduce": [], "p2p": []}
    for ref in SOURCES["H200-141GB"]["probe"]:
        row = _row(ref)
        op = {"all_reduce": "all_reduce", "sendrecv": "p2p"}[row["op"]]
        out[op].append(_pt(row["mib"] * 2**20, row["busbw_gbs"],
                           f"{ref} (bench/allreduce_probe.py, {row['device']}, {row['date'][:10]}, {row['git_commit']}, 2 GPUs)"))
    return out


def _h100_tp_point() -> tuple[float, float, str]:
    ref = SOURCES["H100-80GB"]["tp_comm"]
    row, cfg, _ = _profiled(ref)
    m = cfg.model
    calls = 4 * m.num_layers * row["microbatches"]
    nbytes = 2 * m.seq_length * cfg.train.micro_batch_size * m.hidden_size
    ms = row["profile"]["by_category_ms"]["communication"] / calls
    busbw = 2 * (2 - 1) / 2 * nbytes / (ms * 1e-3) / 1e9
    return nbytes, busbw, f"{_where(ref, row)}: profiled communication ms / {calls} all-reduces of {nbytes} bytes"


def _inter_node() -> dict[str, Any]:
    why = "estimate: 8 x 400 Gb/s InfiniBand per 8-GPU node (about 40 GB/s bus bandwidth per GPU), 20 us latency; not measured"
    return {op: _pt(20.0, 40.0 if op != "p2p" else 45.0, why, True) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}


def _host() -> dict[str, Any]:
    return {"graphs": _pt(0, 30.0, "estimate: one graph replay per layer forward and backward", True),
            "compiled": _pt(0, 600.0, "estimate: ~170 kernel launches of the compiled layer's forward + backward at ~3.5 us", True),
            "stock": _pt(0, 2500.0, "estimate: megatron's stock layer, ~300 eager ops with Python dispatch at ~8 us", True)}


def default_profile_dicts() -> dict[str, dict[str, Any]]:
    """The two shipped profiles as JSON-ready dicts (constants not fitted yet)."""
    h100, h200 = _rates("H100-80GB"), _rates("H200-141GB")
    probe = _probe_curves()
    n20, bw20, src20 = _h100_tp_point()
    h200_ar = probe["all_reduce"]
    ref20 = next(p for p in h200_ar if abs(p["x"] - 20 * 2**20) < 1)
    ratio = bw20 / ref20["value"]
    same = "estimate: the all-reduce bus bandwidth (nccl-tests: ring all-gather / reduce-scatter run at the same bus bandwidth)"
    colls = {
        "H200-141GB": {"all_reduce": h200_ar, "p2p": probe["p2p"],
                       "all_gather": [dict(p, source=f"{same}; {p['source']}", estimate=True) for p in h200_ar],
                       "reduce_scatter": [dict(p, source=f"{same}; {p['source']}", estimate=True) for p in h200_ar]},
    }
    scaled = f"estimate: the H200 probe's curve scaled by {ratio:.3f}, the H100 / H200 ratio at 20 MiB"
    h100_ar = [dict(p, value=round(p["value"] * ratio, 4), source=f"{scaled}; {p['source']}", estimate=True) for p in h200_ar
               if abs(p["x"] - n20) > 2**20] + [_pt(n20, bw20, src20)]
    h100_ar.sort(key=lambda p: p["x"])
    colls["H100-80GB"] = {"all_reduce": h100_ar,
                          "all_gather": [dict(p, source=f"{same}; {p['source']}", estimate=True) for p in h100_ar],
                          "reduce_scatter": [dict(p, source=f"{same}; {p['source']}", estimate=True) for p in h100_ar],
                          "p2p": [dict(p, value=round(p["value"] * ratio, 4), source=f"{scaled}; {p['source']}", estimate=True)
                                  for p in probe["p2p"]]}
    # H200 has the H100's compute die: its large-GEMM and long-sequence rates are the H100's, marked as estimates
    same_die = "estimate: H100's measurement (the H200 has the same GH100 compute die and clocks)"
    h200_gemm = h200["gemm"] + [dict(p, source=f"{same_die}; {p['source']}", estimate=True) for p in h100["gemm"]
                                if p["x"] > max(q["x"] for q in h200["gemm"])]
    h200_attn = h200["attention"] + [dict(p, source=f"{same_die}; {p['source']}", estimate=True) for p in h100["attention"]
                                     if p["x"] > max(q["x"] for q in h200["attention"])]
    bf16, fp8 = (_row(r) for r in SOURCES["H100-80GB"]["fp8"])
    speedup = bf16["profile"]["by_category_ms"]["gemm"] / fp8["profile"]["by_category_ms"]["gemm"]
    fp8_pt = _pt(0, speedup, f"{SOURCES['H100-80GB']['fp8'][0]} / {SOURCES['H100-80GB']['fp8'][1]}: profiled gemm ms, bf16 over "
                 f"{fp8['variant']} ({fp8['device']}, {fp8['date'][:10]}, {fp8['git_commit'][:7]})")
    out = {}
    for gpu, rates, gemm, attn in (("H100-80GB", h100, h100["gemm"], h100["attention"]), ("H200-141GB", h200, h200_gemm, h200_attn)):
        refs = [r for v in SOURCES[gpu].values() for r in ([v] if isinstance(v, str) else v)]
        dates = sorted(_row(r)["date"] for r in refs if "allreduce" not in r)
        out[gpu] = {
            "schema": "workbench.advisor.profile/1", "device": DEVICE[gpu], "gpu": gpu, "date": dates[-1],
            "git_commit": "several: each number names its row and commit", "peak_tflops": PEAK_TFLOPS,
            "gemm_tflops": sorted(gemm, key=lambda p: p["x"]), "attention_tflops": sorted(attn, key=lambda p: p["x"]),
            "fp8_gemm_speedup": fp8_pt if gpu == "H100-80GB" else dict(fp8_pt, source=f"{same_die}; {fp8_pt['source']}", estimate=True),
            "memory_gbs": _pt(0, MEMORY_GBS[gpu], "estimate: 90% of the data-sheet bandwidth (no copy measured yet)", True),
            "optimizer_ns_per_param": rates["optimizer"], "collectives": colls[gpu], "inter_node": _inter_node(),
            "host_us_per_layer": _host(), "gpus_per_node": 8,
            "notes": ["built by `python -m workbench.advisor.calibration` from committed benchmark rows; "
                      "replace with `workbench calibrate` on the GPUs you train on"],
        }
    return out
