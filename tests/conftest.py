"""Fixtures that test folders share.  A fixture one folder alone needs lives in that folder's
``conftest.py`` (``checkpoints/``: a private copy of a checkpoint to damage; ``browser/``: JupyterLab and Chromium; ``slurm/``: a SLURM cluster).

Plain helpers (no fixtures) live in ``tests/support``; test files import those from there and
never from each other.

In parallel (``launch/test.sh`` runs pytest-xdist's workers with ``--dist loadfile``) a test file runs whole on
one worker, so its module fixtures are built once; each worker that runs browser tests starts its own JupyterLab
(``browser/conftest.py``: a folder per worker).  The workers take the files longest first (:data:`FILE_SECONDS`), so
no long file starts last while the other worker has nothing left to do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: one OpenMP thread per process, in this process and every process the tests start (JupyterLab's kernels, torchrun's
#: ranks, helper scripts), unless the caller set OMP_NUM_THREADS: the workers (two on the 2-core CI machine) and the
#: processes each starts share the cores, and torch's default of one OpenMP thread per core makes two such processes
#: spin against each other (measured on the 2-core machine: a t5-tiny 60-step run beside a busy torch process took
#: 117 s with the default threads, 50 s with one each, while the busy process got 26x more done).  The tiny CPU models
#: gain next to nothing from a second thread.  Many test files already passed OMP_NUM_THREADS=1 to their
#: subprocesses; this makes it the rule for all.  ``launch/test.sh`` exports the same.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules and os.environ["OMP_NUM_THREADS"] == "1":  # imported before this file (a plugin): too late
    sys.modules["torch"].set_num_threads(1)                          # for the variable, not for the setting

from tests.support import free_port as _free_port
from tests.support import hf_gpt2, write_rank_script
from workbench.config import preset


#: seconds the slowest test files took, each run alone (``-n 0``) on a busy 2-core machine: the order in which the
#: workers take files (longest first; every other file after these, in collection order).  A stale or missing number
#: only changes that order, never what runs.  Refresh from a serial run's ``--junitxml`` (each file's testcase times).
FILE_SECONDS = {
    "browser/test_long_notebook_runs_browser.py": 450, "browser/test_notebook_runs_browser.py": 300,
    "backend/test_compiled_layer_compile.py": 450,
    "notebooks/test_notebooks.py": 210, "notebooks/test_notebooks_headless.py": 420,
    "backend/test_compiled_layer.py": 250, "backend/test_compiled_layer_tp.py": 200, "launch/test_multinode.py": 170,
    "conversion/test_convert_streaming.py": 280, "models/test_t5_train.py": 240, "rank/test_rank_train.py": 300,
    "backend/test_compiled_dropout.py": 250, "conversion/test_conversion.py": 130, "launch/test_loopback_only.py": 180,
    "bench/test_family_bench_smoke.py": 155, "data_pipeline/test_preprocess_faults.py": 145,
    "backend/test_backend_model.py": 130, "backend/test_cross_layout_resume.py": 120,
    "conversion/test_two_rank_conversion.py": 115, "launch/test_run_lifecycle.py": 110,
    "checkpoints/test_checkpoint_hostile.py": 100, "checkpoints/test_checkpoint_metadata_faults.py": 60,
    "conversion/test_t5_conversion.py": 50, "models/test_bert_train.py": 85, "checkpoints/test_checkpoint_faults.py": 85,
    "widgets/test_widgets.py": 85, "conversion/test_conversion_heads.py": 85, "conversion/test_moe_conversion.py": 55,
    "advisor/test_advisor_cli.py": 80, "bench/test_bench_smoke.py": 75, "advisor/test_advisor_enumerate.py": 70,
    "conversion/test_bert_conversion.py": 70, "launch/test_checkpoint_writer.py": 65,
    "generation/test_generation_parallel.py": 65, "cli/test_warning_noise.py": 65,
    "docs/test_readme_tour.py": 200, "bench/test_moe_bench_smoke.py": 120, "docs/test_readme_multi_gpu.py": 120,
    "launch/test_startup_watch.py": 35, "generation/test_generate_progress.py": 60, "data_pipeline/test_demo_models.py": 60,
    "backend/test_context_parallel_training.py": 200, "backend/test_context_parallel.py": 60,
    "browser/test_run_browser_browser.py": 50,
}


def pytest_configure(config) -> None:
    # pytest-xdist (>= 3.8) would hand the files out by their number of tests, most first: the few-test files, often
    # the slowest, would start last.  Keep the order pytest_collection_modifyitems makes.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items) -> None:
    """The files of :data:`FILE_SECONDS` first, longest first; each file's tests together and in their own order."""
    first: dict[str, int] = {}
    seconds: dict[str, float] = {}
    for i, item in enumerate(items):
        f = item.nodeid.split("::", 1)[0]
        if f not in first:
            first[f] = i
            rel = f[len("tests/"):] if f.startswith("tests/") else f
            seconds[f] = FILE_SECONDS.get(rel, 0)
    items.sort(key=lambda item: (-seconds[item.nodeid.split("::", 1)[0]], first[item.nodeid.split("::", 1)[0]]))


