"""A training run's checkpoint metadata under faults and tampering, with real torchrun ranks in CPU mode:

- the disk fills up while rank 0 writes ``workbench.json`` (``WORKBENCH_FAULT=meta:...:oserror=28``): every rank
  stops with the same error naming the file, the cause and the fix (no bare ``OSError``, no rank left waiting),
  the run ends ``failed``, the last complete checkpoint stays the latest and nothing half-written is left;
- a resume from a checkpoint whose ``workbench.json`` names hooks (a package on the ranks' path that writes a
  marker when imported) imports only the hooks of its own config and says that they differ.

One run with the full disk (a module fixture): its first test checks how it failed; the resume test tampers with a
copy of the complete checkpoint it left (iteration 2), so no second run is trained only to have a checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import RANK_ENV, ROOT, checkpointing_run_config, torchrun_args
from workbench.checkpoint import TRACKER_FILE, find_checkpoint, verify_checkpoint
from workbench.run.reader import read_events

ENV = RANK_ENV


_cfg = checkpointing_run_config


def _run(cfg, run_dir: Path, env: dict, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(run_dir / "config.json")
    cmd = [sys.executable, *torchrun_args("2"),
           "-m", "workbench.rank", "--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _by(events, kind, rank=None):
    return [e for e in events if e["event"] == kind and (rank is None or e["rank"] == rank)]


@pytest.fixture(scope="module")
def full_disk_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A run whose rank 0 finds the disk full while it writes iteration 4's ``workbench.json`` (the one at iteration 2
    is written): its run directory and its torchrun.  Tests read it; they change only copies."""
    run_dir = tmp_path_factory.mktemp("metadata-faults") / "full"
    return run_dir, _run(_cfg(), run_dir, {**ENV, "WORKBENCH_FAULT": "meta:4:0:oserror=28"})


def test_a_full_disk_while_workbench_json_is_written_fails_every_rank_with_the_fix(full_disk_run):
    run_dir, proc = full_disk_run
    assert proc.returncode != 0
    assert "Traceback" not in proc.stdout
    ev = read_events(run_dir)
    for rank in (0, 1):  # the same error on both ranks: rank 1 is told, not left waiting at a barrier
        errors = _by(ev, "error", rank)
        assert errors, (rank, proc.stdout[-2000:] + proc.stderr[-4000:])
        msg = errors[0]["message"]
        assert "iteration 4 failed on rank 0 while writing its workbench.json" in msg, msg
        assert "No space left on device" in msg and "MiB free on" in msg, msg
        assert "free disk space" in msg and "the last complete checkpoint (iteration 2) is intact" in msg, msg
        assert _by(ev, "run_end", rank)[0]["status"] == "failed"
    ckpts = run_dir / "checkpoints"
    assert (ckpts / TRACKER_FILE).read_text().strip() == "2"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000002"]  # nothing half-written left
    found = find_checkpoint(ckpts)
    assert found.name == "iter_0000002"
    verify_checkpoint(found)


def test_a_resume_imports_only_its_own_hooks_and_says_they_differ(full_disk_run, tmp_path):
    import json

    ckpts = tmp_path / "checkpoints"  # a copy of the complete checkpoint (iteration 2) of the full-disk run
    shutil.copytree(full_disk_run[0] / "checkpoints", ckpts)
    assert find_checkpoint(ckpts).name == "iter_0000002"
    meta_file = find_checkpoint(ckpts) / "workbench.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["train"]["forward_step"] = "evil_hooks_pkg.steps:f"  # what a tampered checkpoint records
    meta_file.write_text(json.dumps(meta))

    code = tmp_path / "code"
    (code / "evil_hooks_pkg").mkdir(parents=True)
    marker = tmp_path / "MARKER"
    payload = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\ndef f(*a, **k):\n    return None\n"
    (code / "evil_hooks_pkg" / "__init__.py").write_text(payload)
    (code / "evil_hooks_pkg" / "steps.py").write_text(payload)
    env = {**ENV, "PYTHONPATH": f"{code}:{ROOT}"}  # the package is importable by the ranks
    resumed = tmp_path / "resumed"
    proc = _run(_cfg(**{"checkpoint.load_dir": str(ckpts), "checkpoint.save_interval": 0}), resumed, env, cwd=code)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert not marker.exists(), marker.read_text()
    out = proc.stdout + proc.stderr
    assert "hooks differ from checkpoint" in out and "'evil_hooks_pkg.steps:f', not imported" in out, out[-3000:]
    assert "train.forward_step: none in this run's config" in out
    assert [e["iteration"] for e in _by(read_events(resumed), "step", 0)] == [3, 4, 5, 6]
