"""``Run.stacks()`` after a stalled run has ended still gives the stacks the stall watch gathered
(``stall_stacks.txt``), not ``{}``.

Two fake ranks (``tests.support.RANK_SCRIPT``, mode ``stall``: two steps, then no progress) under the
real supervisor and torchrun; the watch's floor is lowered so the stall comes in seconds.
"""

from __future__ import annotations

import pytest

from workbench.config import preset
from workbench.launch import Run

from tests.support import RANK_SCRIPT, living, run_processes


@pytest.mark.slow
def test_stacks_of_a_stalled_run_outlive_its_ranks(tmp_path):
    # the supervisor knows a rank by ``workbench.rank`` in its command line: the fake rank's file name carries it
    rank_script = tmp_path / "workbench.rank.fake_rank.py"
    rank_script.write_text(RANK_SCRIPT)
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 2})
    run = Run.launch(cfg, run_root=tmp_path / "runs", entry=[str(rank_script)], env={"FAKE_MODE": "stall"},
                     stall_floor=2, startup_timeout=120)
    try:
        assert run.wait(timeout=180) == "failed"
        assert run.exit_status["reason"] == "stalled", run.exit_status
        assert not living(run_processes(run.run_dir))
        stacks = run.stacks()
        assert sorted(stacks) == [0, 1], stacks  # before: {} once the ranks were gone
        for r in (0, 1):
            assert "in wait_for" in stacks[r] and "fake_rank.py" in stacks[r], stacks[r]  # faulthandler's dump
        assert "=== rank" not in "".join(stacks.values())
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()
