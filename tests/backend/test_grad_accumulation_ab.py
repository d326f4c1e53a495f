"""The workbench's main_grad accumulation (workbench.backend.grad_accumulation) against megatron DDP's own add, end
to end: the same bf16 run on PP=2 x VPP=2 x DP=2 with the distributed optimizer and overlapped gradient reduction,
once as the kernel rule has it and once with the hook never installed (megatron's own path).  Losses and gradient
norms must be identical, step for step: a double-counted or missed micro-batch would change them."""

from __future__ import annotations

from workbench.config import preset
from workbench.run.reader import read_events

from tests.support.trainer_runs import run_trainers

# both runs in one launch (the ranks start once): the workbench run with the hook on every parameter (the tiny model's
# parameters are all under the shipped MIN_NUMEL, so hook every one, so the comparison means something); the run in a
# directory named "megatron" with the hook never installed (megatron's own path).  install() only touches the model it
# is given (per-parameter hooks), so nothing of the first run carries into the second.
BOTH = """
import os
from workbench.backend import grad_accumulation
from workbench.rank import train
grad_accumulation.MIN_NUMEL = 0
_install, _run = grad_accumulation.install, train.Trainer.run
def _run_as_named(self, *a, **k):
    megatrons_own = os.path.basename(os.path.normpath(str(self.run_dir))) == "megatron"
    grad_accumulation.install = (lambda chunks: 0) if megatrons_own else _install
    return _run(self, *a, **k)
train.Trainer.run = _run_as_named
"""


def _steps(run_dir):
    return sorted((e["iteration"], e.get("rank", 0), e["loss"], e.get("grad_norm"))
                  for e in read_events(run_dir) if e["event"] == "step" and e.get("loss") is not None)


def test_pp2_vpp2_dp2_distributed_optimizer_trains_as_with_megatrons_own_accumulation(tmp_path):
    cfg = preset("tiny", **{"data.source": "synthetic", "model.num_layers": 4, "train.train_iters": 3,
                            "train.lr_decay_iters": 3, "train.global_batch_size": 8, "train.precision": "bf16",
                            "train.eval_interval": 0, "train.microbatch_timing_interval": 0,
                            "checkpoint.save_interval": 0, "checkpoint.save_on_exit": False,
                            "parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2,
                            "parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True})
    run_trainers({tmp_path / "megatron": cfg, tmp_path / "workbench": cfg}, nproc=4, timeout=600,
                 prelude=BOTH)
    ours, theirs = _steps(tmp_path / "workbench"), _steps(tmp_path / "megatron")
    assert sorted({s[0] for s in ours}) == [1, 2, 3] and all(s[3] is not None for s in ours)
    assert ours == theirs
    kp = next(e for e in read_events(tmp_path / "workbench") if e["event"] == "run_start")["kernel_path"]
    assert kp["grad_accumulation"].startswith("workbench on ") and not kp["grad_accumulation"].startswith("workbench on 0 ")
    # the megatron run really had no hook (the per-run switch in BOTH took)
    kp = next(e for e in read_events(tmp_path / "megatron") if e["event"] == "run_start")["kernel_path"]
    assert kp["grad_accumulation"].startswith("workbench on 0 "), kp["grad_accumulation"]
