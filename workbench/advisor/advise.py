"""Rank every valid layout of a model on a set of GPUs by predicted speed, each with the planner's fits / OOM.

:func:`advise` validates the config (a :class:`~workbench.config.ConfigError` names the field and the
fix), refuses a mixture-of-experts model (``model.moe``: experts and expert parallelism are not modelled; the
planner, ``workbench plan``, is), enumerates every valid layout (:mod:`workbench.advisor.enumerate`), predicts each one's step
time (:mod:`workbench.advisor.perf_model`; a closed-form bubble first, then the schedule simulator for
the leading layouts), and asks the memory planner (:func:`workbench.planner.predict`: reserved + CUDA
context + NCCL on every rank) whether each fits, in order of predicted speed until ``top`` layouts
that fit are found (``top=None``: every layout).  Each evaluated layout that does not fit is tried again with
optimizer CPU offload (the distributed optimizer's state in host memory, ``parallel.optimizer_cpu_offload: 1.0``):
slower than the layout itself, so only an out-of-memory layout's offloaded form can rank among those shown.  Rows
are sorted by predicted tokens/s; the rank is among layouts that fit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from workbench import planner
from workbench.config import ConfigError, Problem, RunConfig, validate
from workbench.families.common.moe import is_moe

from workbench.advisor.enumerate import Layout, apply_layout, cp_refusal, enumerate_layouts, layout_of
from workbench.advisor.perf_model import REASONS, Model, Prediction
from workbench.advisor.profile import Profile, ProfileError, default_profile
from workbench.advisor.rows import fp8_measured_faster

__all__ = ["AdvisedLayout", "Advice", "advise", "format_advice"]

GiB = 1024 ** 3


@dataclass
class AdvisedLayout:
    layout: Layout
    overrides: dict[str, Any]
    prediction: Prediction
    fits: bool | None = None  # None: memory not evaluated (it ranked below the layouts shown)
    memory_gib: float | None = None  # the worst rank's reserved + context + NCCL (the planner's total)
    rank: int | None = None  # 1 = the fastest layout that fits

    @property
    def label(self) -> str:
        return self.layout.label()

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {"rank": self.rank, "layout": self.layout.to_dict(), "label": self.label, "overrides": self.overrides,
                "fits": self.fits, "memory_gib": self.memory_gib, "tokens_per_s": p.tokens_per_s,
                "tokens_per_s_per_gpu": p.tokens_per_s / self.layout.gpus, "mfu": p.mfu, "step_s": p.step_s,
                "breakdown_s": p.breakdown, "main_reason": p.main_reason, "detail": p.detail}


@dataclass
class Advice:
    config_name: str
    gpus: int
    nodes: int
    gpu: str
    profile: dict[str, str]
    rows: list[AdvisedLayout]
    valid_layouts: int
    memory_evaluated: int
    seconds: float  # wall time
    notes: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0  # this process's CPU time (what the work costs on a machine shared with others)
    offload_evaluated: int = 0  # offloaded forms of out-of-memory layouts the planner was asked about (besides those)

    @property
    def best(self) -> AdvisedLayout | None:
        """The fastest layout that fits (None when none fits)."""
        return next((r for r in self.rows if r.fits), None)

    def fitting(self) -> list[AdvisedLayout]:
        return [r for r in self.rows if r.fits]

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config_name, "gpus": self.gpus, "nodes": self.nodes, "gpu": self.gpu, "profile": self.profile,
                "valid_layouts": self.valid_layouts, "memory_evaluated": self.memory_evaluated,
                "offload_evaluated": self.offload_evaluated, "seconds": self.seconds, "cpu_seconds": self.cpu_seconds,
                "notes": self.notes, "rows": [r.to_dict() for r in self.rows]}


def _problem(field_name: str, rule: str, fix: str) -> ConfigError:
    return ConfigError([Problem(field_name, rule, fix)])


def advise(cfg: RunConfig, gpus: int, gpu: str = "H100-80GB", nodes: int = 1, top: int | None = 20,
           profile: Profile | None = None, simulate: int = 64, fp8: bool | None = None) -> Advice:
    """Every valid layout of ``cfg``'s model, global batch and sequence on ``gpus`` GPUs (``nodes`` nodes), sorted by
    predicted tokens/s.  ``top``: ask the planner about layouts in that order until this many fit (None: all);
    ``simulate``: how many leading layouts get the schedule simulator's bubble (the rest the closed form); ``fp8``:
    True lists the FP8 recipes too, False not; None (the default) lists them only where the config asks for FP8
    (``train.fp8``) or committed rows measured FP8 faster than bf16 for this model on this GPU
    (:func:`workbench.advisor.rows.fp8_measured_faster`), and says which in the notes.
    Bad input raises :class:`ConfigError` naming the field and the fix."""
    t0, c0 = time.perf_counter(), time.process_time()
    problems = cfg.validate()
    if problems:
        raise ConfigError(problems)
    if is_moe(cfg):
        raise _problem("model.moe", f"the advisor does not model experts or expert parallelism (EP) yet: its speed model has no "
                       f"experts' compute or all-to-all and it enumerates no EP layouts, so a ranking of this {cfg.model.moe.num_experts}-"
                       "expert model would be wrong",
                       "check a layout of this MoE model with `workbench plan CONFIG --gpu GPU` (the planner counts the experts' "
                       "memory per EP rank), or advise a dense model (model.moe.num_experts: 0)")
    if not isinstance(gpus, int) or gpus < 1:
        raise _problem("--gpus", f"must be a positive number of GPUs (got {gpus!r})", "e.g. --gpus 8")
    if not isinstance(nodes, int) or nodes < 1 or gpus % nodes:
        raise _problem("--nodes", f"{gpus} GPUs do not split evenly over {nodes!r} nodes", "use a --nodes that divides --gpus")
    if top is not None and top < 1:
        raise _problem("--top", f"must be >= 1 (got {top})", "e.g. --top 20")
    try:
        spec = planner.gpu_spec(gpu)
    except ValueError as e:
        raise _problem("--gpu", str(e), f"use one of {', '.join(planner.GPUS)}") from None
    if profile is None:
        try:
            profile = default_profile(spec.name)
        except ProfileError as e:
            raise _problem("--gpu", e.rule, e.fix) from None
    notes = []
    if cfg.parallel.device != "cuda":
        notes.append(f"the config trains on parallel.device: {cfg.parallel.device}; its layouts are advised for {spec.name} GPUs (device: cuda)")
    if profile.gpu != spec.name:
        notes.append(f"profile measured on {profile.device} ({profile.gpu}); memory checked against {spec.name}")
    if fp8 is None:
        fp8, why = _fp8_default(cfg, spec.name)
        notes.append(why)
    per_node = gpus // nodes
    layouts = enumerate_layouts(cfg, gpus, nodes, fp8)
    notes.append(_cp_note(cfg, gpus, nodes, layouts))
    model = Model(cfg, profile)
    rows = [AdvisedLayout(lay, lay.overrides(per_node, nodes), model.predict(c, per_node, simulate=False)) for lay, c in layouts]
    configs = {id(r): c for r, (_, c) in zip(rows, layouts)}

    def key(r: AdvisedLayout) -> tuple:
        lay = r.layout
        return (-round(r.prediction.tokens_per_s, 6), lay.fp8 != "off", lay.recompute != "none", lay.sp, lay.distributed_optimizer, lay)

    rows.sort(key=key)
    head = rows[:simulate]
    for r in head:
        if r.layout.pp > 1:
            r.prediction = model.predict(configs[id(r)], per_node, simulate=True)
    rows[:simulate] = sorted(head, key=key)
    evaluated = fitting = 0
    for r in rows:
        if top is not None and fitting >= top:
            break
        plan = planner.predict(configs[id(r)], spec, suggest=False)
        r.fits = bool(plan.fits)
        r.memory_gib = plan.worst.total / GiB
        evaluated += 1
        if r.fits:
            fitting += 1
            r.rank = fitting
    offloaded, tried = _offloaded(cfg, rows, model, spec, per_node, nodes)
    if offloaded:
        rows = sorted(rows + offloaded, key=key)
        fitting = 0
        for r in rows:
            r.rank = None
            if r.fits:
                fitting += 1
                r.rank = fitting
    if top is not None:  # the ranked rows up to ``top`` and the out-of-memory ones faster than the last of them
        last = max((i for i, r in enumerate(rows) if r.rank is not None and r.rank <= top), default=len(rows) - 1)
        shown = [r for r in rows[:last + 1] if r.fits is not None]
    else:
        shown = rows
    n_off = sum(1 for r in shown if r.layout.offload and r.fits)
    if n_off:
        notes.append(f"{n_off} of the layouts shown fit only with optimizer CPU offload (parallel.optimizer_cpu_offload: 1.0; "
                     f"{tried} offloaded forms of out-of-memory layouts planned): its host time per parameter is assumed, "
                     "not measured (docs/advisor.md)")
    if not layouts:
        notes.append("no valid layout: the global batch, layer count or heads admit none on this many GPUs")
    elif fitting == 0:
        notes.append(f"no layout fits {spec.name}: every one evaluated runs out of memory")
    info = {"device": profile.device, "gpu": profile.gpu, "date": profile.date, "git_commit": profile.git_commit,
            "estimates": ", ".join(profile.estimates()[:6]) + (" ..." if len(profile.estimates()) > 6 else "")}
    return Advice(cfg.name, gpus, nodes, spec.name, info, shown, len(layouts), evaluated, time.perf_counter() - t0, notes,
                  cpu_seconds=time.process_time() - c0, offload_evaluated=tried)


def _offloaded(cfg: RunConfig, rows: list[AdvisedLayout], model: Model, spec: Any, per_node: int,
               nodes: int) -> tuple[list[AdvisedLayout], int]:
    """The optimizer-CPU-offload forms (distributed optimizer, ``offload`` 1.0) of the evaluated layouts that do not fit,
    planned, and predicted (with the schedule simulator where their own layout had it) where they fit; those that fit,
    and how many the planner was asked about.  A form whose twin without offload fits is skipped: the same layout,
    slower."""
    fits = {r.layout for r in rows if r.fits}
    out, seen, planned = [], set(), 0
    for r in rows:
        if r.fits is not False or r.layout.offload:
            continue
        lay = dataclasses.replace(r.layout, distributed_optimizer=True, offload=1.0)
        if lay in seen or dataclasses.replace(lay, offload=0.0) in fits:
            continue
        seen.add(lay)
        c = apply_layout(cfg, lay, per_node, nodes)
        if validate(c):
            continue
        planned += 1
        plan = planner.predict(c, spec, suggest=False)
        if plan.fits:
            pred = model.predict(c, per_node, simulate=r.prediction.detail.get("bubble_from") == "simulator")
            out.append(AdvisedLayout(lay, lay.overrides(per_node, nodes), pred, True, plan.worst.total / GiB))
    return out, planned


def _cp_note(cfg: RunConfig, gpus: int, nodes: int, layouts: list) -> str:
    """What the listing says about context parallelism: listed (their ring's cost modelled, its factor unfitted) or why
    not."""
    n = sum(1 for lay, _ in layouts if lay.cp > 1)
    if n:
        return (f"{n} context-parallel layouts listed (CP's ring time is modelled with an unfitted factor 1.0; the "
                "measured CP rows join the fit: docs/advisor.md)")
    why = cp_refusal(cfg, gpus, nodes)
    return f"no context-parallel layout listed: {why or 'none the validator accepts'}"


def _fp8_default(cfg: RunConfig, gpu: str) -> tuple[bool, str]:
    """Whether ``advise`` lists FP8 layouts when not told, with the note that says why (FP8 is opt-in: faster in the
    Llama-1B/3B rows, slower than bf16 in GPT-2 medium's)."""
    if cfg.train.fp8 != "off":
        return True, f"FP8 layouts included: the config asks for train.fp8: {cfg.train.fp8} (--no-fp8 leaves them out)"
    faster, why = fp8_measured_faster(cfg, gpu)
    if faster:
        return True, f"FP8 layouts included: measured faster than bf16 ({why}; --no-fp8 leaves them out)"
    return False, f"FP8 layouts left out (opt-in: --fp8 includes them): no committed row shows FP8 faster here ({why})"


def current_layout_row(cfg: RunConfig, advice: Advice) -> AdvisedLayout | None:
    """The row of the config's own layout, if it was evaluated."""
    own = layout_of(cfg)
    return next((r for r in advice.rows if r.layout == own), None)


def format_advice(advice: Advice, top: int | None = 20) -> str:
    """The sorted table of layouts that fit (ranked), with a count of the faster ones that do not fit; rows that differ
    only in an FP8 recipe and predict the same are one line."""
    lines = [f"{advice.config_name}: {advice.valid_layouts} valid layouts on {advice.gpus} x {advice.gpu}"
             f" ({advice.nodes} node{'s' if advice.nodes > 1 else ''}); memory checked for {advice.memory_evaluated}"
             f" in order of predicted speed; {advice.cpu_seconds:.2f} s CPU ({advice.seconds:.2f} s wall)",
             f"profile: {advice.profile['device']} ({advice.profile['date'][:10]}; {advice.profile['git_commit']})"]
    lines += [f"note: {n}" for n in advice.notes]
    oom = [r for r in advice.rows if r.fits is False and (advice.best is None or r.prediction.tokens_per_s > advice.best.prediction.tokens_per_s)]
    if oom:
        lines.append(f"{len(oom)} layouts predicted faster than the pick do not fit (OOM; the fastest: {oom[0].label}, "
                     f"{oom[0].prediction.tokens_per_s:.0f} tok/s, {oom[0].memory_gib:.1f} GiB); --json lists them")
    hdr = (f"{'#':>3s} {'layout':44s} {'tok/s':>10s} {'tok/s/GPU':>9s} {'MFU':>6s} {'mem GiB':>8s}  "
           + " ".join(f"{k[:7]:>7s}" for k in REASONS) + "  main cost")
    lines += [hdr, "-" * len(hdr)]
    groups: list[list[AdvisedLayout]] = []
    for r in advice.fitting():
        g = groups[-1] if groups else None
        if g and dataclasses.replace(g[0].layout, fp8="off") == dataclasses.replace(r.layout, fp8="off") and \
                abs(g[0].prediction.tokens_per_s - r.prediction.tokens_per_s) < 1e-6 * r.prediction.tokens_per_s and g[0].layout.fp8 != "off":
            g.append(r)
        else:
            groups.append([r])
    for g in groups[:top] if top is not None else groups:
        r, p = g[0], g[0].prediction
        label = r.label if len(g) == 1 else r.label.replace(f"fp8:{r.layout.fp8}", "fp8:" + "|".join(x.layout.fp8 for x in g))
        pct = " ".join(f"{100 * p.breakdown[k] / p.step_s:>6.1f}%" for k in REASONS)
        lines.append(f"{r.rank:>3d} {label:44s} {p.tokens_per_s:>10.0f} {p.tokens_per_s / r.layout.gpus:>9.0f} "
                     f"{100 * p.mfu:>5.1f}% {r.memory_gib:>8.1f}  {pct}  {p.main_reason}")
    best = advice.best
    if best:
        lines.append(f"pick: {best.label}: {best.prediction.tokens_per_s:.0f} tok/s ({best.prediction.tokens_per_s / best.layout.gpus:.0f} "
                     f"per GPU, MFU {100 * best.prediction.mfu:.1f}%), {best.memory_gib:.1f} GiB on the fullest rank")
    return "\n".join(lines)
