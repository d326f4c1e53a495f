"""torchrun / SLURM command generation and the ``workbench launch | sweep | notebook`` CLI input checks."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.launch import LaunchPlan
from workbench.launch.slurm import batch_script
from workbench.notebook import parse_grid
from workbench.cli import main
from workbench.config import preset


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_single_node_command(tmp_path):
    plan = LaunchPlan(tmp_path / "r1", nproc_per_node=2)
    cmd = plan.command()
    assert cmd[:3] == [sys.executable, "-m", "workbench.launch.torchrun"]  # torch's torchrun, its stores on the named host only
    # one node: the c10d rendezvous on the loopback at a port the OS picks
    assert (_opt(cmd, "--rdzv-endpoint"), _opt(cmd, "--local-addr"), _opt(cmd, "--nnodes")) == ("127.0.0.1:0", "127.0.0.1", "1")
    assert _opt(cmd, "--nproc-per-node") == "2"
    # the backend entry and its arguments come after every torchrun option
    i = cmd.index("workbench.rank")
    assert cmd[i - 1] == "-m" and cmd[i + 1:] == ["--config", str(tmp_path / "r1" / "config.json"), "--run-dir", str(tmp_path / "r1")]
    assert Path(_opt(cmd, "--log-dir")).is_relative_to(tmp_path / "r1" / "logs")
    assert shlex.split(plan.shell()) == cmd


def test_multi_node_command_uses_rendezvous(tmp_path):
    plan = LaunchPlan(tmp_path / "r2", nproc_per_node=8, nnodes=4, node_rank=3, rdzv_endpoint="node0:29400")
    cmd = plan.command()
    assert "--standalone" not in cmd
    assert (_opt(cmd, "--nnodes"), _opt(cmd, "--node-rank"), _opt(cmd, "--rdzv-endpoint")) == ("4", "3", "node0:29400")
    assert _opt(cmd, "--nproc-per-node") == "8"


def test_slurm_script_is_valid_bash_with_srun_torchrun(tmp_path):
    plan = LaunchPlan(tmp_path / "r3", nproc_per_node=8, nnodes=2)
    script = batch_script(plan, partition="gpu", time_limit="01:00:00")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --time=01:00:00" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "-m workbench.launch.torchrun" in srun  # torch's torchrun, its store on the first node's address only
    joined = script.replace("\\\n", " ")
    assert '--nnodes "$SLURM_NNODES"' in joined and "--rdzv-backend c10d" in joined
    assert f"--config {tmp_path / 'r3' / 'config.json'}" in joined
    f = tmp_path / "job.sbatch"
    f.write_text(script)
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0
    assert "--gpus-per-node" not in batch_script(plan, gpus=False)


def test_cli_launch_dry_run_prints_exact_command(tmp_path, capsys):
    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": 2})
    f = cfg.save(tmp_path / "tiny.json")
    rd = tmp_path / "myrun"
    assert main(["launch", str(f), "--dry-run", "--run-dir", str(rd)]) == 0
    out = capsys.readouterr().out
    cmd_line = [ln for ln in out.splitlines() if "workbench.launch.torchrun" in ln][0]
    cmd = shlex.split(cmd_line)
    assert cmd == LaunchPlan(rd, 2).command()
    assert not rd.exists()  # a dry run starts and writes nothing
    assert main(["launch", str(f), "--dry-run", "--nproc-per-node", "1", "--run-dir", str(rd)]) == 0
    assert "--nproc-per-node 1" in capsys.readouterr().out
    # an override changes the world size, so the config is validated again: 4 ranks need gbs % (2*4) == 0
    assert main(["launch", str(f), "--dry-run", "--nproc-per-node", "4", "--run-dir", str(rd)]) == 2
    assert "train.global_batch_size" in capsys.readouterr().err


_which = shutil.which


def test_cli_launch_slurm_dry_run_and_script(tmp_path, capsys, monkeypatch):
    # a machine without SLURM: the script is written, not submitted (tests/slurm submits to a real one)
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None if name in ("sbatch", "squeue", "scancel") else _which(name, *a, **k))
    cfg = preset("tiny").replace(**{"parallel.nproc_per_node": 2, "parallel.nnodes": 2, "train.global_batch_size": 8})
    f = cfg.save(tmp_path / "two.yaml")
    assert main(["launch", str(f), "--slurm", "--dry-run", "--run-dir", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "srun " in out and "#SBATCH --nodes=2" in out
    assert main(["launch", str(f), "--slurm", "--run-dir", str(tmp_path / "s2")]) == 0
    assert (tmp_path / "s2" / "slurm.sbatch").exists() and (tmp_path / "s2" / "config.json").exists()
    assert "submit with: sbatch" in capsys.readouterr().out
    # multi-node without a rendezvous endpoint (and not via SLURM) is refused
    assert main(["launch", str(f), "--run-dir", str(tmp_path / "s3")]) == 2
    assert "--rdzv-endpoint" in capsys.readouterr().err
    assert not (tmp_path / "s3").exists()


def test_cli_launch_bad_input_exits_2(tmp_path, capsys):
    assert main(["launch", str(tmp_path / "missing.json")]) == 2
    assert "file not found" in capsys.readouterr().err
    bad = preset("tiny").replace(**{"model.num_attention_heads": 3, "parallel.nproc_per_node": 2})
    f = bad.save(tmp_path / "bad.json")
    assert main(["launch", str(f), "--run-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "model.hidden_size" in err and "->" in err
    assert not (tmp_path / "x").exists()


def test_grid_parsing():
    assert parse_grid(["steps=5,10", "lr=1e-3", "device=cpu"]) == {"steps": [5, 10], "lr": [0.001], "device": ["cpu"]}
    assert parse_grid(["ci=true,false"]) == {"ci": [True, False]}
    for bad in (["steps"], ["=1,2"], ["steps="]):
        with pytest.raises(ValueError):
            parse_grid(bad)


def test_cli_notebook_and_sweep_bad_input(tmp_path, capsys):
    assert main(["notebook", "run", str(tmp_path / "nope.ipynb")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["sweep", str(tmp_path / "nope.ipynb"), "--grid", "a=1", "--out", str(tmp_path / "o")]) == 2
    assert main(["sweep", str(tmp_path / "nope.ipynb"), "--grid", "a", "--out", str(tmp_path / "o")]) == 2
    assert "NAME=V1,V2" in capsys.readouterr().err
