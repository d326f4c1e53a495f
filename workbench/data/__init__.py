"""Data: tokenizers, preprocessing to Megatron indexed datasets, the embedded demo corpus, inspection.

The tools on files, below the model families and the run config: nothing here knows a run config.  A run config's
datasets (checked before a launch, built on the ranks) are :mod:`workbench.datasets`; these tools on the command line
(``workbench preprocess``, ``tokenizer``, ``data``) are :mod:`workbench.data_cli`.

Light at import time: torch / megatron-core / tokenizers load inside the functions that need them.

- :mod:`workbench.data.tokenizer`  ``load_tokenizer(spec)``, ``train_tokenizer``
- :mod:`workbench.data.preprocess` ``preprocess(inputs, output_prefix, ...)`` -> ``PREFIX.bin/.idx``
- :mod:`workbench.data.indexed`    ``check_indexed(prefix)`` (.idx header / .bin size checks)
- :mod:`workbench.data.demo`       ``ensure_demo_dataset()`` (the embedded KJV corpus)
- :mod:`workbench.data.inspect`    ``inspect_dataset(prefix)``, ``plot_lengths``
"""

import sys

from workbench.data.errors import DataError  # noqa: F401

_LAZY = {
    "load_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "preprocess": "preprocess",
    "PreprocessSummary": "preprocess",
    "check_indexed": "indexed",
    "ensure_demo_dataset": "demo",
    "inspect_dataset": "inspect",
    "plot_lengths": "inspect",
}

__all__ = ["DataError", *_LAZY]


def __getattr__(name: str):
    """The re-exported names of :data:`_LAZY`, each module imported on first use (an import statement apiece)."""
    where = _LAZY.get(name)
    if where == "tokenizer":
        import workbench.data.tokenizer  # noqa: F401
    elif where == "preprocess":
        import workbench.data.preprocess  # noqa: F401
    elif where == "indexed":
        import workbench.data.indexed  # noqa: F401
    elif where == "demo":
        import workbench.data.demo  # noqa: F401
    elif where == "inspect":
        import workbench.data.inspect  # noqa: F401
    else:
        raise AttributeError(f"module 'workbench.data' has no attribute {name!r}")
    value = getattr(sys.modules[f"workbench.data.{where}"], name)  # the module, whatever the package's name binds
    globals()[name] = value  # the name, not the submodule of the same name the import bound here
    return value
