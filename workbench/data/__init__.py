"""Data: tokenizers, preprocessing to Megatron indexed datasets, the embedded demo corpus, inspection.

Light at import time: torch / megatron-core / tokenizers load inside the functions that need them.

- :mod:`workbench.data.tokenizer`  ``load_tokenizer(spec)``, ``train_tokenizer``
- :mod:`workbench.data.preprocess` ``preprocess(inputs, output_prefix, ...)`` -> ``PREFIX.bin/.idx``
- :mod:`workbench.data.indexed`    ``check_indexed(prefix)`` (.idx header / .bin size checks)
- :mod:`workbench.data.megatron`   ``build_datasets(cfg, run_dir)`` -> megatron-core train/valid/test;
  ``check_data(cfg)`` -> config Problems, light, for launchers (before torchrun)
- :mod:`workbench.data.demo`       ``ensure_demo_dataset()`` (the embedded KJV corpus)
- :mod:`workbench.data.inspect`    ``inspect_dataset(prefix)``, ``plot_lengths``
"""

from workbench.data.cli import add_cli  # noqa: F401
from workbench.data.errors import DataError  # noqa: F401

_LAZY = {
    "load_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "preprocess": "preprocess",
    "PreprocessSummary": "preprocess",
    "check_indexed": "indexed",
    "build_datasets": "megatron",
    "dataset_sizes": "megatron",
    "check_data": "megatron",
    "ensure_demo_dataset": "demo",
    "inspect_dataset": "inspect",
    "plot_lengths": "inspect",
}

__all__ = ["add_cli", "DataError", *_LAZY]


def __getattr__(name: str):
    """The re-exported names of :data:`_LAZY`, each module imported on first use (an import statement apiece)."""
    where = _LAZY.get(name)
    if where == "tokenizer":
        from workbench.data import tokenizer as module
    elif where == "preprocess":
        from workbench.data import preprocess as module
    elif where == "indexed":
        from workbench.data import indexed as module
    elif where == "megatron":
        from workbench.data import megatron as module
    elif where == "demo":
        from workbench.data import demo as module
    elif where == "inspect":
        from workbench.data import inspect as module
    else:
        raise AttributeError(f"module 'workbench.data' has no attribute {name!r}")
    return getattr(module, name)
