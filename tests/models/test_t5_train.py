"""T5 through the real backend in CPU mode (torchrun, gloo): layouts against one process, resume, eval.

One random initial checkpoint is written first; every run loads it (``checkpoint.finetune``: weights
only, iteration 0), so all layouts start from the same weights.  Per-step losses (span-corruption LM
loss of the decoder, fp32) of TP=2 + SP, TP=2 with full recompute (the relative bias's gradient
across checkpointed chunks) and DP=2 with the distributed optimizer and selective recompute must match TP=1 within 1e-4 relative; a run resumed from the straight run's step-3 checkpoint must repeat its
steps 4-6 exactly; pipeline parallelism is refused before any process starts, with megatron-core's
reason.

Two launches for the runs (``tests.support.trainer_runs``, as ``test_bert_train.py``): one process writes the initial
checkpoint, runs TP=1 and then the resumed run; one torchrun of two ranks runs the three two-rank layouts one after
another (each the backend's Trainer with its own config and run directory).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.trainer_runs import run_trainers
from workbench.config import preset
from workbench.run.reader import read_events

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

INIT = r'''
import torch
from workbench.rank.build import build_model
from workbench.checkpoint import save_checkpoint
cfg = load_config(INIT_CONFIG)
distributed.initialize(cfg)  # torchrun set the rank and store
torch.manual_seed(cfg.train.seed)
save_checkpoint(INIT_DIR, 0, [build_model(cfg)], cfg)
parallel_state.destroy_model_parallel()
'''


def _cfg(**over):
    base = {"data.source": "synthetic", "train.train_iters": 6, "train.lr_decay_iters": 6, "train.global_batch_size": 8,
            "train.micro_batch_size": 2, "train.lr": 3e-3, "train.eval_interval": 3, "train.eval_iters": 1,
            "train.microbatch_timing_interval": 0, "checkpoint.save_interval": 0, "checkpoint.save_on_exit": False}
    base.update(over)
    return preset("t5-tiny", **base)


def _losses(events, kind="step"):
    return {e["iteration"]: e for e in events if e["event"] == kind and e.get("loss") is not None}


LAYOUTS = {
    "tp2_sp": {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True},
    "tp2_recompute_full": {"parallel.tensor_parallel": 2, "parallel.recompute": "full"},
    "dp2_distopt_selective": {"parallel.distributed_optimizer": True, "parallel.recompute": "selective"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the runs' root, the events of every run): TP=1 from the initial checkpoint for 6 steps (checkpoint at step 3),
    the run resumed from that checkpoint, and each two-rank layout from the initial checkpoint."""
    root = tmp_path_factory.mktemp("t5")
    init_cfg = root / "init.json"
    _cfg().save(init_cfg)
    start = {"checkpoint.load_dir": str(root / "init" / "iter_0000000"), "checkpoint.finetune": True}
    prelude = INIT.replace("INIT_CONFIG", repr(str(init_cfg))).replace("INIT_DIR", repr(str(root / "init")))
    run_trainers({root / "tp1": _cfg(**start, **{"checkpoint.save_interval": 3}),
                  root / "resumed": _cfg(**{"checkpoint.load_dir": str(root / "tp1" / "checkpoints" / "iter_0000003")})},
                 nproc=1, prelude=prelude)
    run_trainers({root / name: _cfg(**start, **over) for name, over in LAYOUTS.items()}, nproc=2, timeout=600)
    return root, {p.name: read_events(p) for p in root.iterdir() if (p / "events").is_dir()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_losses_match_one_process(runs, layout):
    ref_events, ev = runs[1]["tp1"], runs[1][layout]
    ref, got = _losses(ref_events), _losses(ev)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4, 5, 6]
    for it, e in got.items():
        r = ref[it]
        assert abs(e["loss"] - r["loss"]) <= 1e-4 * r["loss"], (layout, it, e["loss"], r["loss"])
    start = next(e for e in ev if e["event"] == "run_start")  # the layout each run had
    assert (start["world_size"], start["config"]["parallel"]["tensor_parallel"]) == (2, 2 if "tp2" in layout else 1)
    ref_eval, got_eval = _losses(ref_events, "eval"), _losses(ev, "eval")
    assert sorted(got_eval) == [3, 6]
    for it, e in got_eval.items():
        assert abs(e["loss"] - ref_eval[it]["loss"]) <= 1e-4 * ref_eval[it]["loss"]


def test_straight_run_learns_on_the_stock_layer(runs):
    ev = runs[1]["tp1"]
    start = next(e for e in ev if e["event"] == "run_start")
    assert "SDPA" in start["kernel_path"]["attention"] and start["kernels"]["layer"] == "stock"
    losses = _losses(ev)
    assert losses[6]["loss"] < losses[1]["loss"] - 0.2


def test_resume_repeats_the_straight_run_exactly(runs):
    ref, got = _losses(runs[1]["tp1"]), _losses(runs[1]["resumed"])
    assert sorted(got) == [4, 5, 6]
    for it, e in got.items():
        assert e["loss"] == ref[it]["loss"], (it, e["loss"], ref[it]["loss"])
        assert e["lr"] == ref[it]["lr"] and e["consumed_samples"] == ref[it]["consumed_samples"]


def test_pipeline_parallel_is_refused_with_the_reason(tmp_path, capfd, monkeypatch):
    """The rank's entry point (``workbench.rank.train.main``: what ``python -m workbench.rank`` runs under torchrun)
    refuses a two-rank PP=2 T5 config before any step, exit code 2 with megatron-core's reason.  Called in this process:
    the refusal is the config check at the top of ``main``, before any process group or model (a subprocess would only
    add the imports; ``rank/test_rank_train.py``'s bad-config test runs ``python -m workbench.rank`` itself)."""
    import faulthandler
    import signal

    from workbench.rank import train
    from workbench.rank.train import main

    # past a missed refusal main would train (and os._exit this process): the test fails there instead
    monkeypatch.setattr(train, "Trainer", lambda *a, **k: pytest.fail("the PP=2 T5 config was not refused"))
    run_dir = tmp_path / "pp2"
    run_dir.mkdir()
    cfg = _cfg(**{"parallel.pipeline_parallel": 2})
    cfg.parallel.nproc_per_node = 2
    cfg.save(run_dir / "config.json")
    try:
        code = main(["--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)])
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # main's stack dump on SIGUSR1 is a rank's, not this test process's
    out = capfd.readouterr()
    err = out.out + out.err
    assert code == 2, err[-3000:]
    assert "parallel.pipeline_parallel" in err and "removed in megatron-core 0.14" in err and "tensor_parallel" in err
    assert not (run_dir / "events").exists()


def test_workbench_generate_cli_on_the_trained_checkpoint(runs):
    """``workbench generate`` on a T5 checkpoint: text prompts through the checkpoint's demo-t5 tokenizer,
    greedy and beam search, the family's engine (encoder once, cached decoder)."""
    import json

    run_dir = runs[0] / "tp1"
    for mode in (["--greedy"], ["--num-beams", "3"]):
        proc = subprocess.run([PY, "-m", "workbench.cli", "generate", "--ckpt", str(run_dir / "checkpoints"), "--prompt",
                               "In the beginning <extra_id_0> created", "--prompt", "And God said", *mode,
                               "--max-new-tokens", "4", "--device", "cpu", "--json"],
                              cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout[proc.stdout.index("["):])
        assert len(out) == 2 and all(1 <= len(r["token_ids"]) <= 4 and isinstance(r["text"], str) for r in out)
