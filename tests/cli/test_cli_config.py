"""`workbench config ...`: exit codes and messages, in-process and through the console script."""

from __future__ import annotations

import subprocess
import sys

from workbench.cli import main
from workbench.config import load_config, preset

from tests.support import ACCELERATE_EXAMPLE


def test_validate_ok(tmp_path, capsys):
    path = preset("tiny").save(tmp_path / "tiny.yaml")
    assert main(["config", "validate", str(path)]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_lists_every_problem_and_exits_2(tmp_path, capsys):
    cfg = preset("tiny").replace(**{"model.num_layers": 3, "parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2,
                                    "parallel.pipeline_split": "even", "train.global_batch_size": 3})
    path = cfg.save(tmp_path / "bad.json")
    assert main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "parallel.pipeline_parallel" in err and "train.global_batch_size" in err
    assert "Traceback" not in err


def test_validate_typo_in_file(tmp_path, capsys):
    p = tmp_path / "typo.yaml"
    p.write_text("parallel:\n  tensor_paralel: 2\n")
    assert main(["config", "validate", str(p)]) == 2
    assert "did you mean 'tensor_parallel'" in capsys.readouterr().err


def test_from_accelerate_writes_a_valid_config(tmp_path, capsys):
    src = tmp_path / "acc.yaml"
    src.write_text(ACCELERATE_EXAMPLE)
    out = tmp_path / "run.yaml"
    assert main(["config", "from-accelerate", str(src), "-o", str(out)]) == 0
    cfg = load_config(out)
    assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, cfg.parallel.sequence_parallel) == (2, 2, True)


def test_console_script_exit_code(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"parallel": {"sequence_parallel": true}}')
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "config", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "parallel.sequence_parallel" in r.stderr and "tensor_parallel" in r.stderr
