"""The layout advisor: every valid layout of a model on a set of GPUs, ranked by predicted speed.

``advise(cfg, gpus, gpu="H100-80GB", nodes=1, top=20)`` enumerates every layout the config validator
accepts (TP, PP, VPP, DP, SP, distributed optimizer, recompute, micro-batch size, FP8 recipe:
:mod:`~workbench.advisor.enumerate`), predicts each one's tokens/s, MFU and what its step time is
spent on (:mod:`~workbench.advisor.perf_model`, on a calibration profile:
:mod:`~workbench.advisor.profile`, shipped for H100 and H200 and measured by ``workbench calibrate``),
and asks the memory planner whether it fits.  ``workbench advise`` / ``workbench calibrate`` are
the command lines (:mod:`~workbench.advisor.cli`); ``workbench.widgets.advisor`` the notebook widget.
Torch-free (``workbench calibrate``'s ranks import torch in their own processes).
"""

from __future__ import annotations

from workbench.advisor.advise import Advice, AdvisedLayout, advise, format_advice
from workbench.advisor.cli import add_cli
from workbench.advisor.enumerate import Layout, apply_layout, enumerate_layouts
from workbench.advisor.perf_model import Constants, Model, Prediction
from workbench.advisor.profile import Profile, ProfileError, default_profile, load_profile

__all__ = ["advise", "Advice", "AdvisedLayout", "format_advice", "add_cli", "Layout", "apply_layout", "enumerate_layouts",
           "Constants", "Model", "Prediction", "Profile", "ProfileError", "default_profile", "load_profile"]
