"""Megatron Workbench: a Jupyter-first research workbench for megatron-core.

The notebook side (this package minus ``workbench.backend``) never imports megatron-core
at module level and never touches CUDA: it builds configs, plans memory, simulates
schedules, launches ``torchrun`` and follows the event stream.
"""

from workbench.config import RunConfig, preset, load_config, ConfigError  # noqa: F401

__version__ = "0.1.0"
