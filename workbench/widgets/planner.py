"""The memory-planner widget: change the layout, see every rank's predicted memory at once.

Headless-friendly like the other workbench widgets: constructing :class:`MemoryPlanner`
needs no browser, :meth:`MemoryPlanner.set` drives it from code (tests, papermill) and
:attr:`plan` / :attr:`figure` / :attr:`message` hold the latest result.  Every change
re-plans (a few ms) and redraws (the newest change's chart, whatever the order the browser
sends them in); an invalid layout shows the config's problems instead of a chart; when a rank does not fit, the suggestions say what to change and :meth:`apply`
takes one.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from workbench.config import ConfigError, RunConfig, derive, preset
from workbench.planner import GPUS, GiB, Plan, PlannerAssumptions, Suggestion, gpu_spec, measured_peaks, predict
from workbench.plots.memory import plan_bars

__all__ = ["MemoryPlanner"]

_CUSTOM = "custom"


class MemoryPlanner:
    """Layout controls -> per-rank stacked memory bars against a GPU, fits/OOM, suggestions.

    Controls: tp, pp, vpp, dp, micro-batch size, micro-batches per step, sequence length,
    SP, recompute, distributed optimizer, precision, attention backend, GPU (or a custom
    capacity in GiB).  The global batch follows ``micro_batch * dp * micro-batches``.
    """

    def __init__(self, cfg: RunConfig | str | None = None, gpu: str = "H100-80GB",
                 assumptions: PlannerAssumptions | None = None, show: bool = True):
        import ipywidgets as W

        if cfg is None:
            cfg = preset("gpt2-medium")
        elif isinstance(cfg, str):
            cfg = preset(cfg)
        self.base = cfg
        self.assumptions = assumptions or PlannerAssumptions()
        d = derive(cfg)
        p, t, m = cfg.parallel, cfg.train, cfg.model
        from workbench.widgets.layout import column, columns, labelled

        # one description width per column (the longest label of that column), so four columns fit
        # a 1050 px output; every box keeps its width (nothing clipped, nothing scrolled)
        layout_st, layout_box = labelled(W, ["tensor parallel", "pipeline parallel", "virtual pp (vpp)", "data parallel"], 80)
        batch_st, batch_box = labelled(W, ["micro-batch size", "micro-batches/step", "sequence length"], 96)
        kernel_st, kernel_box = labelled(W, ["recompute", "precision", "attention"], 112)
        gpu_st, gpu_box = labelled(W, ["GPU", "custom GiB"], 124)

        def box(layout: Any) -> Any:
            return W.Layout(width=layout.width, flex=layout.flex)

        def islider(value: int, lo: int, hi: int, desc: str, style: dict, layout: Any) -> Any:
            return W.BoundedIntText(value=value, min=lo, max=hi, description=desc, style=style, layout=box(layout))

        self.tp = islider(p.tensor_parallel, 1, 64, "tensor parallel", layout_st, layout_box)
        self.pp = islider(p.pipeline_parallel, 1, 128, "pipeline parallel", layout_st, layout_box)
        self.vpp = islider(p.vpp, 1, 16, "virtual pp (vpp)", layout_st, layout_box)
        self.dp = islider(d.data_parallel, 1, 4096, "data parallel", layout_st, layout_box)
        self.micro_batch = islider(t.micro_batch_size, 1, 4096, "micro-batch size", batch_st, batch_box)
        self.microbatches = islider(d.num_microbatches, 1, 4096, "micro-batches/step", batch_st, batch_box)
        self.seq_length = islider(m.seq_length, 1, 1 << 20, "sequence length", batch_st, batch_box)
        self.sp = W.Checkbox(value=p.sequence_parallel, description="sequence parallel", indent=False, layout=box(kernel_box))
        self.dist_opt = W.Checkbox(value=p.distributed_optimizer, description="distributed optimizer", indent=False,
                                   layout=box(kernel_box))
        self.offload = W.BoundedFloatText(value=p.optimizer_cpu_offload, min=0.0, max=1.0, step=0.25, description="offload",
                                          tooltip="parallel.optimizer_cpu_offload: the share of the distributed optimizer's "
                                                  "state in host memory (0: none)", style=kernel_st, layout=box(kernel_box))
        self.recompute = W.Dropdown(options=["none", "selective", "full"], value=p.recompute, description="recompute",
                                    style=kernel_st, layout=box(kernel_box))
        self.precision = W.Dropdown(options=["bf16", "fp16", "fp32"], value=t.precision, description="precision",
                                    style=kernel_st, layout=box(kernel_box))
        self.attention = W.Dropdown(options=["auto", "sdpa", "te", "local"], value=m.attention_backend, description="attention",
                                    style=kernel_st, layout=box(kernel_box))
        self.gpu = W.Dropdown(options=list(GPUS) + [_CUSTOM], value=gpu_spec(gpu).name if gpu_spec(gpu).name in GPUS else _CUSTOM,
                              description="GPU", style=gpu_st, layout=box(gpu_box))
        self.custom_gib = W.BoundedFloatText(value=gpu_spec(gpu).capacity_bytes / GiB, min=0.1, max=100000, description="custom GiB",
                                             style=gpu_st, layout=box(gpu_box))
        self.status = W.HTML()
        self.suggestions_box = W.VBox()
        self.out = W.Output()
        self.plan: Plan | None = None
        self.config: RunConfig | None = None
        self.figure = None
        self.message = ""
        self.measured: dict[int, int] | None = None
        self._show = show
        self._batch = False
        self.controls = (self.tp, self.pp, self.vpp, self.dp, self.micro_batch, self.microbatches, self.seq_length,
                         self.sp, self.dist_opt, self.offload, self.recompute, self.precision, self.attention, self.gpu,
                         self.custom_gib)
        for w in self.controls:
            w.observe(self._on_change, names="value")
        self.ui = W.VBox([
            columns(W, [column(W, [self.tp, self.pp, self.vpp, self.dp]),
                        column(W, [self.micro_batch, self.microbatches, self.seq_length]),
                        column(W, [self.recompute, self.precision, self.attention, self.sp, self.dist_opt, self.offload]),
                        column(W, [self.gpu, self.custom_gib])]),
            self.status,
            self.suggestions_box,
            self.out,
        ])
        self.update()

    # -- programmatic control
    def set(self, **values: Any) -> "MemoryPlanner":
        """Set several controls at once (names of the attributes above, e.g. ``tp=2, sp=True``), re-plan once."""
        self._batch = True
        try:
            for k, val in values.items():
                if k not in {"tp", "pp", "vpp", "dp", "micro_batch", "microbatches", "seq_length", "sp", "dist_opt",
                             "offload", "recompute", "precision", "attention", "gpu", "custom_gib"}:
                    raise ValueError(f"unknown control {k!r}")
                getattr(self, k).value = val
        finally:
            self._batch = False
        self.update()
        return self

    def apply(self, suggestion: Suggestion | int) -> "MemoryPlanner":
        """Take one of the current suggestions (or its index) and re-plan."""
        if isinstance(suggestion, int):
            suggestion = self.plan.suggestions[suggestion]
        cfg = self.config.replace(**suggestion.overrides)
        d = derive(cfg)
        self.set(tp=cfg.parallel.tensor_parallel, pp=cfg.parallel.pipeline_parallel, vpp=cfg.parallel.vpp, dp=d.data_parallel,
                 micro_batch=cfg.train.micro_batch_size, microbatches=d.num_microbatches, sp=cfg.parallel.sequence_parallel,
                 dist_opt=cfg.parallel.distributed_optimizer, offload=cfg.parallel.optimizer_cpu_offload,
                 recompute=cfg.parallel.recompute)
        if cfg.train.grad_reduce_in_fp32 != self.base.train.grad_reduce_in_fp32:
            self.base = self.base.replace(**{"train.grad_reduce_in_fp32": cfg.train.grad_reduce_in_fp32})
            self.update()
        return self

    def show_measured(self, measured: dict[int, int] | str | Path | None) -> "MemoryPlanner":
        """Overlay measured peaks: a ``{rank: bytes}`` dict or a run directory (its step events)."""
        if measured is not None and not isinstance(measured, dict):
            measured = measured_peaks(measured)
        self.measured = measured or None
        self.update()
        return self

    def _on_change(self, _change: dict) -> None:
        if not self._batch:
            self.update()

    def _current_config(self) -> RunConfig:
        tp, pp, dp = self.tp.value, self.pp.value, self.dp.value
        mbs, m = self.micro_batch.value, self.microbatches.value
        vpp = self.vpp.value
        world = tp * pp * dp * max(int(getattr(self.base.parallel, "context_parallel", 1) or 1), 1)  # the base's CP kept
        nnodes = self.base.parallel.nnodes if world % self.base.parallel.nnodes == 0 else 1
        return self.base.replace(**{
            "parallel.tensor_parallel": tp, "parallel.pipeline_parallel": pp,
            "parallel.virtual_pipeline_parallel": vpp if vpp > 1 else None,
            "parallel.nnodes": nnodes, "parallel.nproc_per_node": world // nnodes,
            "parallel.sequence_parallel": bool(self.sp.value), "parallel.distributed_optimizer": bool(self.dist_opt.value),
            "parallel.optimizer_cpu_offload": float(self.offload.value),
            "parallel.recompute": self.recompute.value, "train.precision": self.precision.value,
            "train.micro_batch_size": mbs, "train.global_batch_size": mbs * dp * m,
            "model.seq_length": self.seq_length.value,
            "model.max_position_embeddings": max(self.base.model.max_position_embeddings, self.seq_length.value),
            "model.attention_backend": self.attention.value,
        })

    def _gpu(self) -> Any:
        self.custom_gib.disabled = self.gpu.value != _CUSTOM
        return int(self.custom_gib.value * GiB) if self.gpu.value == _CUSTOM else self.gpu.value

    def update(self) -> Plan | None:
        """Re-plan and redraw; returns the plan, or None (with ``message`` set) for an invalid layout."""
        from workbench.widgets.charts import clear_figure, show_figure

        self.figure = None
        try:
            self.config = self._current_config()
            self.plan = predict(self.config, gpu=self._gpu(), assumptions=self.assumptions)
            self.message = ""
        except (ConfigError, ValueError) as e:
            self.plan, self.message = None, str(e)
        if self.plan is None:
            clear_figure(self.out)  # at once, so the previous chart never stays under the refusal
            self.status.value = "<b style='color:#b00'>not a valid layout:</b><pre>" + html.escape(self.message) + "</pre>"
            self.suggestions_box.children = ()
            return None
        plan = self.plan
        worst = plan.worst
        oom = [r.rank for r in plan.ranks if not r.fits]
        verdict = ("<b style='color:#2a7a2a'>fits on every rank</b>" if not oom else
                   f"<b style='color:#b00'>OOM on {len(oom)} of {len(plan.ranks)} ranks</b> "
                   f"(stages {sorted({plan.ranks[r].pp_rank for r in oom})})")
        self.status.value = (
            f"{verdict} &middot; worst: stage {worst.pp_rank}, {worst.total / GiB:.2f} GiB "
            f"({worst.peak_allocated / GiB:.2f} allocated at the {worst.peak_phase.replace('_', ' ')}) of "
            f"{plan.gpu.capacity_bytes / GiB:.1f} GiB &middot; largest micro-batch that fits: <b>{plan.largest_micro_batch}</b>"
            f" &middot; megatron's formula (first stage): {plan.megatron.total / GiB:.2f} GiB"
            + (f" &middot; host memory (optimizer CPU offload): {host / GiB:.2f} GiB on the fullest rank"
               if (host := max(st.detail.get("optimizer_host_bytes", 0) for st in plan.stages)) else ""))
        self._render_suggestions()
        self.figure = plan_bars(plan, measured=self.measured)
        if self._show:  # one state update replaces the old chart (widgets/charts.py says why not `with out`)
            show_figure(self.out, self.figure)
        return plan

    def _render_suggestions(self) -> None:
        import ipywidgets as W

        rows = []
        for i, sg in enumerate(self.plan.suggestions if self.plan else []):
            btn = W.Button(description="apply", layout=W.Layout(width="70px"))
            btn.on_click(lambda _b, i=i: self.apply(i))
            label = W.HTML(f"{html.escape(sg.text)}: worst rank {sg.worst_total / GiB:.2f} GiB"
                           f"{' <b>(fits)</b>' if sg.fits else ''}")
            rows.append(W.HBox([btn, label]))
        self.suggestions_box.children = tuple([W.HTML("<b>what to change:</b>")] + rows) if rows else ()

    def _ipython_display_(self) -> None:
        from workbench.widgets.layout import show_live

        show_live(self.ui)
