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


def test_preset_list_names_every_preset_with_family_and_size(capsys):
    from workbench.config import PRESETS

    assert main(["config", "preset", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(PRESETS)
    by_name = {line.split()[0]: line for line in lines}
    assert "gpt, 8.0B params (32 layers x hidden 4096" in by_name["llama3.1-8b"]
    assert "bert, 110.2M params" in by_name["bert-base"]
    assert "MoE 8 experts top-2" in by_name["mixtral-8x7b"] and "MoE" not in by_name["gpt2-small"]


def test_preset_without_a_name_or_list_exits_2_with_the_fix(capsys):
    assert main(["config", "preset"]) == 2
    assert "--list" in capsys.readouterr().err


def test_version_names_workbench_megatron_core_and_torch():
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "workbench.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (f"megatron-workbench {version('megatron-workbench')} "
                                f"(megatron-core {version('megatron-core')}, torch {version('torch')})")
