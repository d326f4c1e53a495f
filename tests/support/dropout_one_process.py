"""Subprocess helper for tests/backend/test_compiled_dropout.py: ``dropout_check.py one-process``, then the backend's
``Trainer`` on given run directories, in one process (one start and one set of imports for both).

    python tests/support/dropout_one_process.py RUN_DIR...  -> JSON: dropout_check's one-process result

Each RUN_DIR holds a ``config.json``; after the checks, each runs as ``tests.support.trainer_runs`` runs it on one rank
(``Trainer(cfg, run_dir).run()``, megatron's model-parallel state torn down after each), on the compiled layer eagerly
(``compiled_layer.allow_on_cpu(True)``, ``set_compile(False)``) in the one-rank gloo world the checks set up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/support
import dropout_check  # noqa: E402
from compiled_layer_check import _exit  # noqa: E402


def main() -> int:
    from megatron.core import parallel_state

    from workbench.backend import compiled_layer
    from workbench.config import load_config
    from workbench.rank.train import Trainer

    res = dropout_check.check_one_process()
    compiled_layer.allow_on_cpu(True)
    compiled_layer.set_compile(False)
    for run_dir in sys.argv[1:]:
        code = Trainer(load_config(os.path.join(run_dir, "config.json")), run_dir).run()
        assert code == 0, (run_dir, code)
        parallel_state.destroy_model_parallel()
    print("RESULT " + json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    _exit(main())
