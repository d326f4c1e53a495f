"""``workbench launch --dry-run`` refuses what the real launch refuses (the run directory included)."""

from __future__ import annotations

from workbench.cli import main as cli_main
from workbench.config import preset


def _cfg_file(tmp_path, **over):
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1, **over})
    return str(cfg.save(tmp_path / "cfg.yaml"))


def test_dry_run_refuses_a_run_dir_that_is_a_file(tmp_path, capsys):
    f = _cfg_file(tmp_path)
    target = tmp_path / "a-file"
    target.write_text("not a run directory")
    assert cli_main(["launch", f, "--run-dir", str(target)]) == 2
    real = capsys.readouterr().err
    assert cli_main(["launch", f, "--dry-run", "--run-dir", str(target)]) == 2
    dry = capsys.readouterr().err
    assert f"run_dir: {target} exists and is not a directory" in dry
    assert dry == real
    assert target.read_text() == "not a run directory"


def test_dry_run_refuses_a_used_run_dir(tmp_path, capsys):
    f = _cfg_file(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")
    assert cli_main(["launch", f, "--dry-run", "--run-dir", str(used)]) == 2
    assert f"run_dir: {used} exists and is not empty" in capsys.readouterr().err


def test_dry_run_of_several_nodes_needs_the_shared_run_dir(tmp_path, capsys):
    f = _cfg_file(tmp_path, **{"parallel.nnodes": 2})
    args = ["launch", f, "--rdzv-endpoint", "127.0.0.1:29511"]
    assert cli_main([*args, "--dry-run"]) == 2
    assert "--run-dir: 2 nodes write into one run directory" in capsys.readouterr().err
    assert cli_main([*args, "--dry-run", "--run-dir", str(tmp_path / "shared")]) == 0
    assert not (tmp_path / "shared").exists()