def pytest_collection_finish(session) -> None:
    """Start the apt installs that browser/ and slurm/ need (Chromium; SLURM and munge) in the background once their
    tests are collected, in one process (xdist's first worker, or the only one): on a fresh machine they take a minute
    or more, which the first such test would otherwise spend waiting with its worker idle.  The folders' fixtures
    still install and check what they need themselves (one apt at a time: they wait for this one, then find it
    installed), and report any failure; a failure here is left to them."""
    import os
    import shutil
    import threading

    if (os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not hasattr(os, "geteuid") or os.geteuid() != 0
            or not shutil.which("apt-get")):
        return
    folders = [f for f in dict.fromkeys(item.nodeid.split("/")[1] for item in session.items if item.nodeid.count("/") > 1)
               if f in ("browser", "slurm")]
    if not folders:
        return
    from tests.support import apt_install

    def install() -> None:
        for folder in folders:
            try:
                if folder == "browser":
                    from tests.browser.conftest import CHROMIUM

                    apt_install(["chromium"], lambda: Path(CHROMIUM).exists())
                else:
                    from tests.slurm.conftest import PACKAGES, TOOLS, _which

                    apt_install(PACKAGES, lambda: all(_which(t) for t in TOOLS))
            except Exception:  # noqa: BLE001  (the folder's fixture installs again and reports it)
                pass

    threading.Thread(target=install, name="apt-prefetch", daemon=True).start()


@pytest.fixture()
def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 (for a rendezvous / master port)."""
    return _free_port()


@pytest.fixture()
def rank_script(tmp_path: Path) -> Path:
    """The launch's fake rank (``tests.support.RANK_SCRIPT``) as a script in this test's tmp dir."""
    return write_rank_script(tmp_path)


@pytest.fixture(scope="module")
def dist_group():
    """megatron-core's process groups over one CPU rank (gloo), for the tiny preset it yields (``backend/``,
    ``checkpoints/``)."""
    from workbench.backend import cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests

    cfg = preset("tiny")
    initialize_for_tests(cfg, port=_free_port())
    yield cfg
    destroy()
    cpu_mode.disable()


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory) -> Path:
    """Root of a real workbench checkpoint with a tokenizer, written by the product path: a random HF GPT-2
    (``tests.support.hf_gpt2``) and a small trained tokenizer in ``<root>/../hf``, converted by
    ``workbench.conversion.hf_to_megatron`` (fp32, 1 CPU process).  One per test module; tests never modify
    it (they damage a copy)."""
    from workbench.conversion import hf_to_megatron
    from workbench.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gpt2-checkpoint")
    hf_gpt2(seed=3).save_pretrained(root / "hf")
    train_tokenizer(["the cat sat on the mat", "a dog ran in the park"] * 20, vocab_size=300, out_dir=root / "hf")
    return hf_to_megatron(root / "hf", root / "ckpt", dtype="fp32", device="cpu", progress=False).output
