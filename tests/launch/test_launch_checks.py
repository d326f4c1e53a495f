"""The one launch path: ``workbench launch`` and ``Run.launch`` make the same checks, before anything starts."""

from __future__ import annotations

import pytest

from workbench.cli import main as cli_main
from workbench.config import ConfigError, preset
from workbench.launch import launch_checks
from workbench.launch import Run


def _problem_lines(text: str) -> list[str]:
    return sorted(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("- "))


def _both(cfg, tmp_path, capsys, *cli_args: str, **launch_kwargs):
    """(problems printed by the CLI, problems raised by Run.launch) for the same config."""
    path = tmp_path / "cfg.yaml"
    cfg.save(path)
    rc = cli_main(["launch", str(path), *cli_args])
    err = capsys.readouterr().err
    assert rc == 2, err
    with pytest.raises(ConfigError) as ei:
        Run.launch(cfg, **launch_kwargs)
    return _problem_lines(err), sorted(str(p) for p in ei.value.problems)


def test_same_invalid_config_same_problems(tmp_path, capsys):
    bad = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.tensor_parallel": 3, "parallel.nnodes": 2})
    cli, api = _both(bad, tmp_path, capsys, "--run-dir", str(tmp_path / "r1"), run_dir=tmp_path / "r2")
    assert cli == api and len(api) >= 2
    assert any(p.startswith("rdzv_endpoint:") for p in api)  # the multi-node check, worded once
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()  # nothing written, nothing started


def test_non_empty_run_dir_refused_by_both(tmp_path, capsys):
    run_dir = tmp_path / "used"
    run_dir.mkdir()
    (run_dir / "x").write_text("x")
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1})
    cli, api = _both(cfg, tmp_path, capsys, "--run-dir", str(run_dir), run_dir=run_dir)
    assert cli == api == [f"run_dir: {run_dir} exists and is not empty -> pass a new run_dir (or none for a fresh one)"]


def test_bad_node_rank_and_dry_run(tmp_path, capsys):
    cfg = preset("tiny").replace(**{"parallel.device": "cpu", "parallel.nproc_per_node": 1})
    cli, api = _both(cfg, tmp_path, capsys, "--node-rank", "3", node_rank=3)
    assert cli == api and api[0].startswith("node_rank: node_rank 3 is outside 0..0")
    assert [str(p) for p in launch_checks(cfg, local=False)] == []
    path = tmp_path / "ok.yaml"
    cfg.save(path)
    assert cli_main(["launch", str(path), "--dry-run", "--run-dir", str(tmp_path / "dry")]) == 0
    out = capsys.readouterr().out
    assert "workbench.launch.torchrun" in out and not (tmp_path / "dry").exists()
