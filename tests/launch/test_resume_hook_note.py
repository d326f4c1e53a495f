"""A resume whose checkpoint recorded other hooks (``train.forward_step`` / ``train.loss_func``) than the
config's says so at launch: one line in the launcher's log and the launch notes, printed to the caller;
the ranks import only the config's own (:func:`workbench.checkpoint.hook_note`).

A checkpoint with the tiny model's parameter count in one tensor (real DCP files, real ``workbench.json``)
and the launch's fake rank (``tests.support.RANK_SCRIPT``) under the real supervisor and torchrun.
"""

from __future__ import annotations

import json

from workbench.config import preset
from workbench.launch import Run
from workbench.run.files import read_json

from tests.support import living, run_processes


def _checkpoint(root, cfg):
    import torch
    import torch.distributed.checkpoint as dcp

    from workbench.checkpoint import FORMAT, METADATA_FILE, TRACKER_FILE, file_manifest, iter_dir_name

    d = root / iter_dir_name(3)
    d.mkdir(parents=True)
    dcp.save({"w": torch.zeros(cfg.derived().params.total)}, checkpoint_id=str(d), no_dist=True)
    (d / METADATA_FILE).write_text(json.dumps({"format": FORMAT, "iteration": 3, "config": cfg.to_dict(),
                                               "has_optimizer": True, "files": file_manifest(d), "complete": True}))
    (root / TRACKER_FILE).write_text("3")
    return root


def _launch(cfg, tmp_path, rank_script):
    run = Run.launch(cfg, run_root=tmp_path / "runs", entry=[str(rank_script)], env={"FAKE_MODE": "ok"})
    try:
        assert run.wait(timeout=120) == "finished"
    finally:
        for p in living(run_processes(run.run_dir)):
            p.kill()
    return run


def test_a_resume_with_other_hooks_than_its_checkpoint_s_says_so_once(tmp_path, rank_script, capfd):
    base = preset("tiny", **{"parallel.device": "cpu", "parallel.nproc_per_node": 1, "data.source": "synthetic",
                             "train.train_iters": 6})
    saved = base.replace(**{"train.loss_func": "workbench.hooks:keytoken_weighted_loss"})
    ckpt = _checkpoint(tmp_path / "ckpt", saved)
    run = _launch(base.replace(**{"checkpoint.load_dir": str(ckpt)}), tmp_path, rank_script)
    err = capfd.readouterr().err
    log = (run.run_dir / "logs" / "launcher.log").read_text()
    lines = [ln for ln in log.splitlines() if "hooks differ from checkpoint" in ln]
    assert len(lines) == 1, log  # before: nothing at launch
    assert "'workbench.hooks:keytoken_weighted_loss', not imported" in lines[0], lines
    assert "train.loss_func: none in this run's config" in lines[0], lines
    assert lines[0] in err.splitlines(), err
    assert any("hooks differ" in n for n in read_json(run.run_dir / "launch.json")["notes"])

    same = _launch(saved.replace(**{"checkpoint.load_dir": str(ckpt), "name": "same"}), tmp_path, rank_script)
    assert "hooks differ" not in (same.run_dir / "logs" / "launcher.log").read_text()  # the same hooks: nothing to say
