"""One policy for third-party noise: the torch and megatron-core warnings every command would print, several
times each, are shown once as one line or dropped where they say nothing.

- Warnings from megatron-core about missing Transformer Engine / Apex (five of them, from five
  modules) become one line per process; the other known megatron-core notices (absl, experimental
  MIMO config, deprecated CUDA-graph scope) are shown once, as one short line.
- Two log records that say nothing about what the workbench does are dropped: torch's "No CUDA runtime
  is found, using CUDA_HOME" (the workbench compiles no extension) and megatron-core's "MCore's async
  save is deprecated" (the workbench saves synchronously; megatron logs it for every save strategy).

Anything else passes through untouched. Installed by ``workbench/__init__.py`` before anything can import
megatron-core, so the CLI, the notebook kernel and every rank get it. Torch-free.

In a notebook kernel the same list decides, and the notes are not written at all: a kernel imports
megatron-core only to build datasets, convert and inspect (its ranks run in processes of their own, whose
logs keep the notes), and a note on stderr is a pink box on every default run that asks nothing of the
reader.  They are kept in :data:`DROPPED` (``workbench.noise.DROPPED``).  Hugging Face's progress bars
(transformers' "Loading weights" / "Writing model shards", hub downloads) are switched off there too
(:func:`quiet_notebook_progress`): they are ipywidgets that a saved and reopened notebook can no longer
draw ("Error displaying widget: model not found").  For the same reason the workbench's own progress bars (a
conversion's, preprocessing's) come from :func:`progress_bar`: a text bar on stdout in a kernel, which
a reopened notebook still shows, and tqdm's usual choice elsewhere.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Any

__all__ = ["quiet_third_party", "quiet_notebook_progress", "in_notebook_kernel", "progress_bar", "DROPPED",
           "TE_APEX_NOTE", "TE_PRESENT_NOTE"]

TE_APEX_NOTE = ("Transformer Engine / Apex not installed: megatron-core uses its torch fallbacks "
                "(expected on CPU; install them on GPUs for its fused kernels)")
#: the same warnings where Transformer Engine *is* usable (megatron also warns about apex-only pieces, or about
#: TE entry points a given TE version lacks): "not installed" would be wrong there
TE_PRESENT_NOTE = ("megatron-core fell back to torch for a piece Transformer Engine / Apex would provide "
                   "(Transformer Engine is installed and used; apex is not)")


def _te_apex_note() -> str:
    from workbench.kernel_rule import te_status  # torch-free; imported late: kernels imports this package

    return TE_PRESENT_NOTE if te_status()[0] == "ok" else TE_APEX_NOTE

#: (pattern on the warning text, the one line shown instead (or a function giving it); None: the warning's own
#: first sentence)
_WARNINGS: list[tuple[re.Pattern, Any]] = [
    (re.compile(r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"), _te_apex_note),
    (re.compile(r"absl\.logging is not installed"), None),
    (re.compile(r"MimoModelConfig is experimental"), None),
    (re.compile(r"full scope is deprecated"), None),
]
#: logger name -> pattern of records dropped
_LOGS = {
    "torch.utils.cpp_extension": re.compile(r"No CUDA runtime is found"),
    "megatron.core.dist_checkpointing.strategies.torch": re.compile(r"MCore's async save is deprecated"),
}
_shown: set[int] = set()
_installed = False
#: the notes a notebook kernel did not write (see the module docstring), in the order they came
DROPPED: list[str] = []


def in_notebook_kernel() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill): an IPython shell with a kernel attached."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except Exception:
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def quiet_notebook_progress() -> bool:
    """In a notebook kernel, switch off Hugging Face's progress bars (hub and transformers; see the module
    docstring); returns whether it did.  Elsewhere (the CLI, a script, a rank) nothing changes."""
    if not in_notebook_kernel():
        return False
    try:
        with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=0 set by the user wins, silently
            warnings.simplefilter("ignore")
            import huggingface_hub.utils

            huggingface_hub.utils.disable_progress_bars()  # transformers reads this when it is imported
            loaded = sys.modules.get("transformers.utils.logging")
            if loaded is not None:  # transformers was imported first: its own switch too
                loaded.disable_progress_bar()
    except Exception:
        return False
    return True


def progress_bar(iterable: Any = None, **kwargs: Any):
    """The workbench's progress bar: ``tqdm(iterable, **kwargs)``, chosen here once for every caller.

    In a notebook kernel a plain text bar on stdout (``tqdm.std``), never tqdm.auto's ipywidget, which a saved and
    reopened notebook can no longer draw ("Error displaying widget: model not found"), and nothing on stderr (a pink
    box on a default run).  It stays when done (``leave`` is ignored there: a text bar that clears itself would leave
    an empty output) and redraws at most once a second (each redraw is a message to the frontend and text in the
    saved notebook).  Elsewhere (a terminal, the CLI, a script) ``tqdm.auto`` with ``kwargs`` as given, as before."""
    if in_notebook_kernel():
        from tqdm.std import tqdm

        kwargs = {"mininterval": 1.0, **kwargs, "file": sys.stdout, "leave": True}
        return tqdm(iterable, **kwargs)
    from tqdm.auto import tqdm

    return tqdm(iterable, **kwargs)


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return not self.pattern.search(record.getMessage())
        except Exception:
            return True


def quiet_third_party() -> None:
    """Install the policy (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, pattern in _LOGS.items():
        logging.getLogger(name).addFilter(_Drop(pattern))
    original = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        for i, (pattern, summary) in enumerate(_WARNINGS):
            if pattern.search(text):
                if in_notebook_kernel():
                    DROPPED.append(text.split(". ")[0].strip())
                    return
                if i not in _shown:
                    _shown.add(i)
                    out = file if file is not None else sys.stderr
                    try:
                        note = summary() if callable(summary) else summary
                        out.write(f"[workbench] note: {note or text.split('. ')[0].strip()}\n")
                    except (OSError, ValueError):
                        pass
                return
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    # the same text from several call sites counts once (Python's default is once per location)
    for pattern, _ in _WARNINGS:
        warnings.filterwarnings("once", message=f".*{pattern.pattern}")
    quiet_notebook_progress()
