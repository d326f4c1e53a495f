"""The fit of the performance model's free constants, and the shipped profiles.

:func:`fit` chooses the :class:`~workbench.advisor.perf_model.Constants` that minimise the squared
log error of predicted tokens/s over measured rows (:func:`workbench.advisor.rows.measured_rows`;
Nelder-Mead, pure Python); :func:`error_table` reports predicted vs measured per row.
``tests/advisor/test_advisor_fit.py`` fits on the H200 rows and holds the H100 rows (another GPU, other
profile numbers, the same mechanisms) to a stated bound.

``python -m workbench.advisor.calibration`` rebuilds ``profiles/h100.json`` and ``profiles/h200.json``
(:func:`build_default_profiles`: the rates of :mod:`workbench.advisor.defaults`, each naming the rows
it came from, estimates marked) with the constants fitted to every selected row, and prints the table.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any, Callable

from workbench import kernel_rule
from workbench.advisor.defaults import default_profile_dicts
from workbench.advisor.perf_model import Constants, Model
from workbench.advisor.profile import PROFILE_DIR, Point, Profile, profile_from_dict
from workbench.advisor.rows import REPO, MeasuredRow, measured_rows

__all__ = ["fit", "calibrate", "solve_host", "is_host_row", "error_table", "format_table", "build_default_profiles", "FIT_NAMES",
           "predict_row"]


# --------------------------------------------------------------------------- fitting

#: constants fitted, and how each is kept in range (x: the optimiser's free variable).  Not fitted, for want of a
#: current row exercising them: ``ew_factor_stock`` (megatron's stock layer), ``dp_overlap`` (one DP row, overlapped
#: either way) and ``head_factor`` (their defaults)
FIT_NAMES: dict[str, tuple[Callable[[float], float], Callable[[float], float]]] = {
    "ew_factor": (math.exp, math.log),
    "tp_overlap": (lambda x: 1 / (1 + math.exp(-x)), lambda v: math.log(v / (1 - v))),
    "tp_comm_factor": (math.exp, math.log),
    "step_ms": (math.exp, math.log),
    "fp8_cast_tensorwise": (math.exp, math.log),
    "fp8_cast_rowwise": (math.exp, math.log),
    "fp8_cast_delayed": (math.exp, math.log),
    "fp8_layer_us": (math.exp, math.log),
}


def predict_row(row: MeasuredRow, profiles: dict[str, Profile], constants: Constants) -> float:
    """Predicted tokens/s of a measured row (on the profile of its GPU)."""
    return Model(row.config, profiles[row.gpu], constants).predict(row.config).tokens_per_s


def _loss(rows: list[MeasuredRow], profiles: dict[str, Profile], constants: Constants) -> float:
    return sum(math.log(predict_row(r, profiles, constants) / r.tokens_per_s) ** 2 for r in rows) / max(len(rows), 1)


def _nelder_mead(f: Callable[[list[float]], float], x0: list[float], step: float = 0.5, iters: int = 400,
                 tol: float = 1e-10) -> list[float]:
    n = len(x0)
    simplex = [list(x0)] + [[x + (step if j == i else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        refl = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(exp)
            simplex[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = refl, fr
        else:
            con = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(con)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = con, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (x - b) for b, x in zip(best, s)] for s in simplex[1:]]
                vals = [vals[0]] + [f(s) for s in simplex[1:]]
    return simplex[min(range(n + 1), key=vals.__getitem__)]


def fit(rows: list[MeasuredRow], profiles: dict[str, Profile], start: Constants | None = None,
        names: tuple[str, ...] = tuple(FIT_NAMES)) -> Constants:
    """The constants (``names``) minimising the mean squared log error of predicted tokens/s over ``rows``."""
    start = start or Constants()
    x0 = [FIT_NAMES[n][1](getattr(start, n)) for n in names]

    def consts(x: list[float]) -> Constants:
        return dataclasses.replace(start, **{n: FIT_NAMES[n][0](v) for n, v in zip(names, x)})

    best = _nelder_mead(lambda x: _loss(rows, profiles, consts(x)), x0)
    return consts(best)


def error_table(rows: list[MeasuredRow], profiles: dict[str, Profile], constants: Constants) -> list[dict[str, Any]]:
    """Predicted vs measured tokens/s per row (error = predicted / measured - 1)."""
    out = []
    for r in rows:
        pred = predict_row(r, profiles, constants)
        out.append({"source": r.source, "gpu": r.gpu, "variant": r.variant, "gpus": r.gpus, "git_commit": r.git_commit,
                    "measured_tokens_per_s": round(r.tokens_per_s), "predicted_tokens_per_s": round(pred),
                    "error": pred / r.tokens_per_s - 1})
    return out


def format_table(table: list[dict[str, Any]]) -> str:
    lines = [f"{'gpu':11s} {'variant':32s} {'measured':>10s} {'predicted':>10s} {'error':>7s}  source"]
    for t in table:
        lines.append(f"{t['gpu']:11s} {t['variant']:32s} {t['measured_tokens_per_s']:>10d} {t['predicted_tokens_per_s']:>10d} "
                     f"{t['error'] * 100:>+6.1f}%  {t['source']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- shipped profiles

def is_host_row(row: MeasuredRow) -> bool:
    """Rows that measure the compiled layer without CUDA graphs and without pipelining: they calibrate the GPU's
    host time per layer (its host CPU's, not a model constant) rather than the constants.  Not context parallel
    rows: their layer is compiled pieces around an eager ring, whose time is the ring's, not the launches'."""
    kp = kernel_rule.choose(row.config)
    return (kp.layer == "compiled" and not kp.cuda_graphs and row.config.parallel.pipeline_parallel == 1
            and int(getattr(row.config.parallel, "context_parallel", 1) or 1) == 1)


def solve_host(rows: list[MeasuredRow], profile: Profile, constants: Constants) -> Profile:
    """``profile`` with ``host_us_per_layer.compiled`` set so the rows' predictions match them on average
    (bisection on the mean log error; unchanged where no such row exists or host time never shows)."""
    if not rows:
        return profile

    def err(us: float) -> float:
        p = dataclasses.replace(profile, host_us_per_layer={**profile.host_us_per_layer,
                                                            "compiled": Point(0, us, "", False)})
        return sum(math.log(predict_row(r, {r.gpu: p}, constants) / r.tokens_per_s) for r in rows) / len(rows)

    lo, hi = 1.0, 20000.0
    if err(lo) <= 0:  # device-bound even without host time: the rows cannot tell; keep the estimate
        return profile
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if err(mid) > 0 else (lo, mid)
    src = "solved so that the prediction of " + ", ".join(r.source for r in rows) + " matches it (the host CPU of that machine)"
    return dataclasses.replace(profile, host_us_per_layer={**profile.host_us_per_layer, "compiled": Point(0, round(lo, 1), src, False)})


def calibrate(rows: list[MeasuredRow], profiles: dict[str, Profile], start: Constants | None = None,
              rounds: int = 2) -> tuple[Constants, dict[str, Profile]]:
    """Constants fitted to ``rows`` (host rows left out) and each profile's host time solved from its host rows."""
    host = [r for r in rows if is_host_row(r)]
    rest = [r for r in rows if not is_host_row(r)]
    constants = start or Constants()
    for _ in range(rounds):
        constants = fit(rest, profiles, constants)
        profiles = {g: solve_host([r for r in host if r.gpu == g], p, constants) for g, p in profiles.items()}
    return constants, profiles


def build_default_profiles(root: str | Path = REPO) -> dict[str, Profile]:
    """The shipped H100 / H200 profiles: rates from :mod:`workbench.advisor.defaults`, host time solved from each
    GPU's ungraphed rows, constants fitted to every other measured row of both GPUs."""
    profiles = {gpu: profile_from_dict(d, f"defaults[{gpu}]") for gpu, d in default_profile_dicts().items()}
    rows, _ = measured_rows(root)
    constants, profiles = calibrate(rows, profiles)
    table = error_table(rows, profiles, constants)
    for p in profiles.values():
        p.constants = constants.to_dict()
        p.fit = {"rows": [r.source for r in rows if not is_host_row(r)],
                 "host_rows": [r.source for r in rows if is_host_row(r)],
                 "method": "Nelder-Mead on mean squared log(predicted/measured) tokens/s",
                 "errors": {t["source"]: round(t["error"], 4) for t in table}}
    return profiles


def main(argv: list[str] | None = None) -> int:
    profiles = build_default_profiles()
    for gpu, p in profiles.items():
        path = PROFILE_DIR / {"H100-80GB": "h100.json", "H200-141GB": "h200.json"}[gpu]
        p.save(path)
        print(f"wrote {path}")
    rows, _ = measured_rows()
    print(format_table(error_table(rows, profiles, Constants.from_dict(next(iter(profiles.values())).constants))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
