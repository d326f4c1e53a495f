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
    "load_tokenizer": "workbench.data.tokenizer",
    "train_tokenizer": "workbench.data.tokenizer",
    "Tokenizer": "workbench.data.tokenizer",
    "preprocess": "workbench.data.preprocess",
    "PreprocessSummary": "workbench.data.preprocess",
    "check_indexed": "workbench.data.indexed",
    "build_datasets": "workbench.data.megatron",
    "dataset_sizes": "workbench.data.megatron",
    "check_data": "workbench.data.megatron",
    "ensure_demo_dataset": "workbench.data.demo",
    "inspect_dataset": "workbench.data.inspect",
    "plot_lengths": "workbench.data.inspect",
}

__all__ = ["add_cli", "DataError", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.data' has no attribute {name!r}")
