"""The notebook tests' shared part: the checks of what each notebook of ``notebooks/`` shows when it runs with its own
defaults, and the headless run of those that run through papermill.

Each notebook runs with its defaults in CI headless through papermill (``workbench notebook run`` in a fresh
process: :func:`run_with_defaults`), and every one but the quickstart also through "Run All" in JupyterLab:

- :data:`PAPERMILL_RUNS`, the quickstart -- the README's main path (``tests/notebooks/test_notebooks.py``): its
  checks (:data:`PAPERMILL_CHECKS`) also read the ``metrics.json`` and the run directory that the injected ``out_dir``
  puts next to the executed notebook, and the command's own output (in JupyterLab it is driven by its widgets,
  ``tests/browser/test_notebooks_in_jupyterlab.py``);
- :data:`BROWSER_RUNS`, every other notebook: headless (``tests/notebooks/test_notebooks_headless.py``), and "Run All"
  in JupyterLab in headless Chromium (``tests/browser/test_notebook_runs_browser.py``), which applies the same checks
  to the copy JupyterLab saved.

Every run applies :func:`check_executed` and the notebook's entry of :data:`CHECKS`, which read only the executed
notebook's outputs and the run directories it names (``run directory: ...``, absolute paths).

The notebooks show results and never assert: a check that can fail belongs here.  Convention for notebook
authors: a cell tagged ``parameters`` declares ``ci = False`` (and ``out_dir = None`` if the notebook writes
``metrics.json`` for ``workbench sweep``, runs or exports); with its defaults the notebook must finish on
a 2-core CPU machine in a few minutes (it picks CPU-sized runs when no GPU is visible).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat

from workbench.run.reader import read_events

from tests.support import ROOT, run_in_fresh_process

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: the notebooks whose papermill run has checks of its own (``tests/notebooks/test_notebooks.py``)
PAPERMILL_RUNS = ("01_quickstart",)
#: the notebooks that run with their defaults in JupyterLab (``tests/browser/test_notebook_runs_browser.py``): every
#: other one, so a new notebook is covered there without being named anywhere
BROWSER_RUNS = tuple(p.stem for p in NOTEBOOKS if p.stem not in PAPERMILL_RUNS)
#: seconds one papermill attempt may take on a busy 2-core machine (a hung kernel is retried, see run_in_fresh_process)
SECONDS = {"01_quickstart": 600, "07_bert": 900, "08_t5": 600, "09_moe": 600}


def _parameters_cell(nb) -> str | None:
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            return cell.source
    return None


def _errors(nb) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def _text(cell) -> str:
    """What a cell printed or showed as text."""
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o.get("text", ""))
        elif "text/plain" in o.get("data", {}):
            out.append(o["data"]["text/plain"])
    return "".join(out)


def _cell(nb, needle: str):
    """The first code cell whose source contains ``needle``."""
    return next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"/{pattern}/ not in:\n{text[-2000:]}"
    return float(m.group(1))


def _run_dirs(nb) -> list[Path]:
    text = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    return [Path(p) for p in re.findall(r"run directory: (\S+)", text)]


def _losses(run_dir: Path) -> list[float]:
    return [e["loss"] for e in read_events(run_dir) if e["event"] == "step" and e.get("rank", 0) == 0]


def check_executed(nb, name: str) -> None:
    """What any notebook run with its defaults must be, whichever path ran it: written to the convention (a cell
    tagged ``parameters`` declaring ``ci = False``; no ``assert`` in its cells), no error output, nothing on stderr
    (JupyterLab's pink box: a warning or a progress bar a default run must not show), every code cell run."""
    params = _parameters_cell(nb)
    assert params is not None, f"{name}: no cell tagged 'parameters'"
    assert "ci = False" in params.replace("ci=False", "ci = False"), f"{name}: the parameters cell must declare ci = False"
    assert not [c for c in nb.cells if c.cell_type == "code" and re.search(r"^\s*assert\b", c.source, re.M)], \
        f"{name}: a notebook shows results; its checks belong in tests/support/notebook_checks.py"
    assert _errors(nb) == [], f"{name}: {_errors(nb)}"
    stderr = [(i, o.get("text", "")[:300]) for i, c in enumerate(nb.cells) if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stderr"]
    assert stderr == [], f"{name}: cells wrote to stderr: {stderr}"
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code"), f"{name}: a cell did not run"


def check_shows(nb, name: str) -> None:
    """:func:`check_executed`, then the notebook's own checks (:data:`CHECKS`), on the executed notebook ``nb``."""
    check_executed(nb, name)
    CHECKS.get(name, lambda nb: None)(nb)


def run_with_defaults(path: Path, tmp_path: Path) -> None:
    """Execute ``path`` with its own defaults (``workbench notebook run`` in a fresh process: papermill injects
    ``out_dir``) and check what it shows: it exits 0, the HTML written, :func:`check_shows`, and its papermill-only
    checks (:data:`PAPERMILL_CHECKS`)."""
    out = tmp_path / path.stem
    proc = run_in_fresh_process(
        [sys.executable, "-m", "workbench.cli", "notebook", "run", str(path), "--out", str(out), "--quiet", "--timeout", "900"],
        seconds=SECONDS.get(path.stem, 300))
    executed_path = out / f"{path.stem}.ipynb"
    assert proc.returncode == 0, f"{path.name} failed (exit {proc.returncode}): {proc.stderr[-3000:]}; executed notebook: {executed_path}"
    executed = nbformat.read(str(executed_path), as_version=4)
    html = out / f"{path.stem}.html"
    assert html.exists() and html.stat().st_size > 0
    check_shows(executed, path.stem)
    PAPERMILL_CHECKS.get(path.stem, lambda *a: None)(executed, out, proc)


def _check_quickstart(nb, out: Path, proc) -> None:
    """The quickstart's checks, papermill's run only: they read ``metrics.json`` in the injected ``out_dir``, the run
    beside it and the command's output (``config: ...``), as well as what the notebook shows."""
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished"
    assert metrics["eval_loss"] > 0 and metrics["iteration"] >= 1
    run_dir = Path(metrics["run_dir"])
    assert run_dir.is_relative_to(out)  # out_dir was injected: the run lives next to the notebook
    assert (run_dir / "exit_status.json").exists()
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")
    assert "CPU mode" in text  # says which mode it ran in
    # without a GPU the default preset (demo-small) is replaced by tiny: said in the notebook, in
    # metrics.json and in the command's output
    assert "preset 'demo-small' was replaced by 'tiny'" in text
    assert "preset 'demo-small' was replaced by 'tiny'" in metrics["config_note"]
    assert "config:" in proc.stdout and "replaced by 'tiny'" in proc.stdout
    losses = _losses(run_dir)
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0, losses  # it trained
    watched = _cell(nb, "watch(run)")
    assert "training" in figure_names(watched), "watch() should leave static plots"
    assert "->" in _text(_cell(nb, "generate_from_run("))
    # the run browser over the notebook's folder, this run alone in it: its table, its figure and its value at the end
    browser = _cell(nb, "RunBrowser(")
    assert figure_names(browser) == ["compare"], figure_names(browser)
    shown = _text(browser)
    assert "1 run under" in shown and run_dir.name in shown and f"values at step {metrics['iteration']}" in shown, shown


def _check_conversion(nb) -> None:
    assert re.search(r"max \|mcore - HF\| logits = \S+  ->  OK", _text(_cell(nb, "verify_against_hf(res.output")))
    assert "bit-identical: True" in _text(_cell(nb, "compare_hf_dirs(hf_dir, back.output)"))


def _check_generation(nb) -> None:
    assert "same seed, same tokens: True" in _text(_cell(nb, "same seed, same tokens"))
    # the demo GPT continues each prompt in words (where the checkout ships it; else the notebook said how to make it
    # and used a random GPT-2)
    setup = _text(_cell(nb, 'demo_checkpoint("gpt-tiny-kjv"'))
    if not _demo_shipped("gpt-tiny-kjv"):
        assert "the demo model 'gpt-tiny-kjv' is not in this checkout" in setup and "train_demo_models.py" in setup, setup
        return
    greedy = _text(_cell(nb, 'print("greedy:")')).split("greedy:", 1)[1]
    said = [ln.rsplit(" -> ", 1)[1] for ln in greedy.splitlines() if " -> " in ln]
    words = [re.findall(r"[A-Za-z]{2,}", s) for s in said]
    assert len(said) == 3 and all(len(w) >= 3 and len(set(w)) >= 2 and "\ufffd" not in s for w, s in zip(words, said)), greedy


def _check_data(nb) -> None:
    assert "decodes back to the same text: True" in _text(_cell(nb, "decodes back to the same text"))


#: the words behind the masks / sentinels of 07's and 08's examples (KJV: Genesis 1:1, 1:3, and the most
#: frequent frames of the corpus); the demo models must find all but one (the demo-wordpiece vocabulary is uncased)
BERT_WORDS = ["heaven", "light", "lord", "israel"]
T5_WORDS = ["heaven", "Moses", "Israel"]


def check_demo_bert(lines: list[str]) -> None:
    """The demo BERT's fill-mask lines (07): the top candidate is the verse's word (a plural counts: "the heavens and
    the earth") in all but one of :data:`BERT_WORDS`' masks, so no single word fills every mask."""
    best = [m.group(1) for m in (re.search(r"\['([^']+)' \d\.\d\d", ln) for ln in lines) if m][:len(BERT_WORDS)]
    right = [b.rstrip("s") == w for b, w in zip(best, BERT_WORDS)]
    assert len(best) == len(BERT_WORDS) and sum(right) >= len(BERT_WORDS) - 1, lines


def check_demo_t5(lines: list[str]) -> None:
    """The demo T5's greedy lines (08): every sentinel filled with words, not only more sentinels or word pieces, and
    at least one of :data:`T5_WORDS` (the shipped tiny T5 knows "Israel" only)."""
    said = [re.sub(r"<extra_id_\d+>|<\|endoftext\|>", " ", ln.rsplit("->", 1)[1]).strip(" '")
            for ln in lines if "->" in ln][:len(T5_WORDS)]
    assert len(said) == len(T5_WORDS) and all(re.search(r"[A-Za-z]{2,}", w) for w in said), lines
    assert sum(w in s for w, s in zip(T5_WORDS, said)) >= 1, lines


def _demo_shipped(name: str) -> bool:
    """Whether this checkout ships the demo model ``name`` (trained on a GPU by its recipe; until then the
    notebook says how to make it, and the checks of its answers do not apply)."""
    from workbench.notebook import DEMO_MODELS

    return (DEMO_MODELS / name / "config.json").is_file()


def _demo_lines(text: str, name: str) -> list[str] | None:
    """The lines a notebook printed for the shipped demo model (after "the demo model:"); None where the checkout
    lacks the model, after checking that the notebook said so and how to make it."""
    if not _demo_shipped(name):
        assert f"the demo model {name!r} is not in this checkout" in text and "train_demo_models.py" in text, text[-2000:]
        return None
    assert "the demo model:" in text, f"the demo model's answers are missing:\n{text[-2000:]}"
    return [ln.strip() for ln in text.split("the demo model:", 1)[1].splitlines() if ln.strip()]


def _check_bert(nb) -> None:
    pretrain, finetune = _run_dirs(nb)
    losses = _losses(pretrain)
    k = max(len(losses) // 8, 1)
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k - 0.3, "the masked-LM loss should fall clearly"
    # fill-mask: candidates quoted; the demo model fills in the verse's words
    fill = _text(_cell(nb, "fill_mask(ckpt, texts"))
    assert re.search(r"\['\S+' \d\.\d\d, ", fill), fill
    lines = _demo_lines(fill, "bert-tiny-kjv")
    if lines is not None:
        check_demo_bert(lines)
    conv = _text(_cell(nb, "hf_mlm_logits(hf_dir"))
    assert "mask token '[MASK]'" in conv and re.search(r"(\d+) tokens \(the run's demo-wordpiece: \1\)", conv), conv
    assert _number(r"max \|diff\| (\S+)\n", conv) < 1e-4
    assert "-> ok: True" in conv  # TP=2 on two CPU ranks against HF
    # fine-tuned from the demo model (else from the notebook's own short pretraining): held-out verses, half from
    # each testament, classified above chance (0.5)
    ev = [e for e in read_events(finetune) if e["event"] == "eval"][-1]
    assert ev["accuracy"] >= (0.7 if _demo_shipped("bert-tiny-kjv") else 0.55), ev
    tuned = _cell(nb, "held-out accuracy")
    assert f"{ev['accuracy']:.3f}" in _text(tuned)
    # the fine-tuning learns: its loss falls (from the demo model: 0.60 -> 0.23 over the first and last eighths of 150
    # steps; from the notebook's own short pretraining less), and the cell shows its loss and its accuracy by step
    # (the training figure, and compare_runs' figure of the step records' accuracy), named, so a saved notebook keeps them
    ft_losses = _losses(finetune)
    k = max(len(ft_losses) // 8, 1)
    margin = 0.2 if _demo_shipped("bert-tiny-kjv") else 0.0
    assert sum(ft_losses[-k:]) / k < sum(ft_losses[:k]) / k - margin, f"the fine-tuning loss should fall: {ft_losses}"
    assert {"training", "accuracy"} <= set(figure_names(tuned)), figure_names(tuned)


def _check_t5(nb) -> None:
    losses = _losses(_run_dirs(nb)[0])
    assert losses[-1] < losses[0] - 1.0, "the loss should fall"
    spans = _cell(nb, "random_spans_noise_mask(len(text)")
    assert "encoder:" in _text(spans) and _wrapped_between_words(spans)
    conv = _text(_cell(nb, "verify_against_hf(work"))
    assert "-> ok: True" in conv and "bit-exact: True" in conv, conv
    same = _text(_cell(nb, "ref.generate("))
    assert same.count("identical: True") == 2, same
    # the demo model fills each sentinel with words of the verse
    gen = _demo_lines(_text(_cell(nb, 'demo_checkpoint("t5-tiny-kjv"')), "t5-tiny-kjv")
    if gen is not None:
        check_demo_t5(gen)


def _wrapped_between_words(cell) -> bool:
    """Whether a cell showed its message as lines that wrap between words (``say``: JupyterLab's output ``pre``
    breaks long lines inside words otherwise)."""
    return any("word-break: normal" in o.get("data", {}).get("text/html", "") for o in cell.get("outputs", []))


def figure_names(cell) -> list[str | None]:
    """The run figures a cell output, by the name each PNG output carries (``workbench.widgets.dashboard.figure_image``;
    None for a PNG without one)."""
    return [o.get("metadata", {}).get("image/png", {}).get("workbench_figure")
            for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]


def _check_moe(nb) -> None:
    # the watching cell ends with the run's figures, the router dashboard among them (what a reopened notebook shows)
    assert {"training", "router"} <= set(figure_names(_cell(nb, "watch(run)"))), figure_names(_cell(nb, "watch(run)"))
    losses = _losses(_run_dirs(nb)[0])
    k = max(len(losses) // 4, 1)
    assert sum(losses[-k:]) / k < sum(losses[:k]) / k, "the MoE model's loss should fall"
    assert "dropless: every routed assignment served: True" in _text(_cell(nb, "load_table(run.reader)"))
    refused = _cell(nb, '"parallel.expert_parallel": 3')
    assert "is not divisible by expert_parallel 3" in _text(refused) and _wrapped_between_words(refused)


#: each notebook's own checks, on the executed notebook (either path: :func:`check_shows`)
CHECKS = {"04_checkpoint_conversion": _check_conversion, "05_generation": _check_generation, "06_data": _check_data,
          "07_bert": _check_bert, "08_t5": _check_t5, "09_moe": _check_moe}
#: the checks that need papermill's run: the injected ``out_dir`` and the command's output (:func:`run_with_defaults`)
PAPERMILL_CHECKS = {"01_quickstart": _check_quickstart}
