"""workbench.layout.Layout: one typed parallel layout, its ranks as megatron-core lays them out.

The coordinates are checked against megatron-core's own ``RankGenerator`` (pure Python: the rank groups
``initialize_model_parallel`` creates, without torch.distributed), built the way ``initialize_model_parallel``
builds its decoder and expert generators; the rules against :func:`workbench.config.validate`'s output.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from workbench.config import PRESETS, derive, preset, validate
from workbench.layout import MEGATRON_ORDER, Coords, Layout
from workbench.families.common import moe

#: (world, tp, pp, ep, etp): dense, TP x PP x DP, uneven sizes, expert grids narrower and wider than the dense one
COMBOS = [
    (1, 1, 1, 1, None),
    (8, 2, 2, 1, None),
    (8, 1, 1, 1, None),
    (12, 3, 2, 1, None),
    (24, 2, 3, 1, None),
    (16, 2, 2, 2, None),
    (8, 2, 1, 2, None),
    (8, 2, 1, 4, 1),
    (8, 1, 1, 4, 2),
    (24, 2, 2, 3, 1),
    (32, 4, 2, 2, 2),
    (12, 1, 3, 2, None),
]


def _megatron(world, tp, pp, ep, etp):
    """megatron-core's (decoder, expert) rank generators, as initialize_model_parallel builds them."""
    from megatron.core.parallel_state import RankGenerator

    etp = etp or tp
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=MEGATRON_ORDER)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=MEGATRON_ORDER)
    return dense, expert


@pytest.mark.parametrize("world,tp,pp,ep,etp", COMBOS)
def test_coords_and_groups_match_megatron(world, tp, pp, ep, etp):
    lay = Layout(world=world, tp=tp, pp=pp, ep=ep, etp=etp)
    dense, expert = _megatron(world, tp, pp, ep, etp)
    # (our dimension, megatron's generator, megatron's token)
    dims = [("tp", dense, "tp"), ("cp", dense, "cp"), ("dp", dense, "dp"), ("pp", dense, "pp"),
            ("etp", expert, "tp"), ("ep", expert, "ep"), ("edp", expert, "dp"), ("tp-pp", dense, "tp-pp"),
            ("etp-ep", expert, "tp-ep")]
    for ours, gen, token in dims:
        groups = gen.get_ranks(token)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for group in groups:
            for i, r in enumerate(group):
                assert lay.ranks_of(ours, r) == tuple(group), (ours, r)
                if "-" not in ours:
                    assert getattr(lay.coords(r), ours) == i, (ours, r)  # the group rank megatron gives r


def test_coords_by_hand_tp_fastest_then_dp_then_pp():
    """World 8, tp 2, pp 2 (dp 2): tp varies fastest, then dp, then pp (megatron's 'tp-cp-ep-dp-pp')."""
    lay = Layout(world=8, tp=2, pp=2)
    assert lay.dp == 2
    got = [(c.tp, c.dp, c.pp) for c in map(lay.coords, range(8))]
    assert got == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert lay.coords(5) == Coords(tp=1, cp=0, dp=0, pp=1, etp=1, ep=0, edp=0)
    assert lay.ranks_of("dp", 1) == (1, 3)
    assert lay.ranks_of("pp", 1) == (1, 5)
    assert lay.ranks_of("tp", 6) == (6, 7)


def test_expert_grid_by_hand():
    """World 8, tp 2, ep 2 (etp = tp): etp fastest, then ep, then expert dp; the dense dp spans both ep ranks."""
    lay = Layout(world=8, tp=2, ep=2)
    assert (lay.dp, lay.etp, lay.expert_data_parallel) == (4, 2, 2)
    assert [(c.etp, c.ep, c.edp) for c in map(lay.coords, range(4))] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert lay.coords(4).edp == 1 and lay.coords(4).dp == 2
    assert lay.ranks_of("ep", 0) == (0, 2)


