"""The embedded corpus trains: real torchrun, the real backend, two ranks building the data together.

With an empty data cache, local rank 0 tokenizes the demo corpus while rank 1 waits at the
barrier, megatron-core builds the GPTDataset indices on rank 0 and rank 1 loads them, then the
``tiny`` preset trains on the text and its held-out loss falls well below chance (ln 4096).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest

from workbench.config import preset
from workbench.run.reader import read_events

from tests.support import torchrun_args, free_port


@pytest.mark.slow
def test_tiny_preset_trains_on_the_demo_corpus_with_two_ranks(tmp_path):
    cfg = preset("tiny", **{"parallel.nproc_per_node": 2, "train.train_iters": 30, "train.eval_interval": 15,
                            "train.lr": 3e-3, "train.min_lr": 3e-4, "data.cache_dir": str(tmp_path / "cache")})
    assert cfg.data.source == "demo" and not cfg.validate()
    run = tmp_path / "run"
    run.mkdir()
    cfg.save(run / "config.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, *torchrun_args("2"), "-m", "workbench.rank", "--config", str(run / "config.json"), "--run-dir", str(run)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    events = list(read_events(run))
    starts = [e for e in events if e["event"] == "run_start"]
    assert len(starts) == 2 and all("demo" in str(e.get("data")) for e in starts)
    ends = [e for e in events if e["event"] == "run_end"]
    assert sorted(e["rank"] for e in ends) == [0, 1] and all(e["status"] == "finished" for e in ends)
    evals = sorted({(e["iteration"], e["loss"]) for e in events if e["event"] == "eval"})
    assert [it for it, _ in evals] == [15, 30]
    chance = math.log(4096)
    assert evals[0][1] < chance - 1.0  # learned the corpus's token statistics
    assert evals[1][1] < evals[0][1] - 0.1  # and keeps improving on held-out chapters

    # the demo dataset was tokenized once, completely, and megatron-core's indices were cached
    demo_files = sorted(p.name for p in (tmp_path / "cache" / "demo").iterdir())
    assert [f for f in demo_files if f.endswith(".bin")] and len([f for f in demo_files if f.endswith(".idx")]) == 1
    assert not [f for f in demo_files if ".tmp-" in f]  # (a .lock file may stay: it is only a lock)
    assert [p for p in (tmp_path / "cache").iterdir() if p.name.endswith("shuffle_index.npy")]


def test_prefetch_keeps_the_micro_batch_order():
    """The trainer prefetches the next micro-batch mid-step: same batches, same order, none lost."""
    import torch

    from workbench.rank.data import MicroBatchStream
    from workbench.models.gpt.data import SyntheticGPTDataset

    cfg = preset("tiny", **{"train.micro_batch_size": 2, "train.global_batch_size": 6})
    ds = SyntheticGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    plain = MicroBatchStream(ds, cfg, 0, consumed_samples=4)
    ahead = MicroBatchStream(ds, cfg, 0, consumed_samples=4)
    want = [next(plain)["tokens"] for _ in range(7)]
    got = []
    for i in range(7):
        if i % 3 == 1:
            ahead.prefetch()
            ahead.prefetch()  # idempotent: still one batch ahead
        got.append(next(ahead)["tokens"])
    assert len({tuple(t.flatten().tolist()) for t in want}) == 7  # distinct batches, so order is checked
    for a, b in zip(want, got):
        assert torch.equal(a, b)


EXITS_WITHOUT_CLOSE = """
from workbench.rank.data import MicroBatchStream
from workbench.config import preset
from workbench.models.bert.data import SyntheticBertDataset

cfg = preset("bert-tiny", **{"train.micro_batch_size": 2, "train.global_batch_size": 8})
stream = MicroBatchStream(SyntheticBertDataset(cfg.model.vocab_size, cfg.model.seq_length, 0), cfg, 0, workers=2)
next(stream)
keep = [stream, lambda: keep]  # a reference cycle, as a trainer's bound methods make: no __del__ before exit
import multiprocessing.util  # its exit handler is registered again here, after the stream (get_logger does that)
multiprocessing.util.get_logger()
print(" ".join(str(w.pid) for w in stream._loader._workers), flush=True)
"""


def test_a_process_that_never_closes_its_stream_still_exits_and_ends_its_workers():
    """Loader workers ignore SIGTERM, so multiprocessing's exit path (terminate, then join) would wait on them for
    ever: the stream closes itself at exit (the bench's worker processes hung 200 s each)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", EXITS_WITHOUT_CLOSE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    time.sleep(0.5)
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"loader worker {pid} outlived its process")


def test_loader_workers_build_the_same_micro_batches_in_order():
    """``data.num_workers`` processes (forked, GPU runs) build exactly the inline stream's micro-batches, in the
    sampler's order, from a resumed ``consumed_samples``, over several steps; a signal to the process group leaves
    them to their rank (they ignore SIGINT / SIGTERM); CPU mode keeps them inline."""
    import torch

    from workbench.rank.data import MicroBatchStream, loader_workers
    from workbench.models.bert.data import SyntheticBertDataset

    cfg = preset("bert-tiny", **{"train.micro_batch_size": 2, "train.global_batch_size": 8})
    ds = SyntheticBertDataset(cfg.model.vocab_size, cfg.model.seq_length, cfg.train.seed)
    inline = MicroBatchStream(ds, cfg, 0, consumed_samples=8)
    loaded = MicroBatchStream(ds, cfg, 0, consumed_samples=8, workers=2)
    try:
        for i in range(3 * 4):  # three steps of four micro-batches: the workers take turns
            if i == 5:  # a SIGTERM / SIGINT to the process group is the rank's to handle: its workers ignore it
                for w in loaded._loader._workers:
                    os.kill(w.pid, signal.SIGTERM)
                    os.kill(w.pid, signal.SIGINT)
                time.sleep(0.3)
                assert all(w.is_alive() for w in loaded._loader._workers)
            a, b = next(inline), next(loaded)
            assert a.keys() == b.keys()
            for key in a:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    finally:
        loaded.close()
    assert loaded._loader is None
    assert loader_workers(cfg) == 0 and cfg.data.num_workers == 2  # CPU mode: inline whatever the field says
    cfg.parallel.device = "cuda"
    assert loader_workers(cfg) == 2
