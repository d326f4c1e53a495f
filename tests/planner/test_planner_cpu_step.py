"""Whole training steps of the real backend, 2 CPU ranks under torchrun, against the planner.

Each rank runs ``workbench.rank.train.Trainer`` (mcore DDP buffers, megatron's mixed-precision
optimizer, the 1F1B / interleaved schedules, TP / SP / distributed optimizer) inside an
allocation tracker (a ``TorchDispatchMode`` with weak references on storages) and reports,
per layout: the bytes alive after three steps (weights, grad buffer, master weights, Adam
moments) and the peak of the third step.  The planner predicts both for that rank with the
CPU kernel path (eager layer, megatron's cross entropy, torch's single-tensor AdamW, no
cuBLAS workspace).  What this cannot see: CUDA-only effects (workspaces, fused kernels,
allocator rounding) -- the GPU measurements in ``evidence/`` cover those.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BASE = {"train.precision": "bf16", "parallel.nproc_per_node": 2, "data.source": "synthetic", "train.eval_interval": 0,
        "train.train_iters": 3, "checkpoint.save_on_exit": False}
LAYOUTS = {
    "pp2": {"parallel.pipeline_parallel": 2, "train.global_batch_size": 8},
    "pp2-vpp2": {"parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2, "train.global_batch_size": 8},
    "tp2": {"parallel.tensor_parallel": 2},
    "tp2-sp-full-recompute": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.recompute": "full"},
    "dp2-distopt": {"parallel.distributed_optimizer": True},
    "tp2-sp-selective": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True, "parallel.recompute": "selective"},
    "tp2-local-attention": {"parallel.tensor_parallel": 2, "model.attention_backend": "local", "model.seq_length": 128},
    # activation-dominated (tiny vocab, longer sequences): the in-flight and backward terms carry the peak
    "act-pp2": {"parallel.pipeline_parallel": 2, "model.vocab_size": 64, "model.seq_length": 128,
                "train.micro_batch_size": 4, "train.global_batch_size": 16},
    "act-pp2-vpp2": {"parallel.pipeline_parallel": 2, "parallel.virtual_pipeline_parallel": 2, "model.vocab_size": 64,
                     "model.seq_length": 128, "train.micro_batch_size": 4, "train.global_batch_size": 16},
}


def _probe(layouts: dict[str, dict], scratch: str) -> None:
    """One torchrun rank: every layout in turn, one JSON line each (run directories under ``scratch``)."""
    import gc
    import tempfile

    import torch

    from workbench import planner
    from workbench.rank.train import Trainer
    from workbench.config import preset

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support (also when run as a torchrun script)
    from live_bytes import LiveBytes

    from megatron.core import parallel_state

    rank = int(os.environ["RANK"])
    assumptions = planner.PlannerAssumptions(transformer_engine=False, compiled_layer=False, optimizer="for-loop",
                                             cublas_workspace_bytes=0)
    for name, overrides in layouts.items():
        cfg = preset("tiny", **{**BASE, **overrides})
        trainer = Trainer(cfg, tempfile.mkdtemp(prefix=f"{name}-rank{rank}-", dir=scratch))
        tracker = LiveBytes()
        with tracker:
            trainer.setup()
            for _ in range(2):
                trainer.train_step()
            tracker.peak = tracker.cur
            trainer.train_step()
        plan = planner.predict(cfg.replace(**{"parallel.device": "cuda", "train.compile_kernels": False}), assumptions=assumptions)
        st = plan.stages[plan.ranks[rank].pp_rank]
        # megatron's global buffer (SP all-gather / local attention's baddbmm input) persists like the state
        static = sum(st.components[k] for k in ("weights", "gradients", "master_weights", "optimizer_moments"))
        static += st.detail["global_buffer"]
        print("RESULT " + json.dumps({"layout": name, "rank": rank, "measured_static": tracker.cur, "predicted_static": static,
                                      "measured_peak": tracker.peak, "predicted_peak": st.peak_allocated}), flush=True)
        trainer.events.close()
        del trainer, tracker
        gc.collect()
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from tests.support import torchrun_args  # here, not at the top: this file also runs as a torchrun script

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, *torchrun_args("2"),
           str(Path(__file__).resolve()), json.dumps(LAYOUTS), str(tmp_path_factory.mktemp("planner-step"))]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    print("\n".join(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")))
    out: dict[tuple[str, int], dict] = {}
    decoder = json.JSONDecoder()
    for chunk in proc.stdout.split("RESULT ")[1:]:  # two ranks share stdout: their lines can run together
        r, _ = decoder.raw_decode(chunk)
        out[(r["layout"], r["rank"])] = r
    assert len(out) == 2 * len(LAYOUTS), proc.stdout[-2000:]
    return out


CASES = [(name, rank) for name in LAYOUTS for rank in (0, 1)]
# The act-* pipelines keep some per-micro-batch tensors between steps in CPU mode (the backend turns
# deallocate_pipeline_outputs off on CPU), so only their step peak is compared.
STATIC_CASES = [(name, rank) for name, rank in CASES if not name.startswith("act-")]


@pytest.mark.slow
@pytest.mark.parametrize("layout,rank", STATIC_CASES)
def test_static_state_matches_backend(measured, layout, rank):
    r = measured[(layout, rank)]
    assert abs(r["predicted_static"] - r["measured_static"]) / r["measured_static"] < 0.02, r


@pytest.mark.slow
@pytest.mark.parametrize("layout,rank", CASES)
def test_step_peak_matches_backend(measured, layout, rank):
    r = measured[(layout, rank)]
    err = (r["predicted_peak"] - r["measured_peak"]) / r["measured_peak"]
    assert abs(err) < 0.06, (r, f"{100 * err:.1f}%")


if __name__ == "__main__":
    _probe(json.loads(sys.argv[1]), sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # gloo / CPU-mode teardown can hang; nothing is left to flush