def test_sizes():
    lay = Layout(world=32, tp=4, pp=2, vpp=3, ep=2, etp=1, nnodes=4, nproc_per_node=8)
    assert (lay.dp, lay.model_parallel, lay.model_chunks, lay.expert_model_parallel, lay.expert_data_parallel) == (4, 8, 3, 4, 8)
    assert lay.divisible and lay.cp == 1
    assert Layout(world=8, tp=3).dp == 2 and not Layout(world=8, tp=3).divisible  # rounded down, as derive() does
    assert Layout(world=4).nproc_per_node == 4 and Layout(world=4).model_chunks == 1


def test_no_coords_without_a_whole_grid():
    with pytest.raises(ValueError, match="not divisible"):
        Layout(world=6, tp=4).coords(0)
    with pytest.raises(ValueError, match="outside"):
        Layout(world=4, tp=2).coords(4)
    with pytest.raises(ValueError, match="unknown dimension"):
        Layout(world=4, tp=2).ranks_of("tp-ep", 0)


def test_context_parallel_divides_the_world():
    """CP is offered: the world splits into tp*cp*pp blocks, data parallel = world / (tp*cp*pp)."""
    assert Layout(world=4, cp=2).problems() == [] and Layout(world=4, cp=2).dp == 2
    assert Layout(world=8, tp=2, cp=2).dp == 2
    (q,) = Layout(world=6, tp=2, cp=2).problems()
    assert q.field == "parallel.nproc_per_node" and "tp*cp*pp = 4" in q.rule and "parallel.context_parallel" in q.reads
    assert Layout(world=4).problems() == []


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("over", [{}, {"parallel.nproc_per_node": 8, "parallel.tensor_parallel": 2},
                                  {"parallel.nnodes": 2, "parallel.nproc_per_node": 4, "parallel.pipeline_parallel": 2}])
def test_of_presets(name, over):
    cfg = preset(name, **over)
    p, lay = cfg.parallel, Layout.of(cfg)
    assert (lay.world, lay.tp, lay.pp, lay.vpp, lay.ep) == (p.world_size, p.tensor_parallel, p.pipeline_parallel,
                                                               p.virtual_pipeline_parallel, p.expert_parallel)
    assert (lay.nnodes, lay.nproc_per_node, lay.cp) == (p.nnodes, p.nproc_per_node, 1)
    assert lay.etp == moe.expert_tensor_parallel(cfg)
    assert lay.dp == derive(cfg).data_parallel == p.world_size // (p.tensor_parallel * p.pipeline_parallel)
    assert lay.expert_data_parallel == moe.expert_data_parallel(cfg)


@pytest.mark.parametrize("over", [
    {"parallel.nproc_per_node": 6, "parallel.tensor_parallel": 4},
    {"parallel.nproc_per_node": 3, "parallel.pipeline_parallel": 2},
    {"parallel.nnodes": 3, "parallel.nproc_per_node": 2, "parallel.tensor_parallel": 4},
])
def test_problems_are_validates(over):
    cfg = preset("tiny", **over)
    (q,) = Layout.of(cfg).problems()
    got = [x for x in validate(cfg) if x.field == q.field]
    assert [(x.field, x.rule, x.fix) for x in got] == [(q.field, q.rule, q.fix)]
    assert q.rule == (f"world size {cfg.parallel.world_size} (nnodes*nproc_per_node) is not divisible by tp*pp = "
                      f"{cfg.parallel.tensor_parallel * cfg.parallel.pipeline_parallel}")


def test_expert_problems_are_validates():
    cfg = preset("moe-tiny", **{"parallel.nproc_per_node": 6, "parallel.expert_parallel": 4})
    lay = Layout.of(cfg)
    assert lay.problems() == []
    (q,) = lay.expert_problems()
    got = [(x.field, x.rule, x.fix) for x in validate(cfg) if x.field == "parallel.expert_parallel"]
    assert (q.field, q.rule, q.fix) in got
    assert "expert grid" in q.rule and "1 x 4 x 1" in q.rule


def test_torch_free():
    code = "import sys, workbench.layout; assert not any(m.split('.')[0] in ('torch', 'megatron') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)
