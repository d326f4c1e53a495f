"""Notebook, papermill and sweep helpers: what the notebooks and ``workbench notebook run`` / ``sweep`` call.

- :func:`quickstart_config`: the quickstart notebook's config from its parameters, fitted to this machine.
- :func:`generate_from_run`: text from a finished run's latest checkpoint.
- :func:`demo_checkpoint`: a shipped demo model (trained longer than a notebook's CPU run) as a checkpoint.
- :func:`dashboard`: the live dashboard of a :class:`workbench.launch.Run`.
- :func:`notebook_dir`: where a notebook writes its runs, exports and demo files (one git-ignored directory).
- :func:`say`: ``print`` for a notebook, wrapped between words (:func:`workbench.plots.tables.say`).
- :func:`run_notebook` / :func:`sweep`: notebooks headless through papermill, once or over a grid,
  with :func:`record_metrics` as the notebook's side of the sweep table.

pandas, papermill and nbconvert are imported lazily.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from workbench import generation
from workbench.config import ConfigError, Problem, RunConfig, preset as make_preset
from workbench.launch import detect_gpus, new_run_dir
from workbench.data.demo import DEMO_MODELS, DEMO_MODELS_TRAINER
from workbench.checkpoint import TRACKER_FILE
from workbench.data.tokenizer import load_tokenizer
from workbench.run.files import read_json, write_json_atomic
from workbench.launch import Run
from workbench.plots.tables import say

__all__ = [
    "notebook_dir",
    "say",
    "quickstart_config",
    "generate_from_run",
    "demo_checkpoint",
    "DEMO_MODELS",
    "dashboard",
    "run_notebook",
    "NotebookResult",
    "record_metrics",
    "parse_grid",
    "sweep",
    "notebook_problem",
    "notebook_parameters",
    "parse_value",
]


def quickstart_config(preset_name: str = "demo-small", *, tp: int = 1, pp: int = 1, steps: int | None = None,
                      nproc: int | None = None, device: str = "auto", ci: bool = False) -> tuple[RunConfig, str]:
    """The quickstart notebook's config from its parameters, fitted to this machine; returns (config, note).

    device "auto": CUDA when GPUs are visible (asked of nvidia-smi; the kernel never touches
    CUDA), else the backend's CPU mode (gloo) with the tiny preset.  ``ci``: the tiny preset
    on CPU with a few steps.  The global batch is rounded to a multiple of micro-batch x dp.
    """
    notes = []
    gpus = detect_gpus()
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError([Problem("device", f"unknown device {device!r}", "use auto, cuda or cpu")])
    device_requested, asked = device, preset_name
    if ci:
        preset_name, device = "tiny", "cpu"
        steps = min(steps or 6, 6)
        notes.append("CI mode: the tiny preset in the backend's CPU mode (gloo), a few steps")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
        if not gpus:
            notes.append("no GPU visible: running in the backend's CPU mode (gloo) with the tiny preset")
    if device == "cpu" and preset_name != "tiny":
        if gpus or device_requested == "cpu":
            notes.append(f"preset {preset_name!r} is too large for CPU mode: using 'tiny'")
        preset_name = "tiny"
    cfg = make_preset(preset_name)
    model_parallel = max(tp, 1) * max(pp, 1)
    if nproc is None:
        nproc = model_parallel * max(gpus // model_parallel, 1) if device == "cuda" else model_parallel
    over: dict[str, Any] = {"parallel.tensor_parallel": tp, "parallel.pipeline_parallel": pp,
                            "parallel.nproc_per_node": nproc, "parallel.device": device}
    if device == "cpu" and cfg.train.precision == "fp16":
        over["train.precision"] = "fp32"
    if steps:
        over["train.train_iters"] = int(steps)
        over["train.lr_warmup_iters"] = min(cfg.train.lr_warmup_iters, max(int(steps) // 5, 0))
        if cfg.train.eval_interval > int(steps) or cfg.train.eval_interval == 0:
            over["train.eval_interval"] = max(int(steps) // 2, 1)
    cfg = cfg.replace(**over)
    dp = cfg.derived().data_parallel if nproc % model_parallel == 0 else 1
    unit = cfg.train.micro_batch_size * dp
    if cfg.train.global_batch_size % unit:
        cfg = cfg.replace(**{"train.global_batch_size": unit * max(cfg.train.global_batch_size // unit, 1)})
        notes.append(f"global batch rounded to {cfg.train.global_batch_size} (micro-batch {cfg.train.micro_batch_size} x dp {dp})")
    if cfg.data.tokenizer == "demo":
        try:
            vocab = load_tokenizer("demo").vocab_size
            if vocab > cfg.model.vocab_size:
                cfg = cfg.replace(**{"model.vocab_size": vocab})
                notes.append(f"model.vocab_size raised to the demo tokenizer's {vocab}")
        except Exception:
            pass
    note = f"{cfg.name}: device {device}, tp {tp} x pp {pp}, {nproc} process(es), {cfg.train.train_iters} steps"
    if preset_name != asked:  # never silently: the output, the notebook and metrics.json say so
        why = "CI mode" if ci else "device cpu" if device_requested == "cpu" else "no GPU visible"
        notes.insert(0, f"NOTE: preset {asked!r} was replaced by {preset_name!r} ({why}: CPU mode trains tiny models only)")
    return cfg, "; ".join([note, *notes])


def notebook_dir(out_dir: str | Path | None = None, *parts: str) -> Path:
    """Where a notebook writes what it makes (training runs, exported and converted models, demo checkpoints):
    ``out_dir`` when given (``workbench notebook run`` and papermill inject it: next to the executed notebook),
    else ``runs/notebooks/`` of this checkout, which git ignores (``/runs/`` in ``.gitignore``), wherever Jupyter
    started the kernel (``notebooks/``, the repository's root) -- or of ``$WORKBENCH_RUNS`` when set, or of the
    working directory outside a checkout.  ``parts`` name a sub-directory (not created)."""
    if out_dir:
        base = Path(out_dir)
    else:
        env = os.environ.get("WORKBENCH_RUNS")
        checkout = Path(__file__).resolve().parents[1]
        cwd = Path.cwd().resolve()
        if env:
            root = Path(env)
        elif (checkout / "notebooks").is_dir() and (cwd == checkout or checkout in cwd.parents):
            root = checkout / "runs"
        else:
            root = Path("runs")
        base = root.absolute() / "notebooks"
    return base.joinpath(*parts)


def generate_from_run(run: Run, prompts: Sequence[str] | str, **options: Any) -> list:
    """Generate text from a finished run's latest checkpoint (``workbench.generation``), or say why not.

    Returns the generation results, or an empty list with the reason printed (the run saved no checkpoint).
    """
    cfg = run.config
    root = Path(cfg.checkpoint.save_dir) if cfg and cfg.checkpoint.save_dir else run.run_dir / "checkpoints"
    if not (root / TRACKER_FILE).exists() and not list(root.glob("iter_*")):
        print(f"no checkpoint under {root} (status {run.status}): generation skipped")
        return []
    device = cfg.parallel.device if cfg else None
    return generation.generate(root, prompts, device=device, **options)


def demo_checkpoint(name: str, out_dir: str | Path) -> Path | None:
    """The shipped demo model ``name`` (e.g. ``bert-tiny-kjv``) as a workbench checkpoint under ``out_dir``.

    Converted once from its Hugging Face directory in :data:`DEMO_MODELS` (``hf_to_megatron``, fp32, CPU);
    prints what it is (its ``provenance.json``).  None, saying how to make it, when this checkout lacks it.
    """
    from workbench.conversion import hf_to_megatron

    src = DEMO_MODELS / name
    if not (src / "config.json").is_file():
        say(f"the demo model {name!r} is not in this checkout ({src}); make it with, from the repository's root: "
            f"python {DEMO_MODELS_TRAINER} --only {name}")
        return None
    dst = Path(out_dir) / name
    if not (dst / TRACKER_FILE).is_file():
        hf_to_megatron(src, dst, dtype="fp32", device="cpu", force=True, progress=False)
    prov = read_json(src / "provenance.json") or {}
    print(f"demo model {name}: {prov.get('summary', src)}")
    return dst


def dashboard(run: Run, **kwargs: Any):
    """A live ipywidgets dashboard for ``run`` (see :mod:`workbench.widgets.dashboard`)."""
    from workbench.widgets.dashboard import Dashboard

    return Dashboard(run, **kwargs)


# --------------------------------------------------------------------------- papermill


@dataclass
class NotebookResult:
    out_dir: Path
    notebook: Path  # the executed .ipynb
    html: Path | None
    error: str | None = None  # papermill's error (the failing cell) or None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


def notebook_parameters(path: Path) -> dict:
    import papermill

    try:
        return papermill.inspect_notebook(str(path))
    except Exception:
        return {}


def run_notebook(notebook: str | Path, parameters: dict | None = None, out_dir: str | Path | None = None, *,
                 runs_root: str | Path | None = None, html: bool = True, progress: bool = False,
                 kernel_name: str | None = None, timeout: float | None = None) -> NotebookResult:
    """Execute a notebook through papermill into ``out_dir`` (default ``runs/<name>-<timestamp>``).

    Writes ``<out_dir>/<name>.ipynb`` (executed) and ``<out_dir>/<name>.html``.  When the
    notebook declares an ``out_dir`` parameter it receives the output directory, so it can
    put its training runs and ``metrics.json`` next to the executed notebook.
    """
    import papermill as pm

    nb = Path(notebook)
    if not nb.exists():
        raise FileNotFoundError(f"notebook {nb} not found")
    out = Path(out_dir).absolute() if out_dir else new_run_dir(nb.stem, runs_root)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(parameters or {})
    declared = notebook_parameters(nb)
    if "out_dir" in declared and "out_dir" not in params:
        params["out_dir"] = str(out)
    executed = out / f"{nb.stem}.ipynb"
    t0 = time.time()
    error = None
    previous = os.environ.get("WORKBENCH_HEADLESS")
    os.environ["WORKBENCH_HEADLESS"] = "1"  # inherited by the kernel: watch() renders static plots
    try:
        pm.execute_notebook(str(nb), str(executed), parameters=params, kernel_name=kernel_name,
                            progress_bar=progress, log_output=False, execution_timeout=timeout,
                            cwd=os.getcwd())
    except pm.PapermillExecutionError as e:
        error = f"cell {e.exec_count}: {e.ename}: {e.evalue}"
    finally:
        if previous is None:
            os.environ.pop("WORKBENCH_HEADLESS", None)
        else:
            os.environ["WORKBENCH_HEADLESS"] = previous
    html_path = None
    if html and executed.exists():
        html_path = _export_html(executed)
    return NotebookResult(out, executed, html_path, error, time.time() - t0)


def _export_html(executed: Path) -> Path | None:
    try:
        import nbformat
        from nbconvert import HTMLExporter

        body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(executed), as_version=4))
        path = executed.with_suffix(".html")
        path.write_text(body, encoding="utf-8")
        return path
    except Exception as e:  # the executed notebook is the primary artefact; HTML is a convenience
        print(f"warning: HTML export of {executed} failed: {e}", file=sys.stderr)
        return None


def record_metrics(metrics: dict, out_dir: str | Path | None) -> Path | None:
    """Write a notebook's final metrics to ``<out_dir>/metrics.json`` (what ``workbench sweep`` collects)."""
    if not out_dir:
        return None
    path = Path(out_dir) / "metrics.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {k: v for k, v in metrics.items()})
    return path


def parse_value(text: str) -> Any:
    """A CLI value as Python: int, float (``1e-3`` too, which YAML 1.1 leaves a string), YAML scalar, else text."""
    import yaml

    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except Exception:
        return text


def parse_grid(items: Sequence[str]) -> dict[str, list]:
    """``["steps=5,10", "lr=1e-3"]`` -> ``{"steps": [5, 10], "lr": [0.001]}`` (values parsed as YAML scalars)."""
    grid: dict[str, list] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--grid {item!r}: expected NAME=V1,V2,...")
        name, values = item.split("=", 1)
        name = name.strip()
        if not name.isidentifier():
            raise ValueError(f"--grid {item!r}: {name!r} is not a parameter name")
        vals = [parse_value(v.strip()) for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--grid {item!r}: no values")
        grid[name] = vals
    return grid


def notebook_problem(notebook: str | Path) -> Problem | None:
    """Why ``notebook`` is not a notebook papermill can run (missing, not a file, not UTF-8, not a
    Jupyter notebook's JSON), naming the file and the fix; None when it is one."""
    nb = Path(notebook)
    fix = "pass a .ipynb notebook saved by Jupyter, such as notebooks/01_quickstart.ipynb"
    if not nb.exists():
        return Problem(str(nb), "notebook not found", fix)
    if not nb.is_file():
        return Problem(str(nb), "is not a file", fix)
    try:
        raw = nb.read_bytes()
    except OSError as e:
        return Problem(str(nb), f"cannot be read: {e.strerror or e}", "check the file's permissions")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Problem(str(nb), f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}), so not a notebook", fix)
    import nbformat

    try:
        nbformat.validate(nbformat.reads(text, as_version=4))
    except Exception as e:  # nbformat's errors for JSON that is no notebook are of many types
        return Problem(str(nb), f"is not a Jupyter notebook ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})", fix)
    return None


def sweep(notebook: str | Path, grid: dict[str, list], out_dir: str | Path, *, parameters: dict | None = None,
          html: bool = False, progress: bool = True):
    """Run ``notebook`` once per grid point into ``out_dir/<i>-k=v...``; collect metrics into ``out_dir/sweep.csv``.

    Each point's metrics come from the ``metrics.json`` the notebook wrote into its ``out_dir``
    (see :func:`record_metrics`).  Returns the table as a pandas DataFrame.  A notebook that is not one,
    a grid entry that is not a non-empty list, or an ``out_dir`` that is a file: :class:`ConfigError`
    before anything runs.
    """
    import pandas as pd
    from workbench.noise import progress_bar  # a text bar in a notebook kernel, no widget

    problems = [p for p in [notebook_problem(notebook)] if p is not None]
    problems += [Problem(f"grid.{k}", f"{v!r} is not a non-empty list of values", f"write it as {k}=[v1, v2, ...]")
                 for k, v in grid.items() if not isinstance(v, (list, tuple)) or not v]
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        problems.append(Problem(str(out_dir), "the sweep's output directory is a file", "pass a new or existing directory"))
    if problems:
        raise ConfigError(problems, "(sweep arguments)")
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    names = list(grid)
    points = [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]
    rows = []
    for i, point in enumerate(progress_bar(points, desc="sweep", disable=not progress)):
        label = "-".join(f"{k}={v}" for k, v in point.items())
        sub = out / re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{i:03d}-{label}")
        res = run_notebook(notebook, {**(parameters or {}), **point}, sub, html=html)
        metrics = read_json(sub / "metrics.json") or {}
        rows.append({**(parameters or {}), **point, "ok": res.ok, "error": res.error, **metrics, "notebook": str(res.notebook)})
    df = pd.DataFrame(rows)
    df.to_csv(out / "sweep.csv", index=False)
    return df


