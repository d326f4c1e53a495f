"""The fast path's optimizer where Transformer Engine (or apex) is importable: megatron would build their FusedAdam;
the workbench builds torch's AdamW (then its fused kernel), the same update.  TE's presence is simulated at the
boundary: megatron's own module-level choice (``USING_PYTORCH_OPTIMIZER`` False, ``Adam`` another class)."""

from __future__ import annotations

import megatron.core.optimizer as mopt
import pytest
import torch
from megatron.core.optimizer import OptimizerConfig

from workbench.backend import fusions
from workbench.config import preset


class _ForeignFusedAdam(torch.optim.Adam):
    """Stands in for TE's / apex's FusedAdam (takes their ``adam_w_mode`` argument)."""

    def __init__(self, params, adam_w_mode=True, **kw):
        kw.pop("capturable", None)
        super().__init__(params, **kw)


def _build(cfg) -> torch.optim.Optimizer:
    """megatron's param-group optimizer factory, under the workbench's choice, for a one-layer model."""
    model = torch.nn.Linear(16, 16)
    for p in model.parameters():
        p.requires_grad_(True)
    ocfg = OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01)
    groups = [{"params": list(model.parameters()), "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False,
               "is_decoupled_lr": False, "default_config": True}]
    with fusions.torch_adam(cfg):
        adam_cls = torch.optim.AdamW if mopt.USING_PYTORCH_OPTIMIZER else mopt.Adam
        kwargs = {} if mopt.USING_PYTORCH_OPTIMIZER else {"adam_w_mode": True}
        opt = adam_cls(groups, lr=ocfg.lr, weight_decay=ocfg.weight_decay, **kwargs)
    return opt


@pytest.fixture
def te_present(monkeypatch):
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(mopt, "Adam", _ForeignFusedAdam)


def test_the_fast_path_builds_torch_adamw_where_megatron_would_take_a_foreign_fused_adam(te_present):
    fusions.allow_on_cpu(True)
    try:
        fast = preset("tiny", **{"train.compile_kernels": True})
        assert type(_build(fast)) is torch.optim.AdamW
        assert mopt.USING_PYTORCH_OPTIMIZER is False  # megatron's own choice is restored afterwards
        stock = preset("tiny", **{"train.compile_kernels": False})
        assert type(_build(stock)) is _ForeignFusedAdam  # the stock path keeps megatron's choice
    finally:
        fusions.allow_on_cpu(False)


def test_megatrons_builder_reads_the_switch_the_workbench_sets():
    """The module-level flag is what megatron 0.19's Adam branch reads (a rename there would silently undo the choice)."""
    import inspect

    src = inspect.getsource(mopt._get_megatron_optimizer_based_on_param_groups)
    assert "if USING_PYTORCH_OPTIMIZER:" in src and "torch.optim.AdamW" in src
