"""The host paths of every step over many parameters and modules (``workbench.backend.optimizer_paths``'s per-parameter
fallbacks) and the rank's garbage collection (``workbench.rank.collector``) keep what megatron and Python do."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch


def test_foreach_copy_rounds_like_megatrons_loop():
    from megatron.core.optimizer import optimizer as mopt

    from workbench.backend import optimizer_paths

    g = torch.Generator().manual_seed(5)
    main = [torch.randn(n, generator=g) * 3 for n in (1, 17, 4096)] + [torch.randn(8, 33, generator=g)]
    ours = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    theirs = [torch.zeros_like(t, dtype=torch.bfloat16) for t in main]
    if mopt._multi_tensor_copy_this_to_that is not optimizer_paths.foreach_copy_this_to_that:
        mopt._multi_tensor_copy_this_to_that(main, theirs, None)  # megatron's own (bf16: its Python loop)
    else:  # installed by an earlier test in this process: the loop it replaced
        for a, b in zip(main, theirs):
            b.copy_(a)
    optimizer_paths.foreach_copy_this_to_that(main, ours, None)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert all(torch.equal(a, m.to(torch.bfloat16)) for a, m in zip(ours, main))
    buf = torch.ones(1, dtype=torch.int)
    back = [torch.zeros_like(m) for m in main]
    optimizer_paths.foreach_copy_this_to_that(ours, back, buf)  # the fp16 path's signature: the flag cleared
    assert int(buf) == 0 and all(torch.equal(b, o.float()) for b, o in zip(back, ours))
    optimizer_paths.foreach_copy_this_to_that([], [], None)  # nothing to copy: no error


class _Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("local_tokens_per_expert", torch.zeros(4))


class _Balanced(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resets = 0
        self.qb_beta_accum = torch.zeros(3)
        self.qb_beta_count = torch.zeros(1)

    def reset_global_aux_loss_tracker(self) -> None:
        self.resets += 1


def _chunk() -> torch.nn.Module:
    layers = torch.nn.ModuleList()
    for _ in range(3):
        layers.append(torch.nn.Sequential(torch.nn.Linear(2, 2), _Router(), _Balanced(), torch.nn.ModuleList(
            torch.nn.Linear(2, 2) for _ in range(5))))
    return torch.nn.Sequential(layers)


def _dirty(chunk: torch.nn.Module) -> None:
    for m in chunk.modules():
        if isinstance(m, _Router):
            m.local_tokens_per_expert.fill_(7)
        if isinstance(m, _Balanced):
            m.qb_beta_accum.fill_(2)
            m.qb_beta_count.fill_(1)


def _state(chunk: torch.nn.Module) -> list:
    out = []
    for m in chunk.modules():
        if isinstance(m, _Router):
            out.append(m.local_tokens_per_expert.tolist())
        if isinstance(m, _Balanced):
            out.append((m.resets, m.qb_beta_accum.tolist(), m.qb_beta_count.tolist()))
    return out


@pytest.mark.parametrize("balancing", ["aux_loss", "global_aux_loss"])
def test_temporaries_reset_on_their_holders_like_megatron_and_found_once(monkeypatch, balancing):
    from workbench.backend import optimizer_paths

    fmg = optimizer_paths._finalize_module()

    monkeypatch.setattr(fmg, "reset_model_temporary_tensors", fmg.reset_model_temporary_tensors)  # restored after
    monkeypatch.setattr(optimizer_paths, "STATE", dict(optimizer_paths.STATE))
    # megatron's own function, also where an earlier test in this process installed the replacement
    megatron_reset = (optimizer_paths._MEGATRON_RESET[0]
                      if fmg.reset_model_temporary_tensors is optimizer_paths.reset_temporaries_of_holders
                      else fmg.reset_model_temporary_tensors)
    assert megatron_reset.__module__ == "megatron.core.distributed.finalize_model_grads"
    config = types.SimpleNamespace(moe_router_enable_expert_bias=True, moe_router_load_balancing_type=balancing)
    megatrons, ours = _chunk(), _chunk()
    for c in (megatrons, ours):
        _dirty(c)
    megatron_reset(config, [megatrons])
    optimizer_paths.install_per_parameter_fallbacks()
    assert fmg.reset_model_temporary_tensors is optimizer_paths.reset_temporaries_of_holders
    optimizer_paths.install_per_parameter_fallbacks()  # idempotent: megatron's stays the one it calls
    fmg.reset_model_temporary_tensors(config, [ours])
    dirty = _chunk()
    _dirty(dirty)
    assert _state(ours) == _state(megatrons) and _state(ours) != _state(dirty)  # reset, as megatron resets

    # the next step: the holders found at the first are reset again without walking the chunk's modules
    def walked():
        raise AssertionError("the chunk's modules walked again")
    _dirty(ours)
    _dirty(megatrons)
    with monkeypatch.context() as mp:
        mp.setattr(ours, "modules", walked)
        fmg.reset_model_temporary_tensors(config, [ours])
    megatron_reset(config, [megatrons])
    assert _state(ours) == _state(megatrons)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_step_collector_collects_cycles_at_the_step_end_and_restores_the_collector(monkeypatch):
    from workbench.rank import collector
    from workbench.rank.collector import WARM_STEPS, StepCollector

    monkeypatch.setattr(collector, "FULL_EVERY", WARM_STEPS + 3)
    gc.unfreeze()  # (what another test froze): this collector then unfreezes what it froze at its end
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    col = StepCollector()
    col.after_step()  # not entered: nothing happens
    assert col.steps == 0 and gc.isenabled() == enabled
    with col:
        assert not gc.isenabled() and col.active
        assert gc.get_freeze_count() > frozen  # what lives for the run is set aside
        for step in range(1, WARM_STEPS + 4):
            c = _Cycle()
            alive = weakref.ref(c)
            del c
            for _ in range(2000):  # allocations that would have started the automatic collector
                _Cycle()
            assert alive() is not None  # a cycle outlives nothing inside the step...
            if step == WARM_STEPS + 1:
                kept = _Cycle()  # ...nor, once the warm steps are over, a cycle that outlives its step
                old = weakref.ref(kept)
            col.after_step()
            assert alive() is None  # ...and the step's own cycles go at its end
            if step == WARM_STEPS + 1:
                del kept
            elif step == WARM_STEPS + 2:
                assert old() is not None  # outlived its step: left to the next full pass (young passes only)
        assert old() is None  # the full pass, FULL_EVERY steps in
        assert col.steps == WARM_STEPS + 3 and col.last_ms >= 0
    assert gc.isenabled() == enabled and gc.get_freeze_count() == 0 and not col.active

    gc.freeze()  # someone froze objects before the loop started: they stay frozen after it
    before = gc.get_freeze_count()
    with StepCollector():
        pass
    assert gc.get_freeze_count() >= before > 0
    gc.unfreeze()
