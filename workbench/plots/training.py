"""Training curves of a run: loss, throughput / MFU, memory per rank, grad norm / LR.

Pure functions of the DataFrames :class:`workbench.launch.Run` exposes, drawn on a
``matplotlib.figure.Figure`` that lives outside pyplot (safe from a background thread, never
auto-shown twice).  The dashboard re-renders it to PNG for in-place updates; headless
(papermill) runs display the final PNG as a static image.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Mapping

from workbench.layout import Layout

__all__ = ["TrainingFrames", "frames_from_run", "training_figure", "figure_png", "GIB", "rank_tick"]

GIB = float(1 << 30)


@dataclass
class TrainingFrames:
    """What the training figure needs (all pandas DataFrames, possibly empty)."""

    steps: Any  # rank, iteration, loss, lr, grad_norm, tokens_per_s, mfu, mem_*
    train_loss: Any  # iteration, loss
    evals: Any  # iteration, loss, ppl
    memory: Any  # rank, mem_allocated, mem_reserved, mem_peak
    train_iters: int | None = None
    title: str | None = None
    #: the run replays its layers as CUDA graphs: their pool is reserved memory, never "allocated"
    cuda_graphs: bool = False
    #: ``parallel.device`` of the run ("cpu": there is no GPU memory to measure or predict)
    device: str | None = None
    #: the run's :class:`workbench.layout.Layout` (its ranks' coordinates label the memory panel: ``d0 c1 t0 p0``)
    layout: Any = None


def _used_cuda_graphs(run) -> bool:
    """Did the layers replay as CUDA graphs (the run's kernel path, read by its reader)."""
    return run.reader.uses_cuda_graphs()


def frames_from_run(run) -> TrainingFrames:
    cfg = getattr(run, "config", None)
    return TrainingFrames(run.steps, run.train_loss, run.evals, run.memory, cfg.train.train_iters if cfg else None,
                          run.run_dir.name, cuda_graphs=_used_cuda_graphs(run), device=cfg.parallel.device if cfg else None,
                          layout=Layout.of(cfg) if cfg else None)


def rank_tick(rank: int, layout: Any) -> str:
    """A rank's tick label in per-rank panels: ``1`` alone for one rank or no layout, else with its coordinates
    (``1\nd0 c1 t0 p0``, :meth:`workbench.layout.Layout.rank_label`; the CP coordinate where cp > 1)."""
    if layout is None or layout.world <= 1:
        return str(rank)
    return f"{rank}\n{layout.rank_label(rank, short=True)}"


def _per_iteration(steps, column: str, how: str = "max"):
    if not len(steps) or column not in steps or not steps[column].notna().any():
        return None
    s = steps[steps[column].notna()].groupby("iteration")[column]
    return getattr(s, how)()


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def training_figure(frames: TrainingFrames, predicted_memory: Mapping[int, float] | float | None = None,
                    figsize: tuple[float, float] = (11.0, 6.5)):
    """A 2x2 figure: loss (train and eval) | tokens/s and MFU / memory per rank | grad norm and LR.

    ``predicted_memory``: the planner's prediction in bytes, one number for every rank or a
    ``{rank: bytes}`` mapping; drawn as a third bar next to allocated and reserved.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    (ax_loss, ax_tput), (ax_mem, ax_grad) = fig.subplots(2, 2)
    steps = frames.steps

    # loss
    tl, ev = frames.train_loss, frames.evals
    if len(tl):
        ax_loss.plot(tl["iteration"], tl["loss"], label="train", color="C0", lw=1.2)
    if len(ev):
        ax_loss.plot(ev["iteration"], ev["loss"], "o-", label="eval", color="C3", ms=4)
    if len(tl) or len(ev):
        ax_loss.set_xlabel("iteration")
        ax_loss.set_ylabel("loss")
        ax_loss.legend(fontsize=8)  # the x axis follows the iterations so far, like the other panels
        ax_loss.grid(alpha=0.3)
    else:
        _empty(ax_loss, "no loss yet")
    ax_loss.set_title("loss", fontsize=10)

    # throughput and MFU
    # every rank reports the job's tokens/s of the same step: take the max, never the sum
    tput = _per_iteration(steps, "tokens_per_s", "max")
    if tput is not None:
        ax_tput.plot(tput.index, tput.values, color="C2", lw=1.2, label="tokens/s")
        ax_tput.set_ylabel("tokens/s", color="C2")
        ax_tput.set_xlabel("iteration")
        mfu = _per_iteration(steps, "mfu", "mean")
        if mfu is not None:
            ax2 = ax_tput.twinx()
            ax2.plot(mfu.index, 100.0 * mfu.values, color="C4", lw=1.0, ls="--", label="MFU")
            ax2.set_ylabel("MFU %", color="C4")
        ax_tput.grid(alpha=0.3)
    else:
        _empty(ax_tput, "no throughput yet")
    ax_tput.set_title("throughput", fontsize=10)

    _memory_panel(ax_mem, frames, predicted_memory)

    # grad norm and LR
    gn = _per_iteration(steps, "grad_norm", "max")
    lr = _per_iteration(steps, "lr", "max")
    if gn is not None or lr is not None:
        if gn is not None:
            ax_grad.plot(gn.index, gn.values, color="C5", lw=1.2)
            ax_grad.set_ylabel("grad norm", color="C5")
        ax_grad.set_xlabel("iteration")
        if lr is not None:
            ax3 = ax_grad.twinx() if gn is not None else ax_grad
            ax3.plot(lr.index, lr.values, color="C7", lw=1.0, ls="--")
            ax3.set_ylabel("learning rate", color="C7")
        ax_grad.grid(alpha=0.3)
    else:
        _empty(ax_grad, "no gradients yet")
    ax_grad.set_title("grad norm and LR", fontsize=10)

    if frames.title:
        fig.suptitle(frames.title, fontsize=10)
    fig.tight_layout()
    return fig


def _memory_panel(ax, frames: TrainingFrames, predicted_memory: Mapping[int, float] | float | None) -> None:
    """Memory per rank: measured allocated / reserved (latest step) next to the planner's prediction.

    Each rank's bars are centred on its tick (the planner's bar alone while nothing is measured);
    the legend sits above the bars, in headroom of its own.  On CPU there is no GPU memory to
    measure or predict: the panel says so.
    """
    mem = frames.memory
    measured = {}
    if len(mem):
        for _, row in mem.iterrows():
            measured[int(row["rank"])] = (row.get("mem_allocated"), row.get("mem_reserved"))
    has_measured = any(v is not None and v == v for pair in measured.values() for v in pair)
    ax.set_title("memory per rank (latest step)" if has_measured else "memory per rank", fontsize=10)
    if not has_measured and frames.device == "cpu":
        _empty(ax, "no GPU memory on CPU")
        return
    pred: dict[int, float] = {}
    if isinstance(predicted_memory, Mapping):
        pred = {int(k): float(v) for k, v in predicted_memory.items()}
    elif predicted_memory is not None:
        pred = {r: float(predicted_memory) for r in (measured or {0: None})}
    ranks = sorted(set(measured) | set(pred))
    if not ranks or not (has_measured or pred):
        _empty(ax, "no memory numbers yet")
        return
    nan = float("nan")

    def col(i: int) -> list[float]:
        out = []
        for r in ranks:
            v = measured.get(r, (None, None))[i]
            out.append(nan if v is None or v != v else float(v) / GIB)
        return out

    allocated = "allocated (CUDA-graph pool: see reserved)" if frames.cuda_graphs else "allocated"
    series = ([(col(0), allocated, {"color": "C0"}), (col(1), "reserved", {"color": "C1"})] if has_measured else [])
    if pred:
        series.append(([pred.get(r, nan) / GIB for r in ranks],
                       "planner" if has_measured else "planner (nothing measured yet)", {"color": "0.6", "hatch": "//"}))
    x = list(range(len(ranks)))
    w = 0.8 / len(series)
    for k, (values, label, style) in enumerate(series):
        ax.bar([i - 0.4 + (k + 0.5) * w for i in x], values, w, label=label, **style)
    ax.set_xticks(x)
    small = {"fontsize": 8} if frames.layout is not None and frames.layout.world > 1 else {}
    ax.set_xticklabels([rank_tick(r, frames.layout) for r in ranks], **small)
    ax.set_xlim(-0.6, len(ranks) - 0.4)
    top = max((v for values, _, _ in series for v in values if v == v), default=0.0)
    ax.set_ylim(0, (top or 1.0) * 1.35)  # headroom: the legend never covers a bar
    ax.set_xlabel("rank")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8, loc="upper left", ncols=len(series), frameon=False)
    ax.grid(alpha=0.3, axis="y")


def figure_png(fig, dpi: int = 80) -> bytes:
    """Render a Figure to PNG bytes (Agg canvas; works in any thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
