"""The calibration profile: what one GPU model (and its links) measured, as typed, torch-free JSON.

A profile holds rates, each point with where it came from (``source``) and whether it is an
``estimate`` rather than a measurement:

* ``gemm_tflops``: dense GEMM TFLOP/s by shape class (``x`` = GFLOP of one GEMM call: a layer's
  forward GEMM FLOPs per TP rank over its four GEMMs), interpolated log-log between points;
* ``fp8_gemm_speedup``: FP8 GEMM time over bf16 (one point);
* ``attention_tflops``: fused attention TFLOP/s (Megatron's count: full ``s x s`` scores) by sequence length;
* ``memory_gbs``: achievable memory bandwidth (element-wise kernels, a large copy);
* ``optimizer_ns_per_param``: the fused AdamW step (and its multi-tensor helpers) per parameter;
* ``collectives``: bus bandwidth (nccl-tests' definition) by message bytes for ``all_reduce``,
  ``all_gather``, ``reduce_scatter`` and ``p2p`` between the GPUs of one node, and ``inter_node``
  (one point per op or an estimate) between nodes;
* ``host_us_per_layer``: host time to launch one layer's forward + backward, by kernel path
  (``graphs``: replayed CUDA graphs, ``compiled``: the compiled layer ungraphed, ``stock``: megatron's layer);
* ``constants``: the performance model's free constants (:class:`workbench.advisor.perf_model.Constants`)
  fitted to measured rows, with the rows named in ``fit``.

:func:`load_profile` refuses a malformed file with the field and the fix (a :class:`ProfileError`);
nothing in a profile is executed.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "Point", "Profile", "ProfileError", "load_profile", "default_profile", "PROFILE_DIR",
           "COLLECTIVE_OPS", "interpolate"]

SCHEMA = "workbench.advisor.profile/1"
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


class ProfileError(ValueError):
    """A profile file that cannot be used: ``field`` names what is wrong, ``fix`` what to do."""

    def __init__(self, path: str, field_name: str, rule: str, fix: str):
        self.field, self.rule, self.fix = field_name, rule, fix
        super().__init__(f"{path}: {field_name}: {rule} -> {fix}")


@dataclass(frozen=True)
class Point:
    """One rate at one size (``x``); ``estimate`` marks a number that was not measured."""

    x: float
    value: float
    source: str
    estimate: bool = False


@dataclass
class Profile:
    device: str
    gpu: str  # the planner's GPU name (workbench.planner.GPUS)
    date: str
    git_commit: str
    peak_tflops: float
    gemm_tflops: list[Point]
    fp8_gemm_speedup: Point
    attention_tflops: list[Point]
    memory_gbs: Point
    optimizer_ns_per_param: Point
    collectives: dict[str, list[Point]]
    inter_node: dict[str, Point]
    host_us_per_layer: dict[str, Point]
    constants: dict[str, float] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    gpus_per_node: int = 8
    schema: str = SCHEMA

    # ---- rates
    def gemm_rate(self, gflop_per_call: float) -> float:
        """TFLOP/s of a GEMM of this size (log-log interpolation, clamped at the measured ends)."""
        return interpolate(self.gemm_tflops, gflop_per_call)

    def attention_rate(self, seq: float) -> float:
        return interpolate(self.attention_tflops, seq)

    def collective_seconds(self, op: str, nbytes: float, ranks: int, inter_node: bool = False) -> float:
        """Seconds of one collective of ``nbytes`` (the full tensor) over ``ranks`` GPUs (nccl-tests' bus
        bandwidth: all-reduce moves 2 (n-1)/n of it, all-gather and reduce-scatter (n-1)/n, p2p all of it)."""
        if ranks < 2 or nbytes <= 0:
            return 0.0
        factor = {"all_reduce": 2.0 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
                  "reduce_scatter": (ranks - 1) / ranks, "p2p": 1.0}[op]
        if inter_node:
            pt = self.inter_node[op]
            return factor * nbytes / (pt.value * 1e9) + pt.x * 1e-6  # x: latency in microseconds
        pts = self.collectives[op]
        return factor * nbytes / (interpolate(pts, nbytes) * 1e9)

    # ---- serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def estimates(self) -> list[str]:
        """Which numbers are estimates rather than measurements (dotted names)."""
        out = []
        for name in ("fp8_gemm_speedup", "memory_gbs", "optimizer_ns_per_param"):
            if getattr(self, name).estimate:
                out.append(name)
        for name in ("gemm_tflops", "attention_tflops"):
            out += [f"{name}[x={p.x:g}]" for p in getattr(self, name) if p.estimate]
        for op, pts in self.collectives.items():
            out += [f"collectives.{op}[{p.x:g} B]" for p in pts if p.estimate]
        out += [f"inter_node.{op}" for op, p in self.inter_node.items() if p.estimate]
        out += [f"host_us_per_layer.{k}" for k, p in self.host_us_per_layer.items() if p.estimate]
        return out


def interpolate(points: list[Point], x: float) -> float:
    """Log-log interpolation of ``value`` over ``x`` (points sorted by x; clamped at both ends)."""
    xs = [p.x for p in points]
    if x <= xs[0]:
        return points[0].value
    if x >= xs[-1]:
        return points[-1].value
    i = bisect.bisect_right(xs, x)
    a, b = points[i - 1], points[i]
    f = (math.log(x) - math.log(a.x)) / (math.log(b.x) - math.log(a.x))
    return math.exp(math.log(a.value) + f * (math.log(b.value) - math.log(a.value)))


# --------------------------------------------------------------------------- reading


def _point(raw: Any, where: str, path: str) -> Point:
    if not isinstance(raw, dict):
        raise ProfileError(path, where, f"expected an object with x, value, source, got {type(raw).__name__}",
                           "write it as {\"x\": ..., \"value\": ..., \"source\": \"...\"}")
    unknown = set(raw) - {f.name for f in fields(Point)}
    if unknown:
        raise ProfileError(path, f"{where}.{sorted(unknown)[0]}", "unknown key", "use x, value, source, estimate")
    for key in ("x", "value"):
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ProfileError(path, f"{where}.{key}", f"expected a finite number, got {v!r}", "write a number")
    if raw["value"] <= 0:
        raise ProfileError(path, f"{where}.value", f"must be > 0 (got {raw['value']})", "write a positive rate")
    if raw["x"] < 0:
        raise ProfileError(path, f"{where}.x", f"must be >= 0 (got {raw['x']})", "write a non-negative size")
    if not isinstance(raw.get("source", ""), str):
        raise ProfileError(path, f"{where}.source", "expected a string", "say where the number came from")
    return Point(float(raw["x"]), float(raw["value"]), raw.get("source", ""), bool(raw.get("estimate", False)))


def _curve(raw: Any, where: str, path: str) -> list[Point]:
    if not isinstance(raw, list) or not raw:
        raise ProfileError(path, where, "expected a non-empty list of points", "give at least one measured point")
    pts = sorted((_point(r, f"{where}[{i}]", path) for i, r in enumerate(raw)), key=lambda p: p.x)
    if any(p.x <= 0 for p in pts):
        raise ProfileError(path, where, "curve sizes (x) must be > 0", "use the size the rate was measured at")
    return pts


def profile_from_dict(d: Any, path: str = "<profile>") -> Profile:
    """A :class:`Profile` from parsed JSON; :class:`ProfileError` names the first bad field."""
    if not isinstance(d, dict):
        raise ProfileError(path, "<root>", "expected a JSON object", "write a profile made by `workbench calibrate`")
    if d.get("schema") != SCHEMA:
        raise ProfileError(path, "schema", f"expected {SCHEMA!r}, got {d.get('schema')!r}",
                           "re-run `workbench calibrate` to write a current profile")
    known = {f.name for f in fields(Profile)}
    unknown = set(d) - known
    if unknown:
        raise ProfileError(path, sorted(unknown)[0], "unknown key", f"known keys: {', '.join(sorted(known))}")
    for key in ("device", "gpu", "date", "git_commit"):
        if not isinstance(d.get(key), str):
            raise ProfileError(path, key, "expected a string", "write the device / planner GPU name / date / commit")
    peak = d.get("peak_tflops")
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or peak <= 0:
        raise ProfileError(path, "peak_tflops", f"expected a positive number, got {peak!r}", "e.g. 989 for an H100 / H200")
    colls = d.get("collectives")
    if not isinstance(colls, dict) or set(colls) != set(COLLECTIVE_OPS):
        raise ProfileError(path, "collectives", f"expected curves for exactly {', '.join(COLLECTIVE_OPS)}",
                           "measure them with `workbench calibrate`")
    inter = d.get("inter_node")
    if not isinstance(inter, dict) or set(inter) != set(COLLECTIVE_OPS):
        raise ProfileError(path, "inter_node", f"expected one point for each of {', '.join(COLLECTIVE_OPS)}",
                           "x = latency in microseconds, value = bus GB/s between nodes")
    host = d.get("host_us_per_layer")
    if not isinstance(host, dict) or set(host) != {"graphs", "compiled", "stock"}:
        raise ProfileError(path, "host_us_per_layer", "expected points for graphs, compiled and stock",
                           "x unused (0), value = microseconds per layer forward + backward")
    consts = d.get("constants", {})
    if not isinstance(consts, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in consts.values()):
        raise ProfileError(path, "constants", "expected an object of numbers", "re-fit with workbench.advisor.calibration.fit")
    gpn = d.get("gpus_per_node", 8)
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ProfileError(path, "gpus_per_node", f"expected a positive integer, got {gpn!r}", "e.g. 8")
    return Profile(
        device=d["device"], gpu=d["gpu"], date=d["date"], git_commit=d["git_commit"], peak_tflops=float(peak),
        gemm_tflops=_curve(d.get("gemm_tflops"), "gemm_tflops", path),
        fp8_gemm_speedup=_point(d.get("fp8_gemm_speedup"), "fp8_gemm_speedup", path),
        attention_tflops=_curve(d.get("attention_tflops"), "attention_tflops", path),
        memory_gbs=_point(d.get("memory_gbs"), "memory_gbs", path),
        optimizer_ns_per_param=_point(d.get("optimizer_ns_per_param"), "optimizer_ns_per_param", path),
        collectives={op: _curve(colls[op], f"collectives.{op}", path) for op in COLLECTIVE_OPS},
        inter_node={op: _point(inter[op], f"inter_node.{op}", path) for op in COLLECTIVE_OPS},
        host_us_per_layer={k: _point(host[k], f"host_us_per_layer.{k}", path) for k in ("graphs", "compiled", "stock")},
        constants={k: float(v) for k, v in consts.items()}, fit=dict(d.get("fit") or {}),
        notes=[str(n) for n in d.get("notes", [])], gpus_per_node=gpn,
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON file (:class:`ProfileError` with the field and the fix when it is unusable)."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(str(p), "profile", "file not found", "give a file written by `workbench calibrate`, or leave --profile out")
    try:
        raw = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProfileError(str(p), "profile", f"not valid JSON ({e})", "re-run `workbench calibrate`") from None
    return profile_from_dict(raw, str(p))


#: planner GPU name -> shipped profile file
DEFAULT_PROFILES = {"H100-80GB": "h100.json", "H200-141GB": "h200.json"}


def default_profile(gpu: str) -> Profile:
    """The shipped profile of a planner GPU name (H100-80GB, H200-141GB)."""
    if gpu not in DEFAULT_PROFILES:
        raise ProfileError("--gpu", "gpu", f"no shipped calibration profile for {gpu!r} (shipped: {', '.join(DEFAULT_PROFILES)})",
                           "measure one with `workbench calibrate` and pass it with --profile")
    return load_profile(PROFILE_DIR / DEFAULT_PROFILES[gpu])
