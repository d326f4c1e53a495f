"""Megatron Workbench: a Jupyter-first research workbench for megatron-core.

The notebook side (this package minus the rank side: ``workbench.backend``, ``workbench.models``,
``workbench.rank``) never imports megatron-core at module level and never touches CUDA: it builds
configs, plans memory, simulates schedules, launches ``torchrun`` and follows the event stream.
"""

from workbench.launch.ownership import guard_rank

# A rank of a supervised run dies with its torchrun, and no process of a run outlives its
# supervisor (a no-op outside a run: see workbench/launch/ownership.py).
guard_rank()

from workbench.noise import quiet_third_party  # noqa: E402

# torch / megatron-core warnings every command printed (CUDA_HOME, TE/Apex missing x5, deprecated
# async save): each known one once, as one line, or dropped where it says nothing (workbench/noise.py)
quiet_third_party()

from workbench.kernel_rule import guard_transformer_engine  # noqa: E402

# A Transformer Engine that is installed but broken would fail megatron-core's own import (and
# with it the whole backend): found and hidden here, before anything can import megatron-core.
guard_transformer_engine()

from workbench.lazy_compile import install as defer_megatron_fusers  # noqa: E402

# megatron-core's fused functions compiled at their first call, not at its import (which would import torch's
# whole compiler stack in every rank and helper process): workbench/lazy_compile.py
defer_megatron_fusers()

from workbench.config import RunConfig, preset, load_config, ConfigError  # noqa: E402,F401

__version__ = "0.1.0"
