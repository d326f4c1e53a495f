"""Data: tokenizers, preprocessing to Megatron indexed datasets, the embedded demo corpus, inspection.

Light at import time: torch / megatron-core / tokenizers load inside the functions that need them.
"""

from workbench.data.errors import DataError  # noqa: F401
