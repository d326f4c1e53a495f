"""What a hostile or damaged checkpoint can make the workbench do: run nothing, load nothing silently.

- ``workbench.json`` names ``train.forward_step`` / ``train.loss_func`` (a package and a module on ``sys.path``
  that write a marker file when imported): generating (CLI and Python, its rank process included), reshaping,
  exporting, inspecting, verifying and the launch pre-check never import them; a resume says which hooks it
  imports when they differ from the checkpoint's.
- A ``common.pt`` (megatron-core's legacy common state, which it unpickles with the environment's
  ``weights_only``) runs nothing even under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, and one that the checksum
  list does not name is refused outright.
- The newest iteration with an unreadable ``workbench.json`` and a resume that would train 0 steps are refused
  with the file / field and the fix, never turned into an older load or an empty "finished" run.

One real checkpoint (a random HF GPT-2 through ``hf_to_megatron``, 1 CPU process); each test poisons a copy.
"""

from __future__ import annotations

import builtins
import json
import shutil
import subprocess
import sys

import pytest

from tests.support import ROOT
from workbench.checkpoint import CheckpointError, find_checkpoint
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


def _edit_meta(d, **changes):
    f = d / "workbench.json"
    meta = json.loads(f.read_text())
    for key, value in changes.items():
        cur = meta
        *parents, last = key.split(".")
        for p in parents:
            cur = cur[p]
        cur[last] = value
    f.write_text(json.dumps(meta))


@pytest.fixture()
def hostile_hooks(ckpt, tmp_path, monkeypatch):
    """The checkpoint's config names a package and a module that, imported, write ``marker``; both are on
    ``sys.path`` here and in every subprocess (their directory is the working directory and on PYTHONPATH)."""
    root, d = ckpt
    code = tmp_path / "code"
    (code / "evil_hooks_pkg").mkdir(parents=True)
    marker = tmp_path / "MARKER"
    payload = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\ndef f(*a, **k):\n    return None\n"
    (code / "evil_hooks_pkg" / "__init__.py").write_text(payload)
    (code / "evil_hooks_pkg" / "steps.py").write_text(payload)
    (code / "evil_hooks_mod.py").write_text(payload)
    _edit_meta(d, **{"config.train.forward_step": "evil_hooks_pkg.steps:f", "config.train.loss_func": "evil_hooks_mod:f"})
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.chdir(code)
    monkeypatch.setenv("PYTHONPATH", f"{code}:{ROOT}")
    for name in ("evil_hooks_pkg", "evil_hooks_pkg.steps", "evil_hooks_mod"):
        sys.modules.pop(name, None)
    return root, d, marker


def test_the_marker_runs_when_imported(hostile_hooks):
    """The payload is live: importing what the checkpoint names does write the marker (so its absence below means
    that nothing imported it)."""
    import importlib.util

    _, _, marker = hostile_hooks
    importlib.util.find_spec("evil_hooks_pkg.steps")  # importing the parent package runs its payload
    assert marker.read_text() == "evil_hooks_pkg\n"
    sys.modules.pop("evil_hooks_pkg", None)


def test_generating_from_a_checkpoint_never_imports_its_hooks(hostile_hooks, capsys):
    from workbench.generation import generate

    root, _, marker = hostile_hooks
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu", "--max-new-tokens", "1"], capsys)
    assert rc == 0, out
    res = generate(root, ["the cat"], max_new_tokens=1, greedy=True, device="cpu")  # Python API, its rank process too
    assert len(res[0].token_ids) == 1
    assert not marker.exists(), marker.read_text()


def test_converting_inspecting_and_prechecking_never_import_its_hooks(hostile_hooks, tmp_path, capsys):
    from workbench.config import preset
    from workbench.launch import launch_problems

    root, d, marker = hostile_hooks
    rc, out = run_cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"], capsys)
    assert rc == 0, out
    assert "evil_hooks_pkg.steps:f" in out and "never imports" in out  # said, and left out of the written config
    written = json.loads((tmp_path / "rs" / "workbench_config.json").read_text())["train"]
    assert written["forward_step"] is None and written["loss_func"] is None
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 0, out
    rc, out = run_cli(["convert", "inspect", root], capsys)
    assert rc == 0, out
    cfg = preset("tiny", **{"checkpoint.load_dir": str(root), "checkpoint.finetune": True, "parallel.device": "cpu"})
    launch_problems(cfg)  # the launch pre-check reads the checkpoint's config too
    assert not marker.exists(), marker.read_text()


def test_verify_never_imports_its_hooks(hostile_hooks, gpt2_checkpoint):
    """``workbench convert verify`` as a real process (its torchrun rank loads the checkpoint too)."""
    root, _, marker = hostile_hooks
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "verify", "--ckpt", str(root),
                           "--hf", str(gpt2_checkpoint.parent / "hf"), "--seq-length", "8", "--batch-size", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not marker.exists(), marker.read_text()


def test_a_resume_names_the_hooks_it_imports_when_they_differ(ckpt):
    from workbench.config import preset
    from workbench.checkpoint import hook_note, read_checkpoint

    _, d = ckpt
    _edit_meta(d, **{"config.train.loss_func": "someone_elses.losses:weighted"})
    meta = read_checkpoint(d)
    mine = preset("tiny", **{"train.loss_func": "workbench.hooks:keytoken_weighted_loss"})
    note = hook_note(mine, meta)
    assert "'someone_elses.losses:weighted', not imported" in note
    assert "train.loss_func: this run's 'workbench.hooks:keytoken_weighted_loss'" in note
    assert "none in this run's config" in hook_note(preset("tiny"), meta)
    _edit_meta(d, **{"config.train.loss_func": "workbench.hooks:keytoken_weighted_loss"})
    assert hook_note(mine, read_checkpoint(d)) is None  # the same hooks: nothing to say


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def test_a_legacy_common_pt_runs_nothing_even_when_the_environment_allows_pickles(ckpt, tmp_path, monkeypatch):
    """megatron-core reads ``common.pt`` with torch.load's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1
    turns into a full unpickle; under the workbench's loads it goes through the weights-only loader. The
    attacker also lists the file in the checksum list (which anyone can rewrite)."""
    import torch

    from workbench.conversion.runtime import load_full_state_dict
    from workbench.models.common.one_process import single_process_group
    from workbench.checkpoint import file_manifest

    _, d = ckpt
    marker = tmp_path / "pwned"
    torch.save({"args": _Payload(marker)}, d / "common.pt")
    _edit_meta(d, files=file_manifest(d))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with single_process_group():
        with pytest.raises(CheckpointError, match=r"common\.pt holds more than tensors and plain data"):
            load_full_state_dict(d)
    assert not marker.exists()


def test_a_file_the_checksum_list_does_not_name_is_refused(ckpt, tmp_path, capsys):
    import torch

    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    torch.save({"args": _Payload(tmp_path / "pwned")}, d / "common.pt")
    with pytest.raises(CheckpointError, match="does not name") as e:
        verify_checkpoint(d)
    assert str(d / "common.pt") in str(e.value) and "remove it" in str(e.value)
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and str(d / "common.pt") in out, out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 2 and str(d / "common.pt") in out, out
    assert not (tmp_path / "pwned").exists()


def test_the_newest_checkpoint_with_an_unreadable_workbench_json_is_refused_not_skipped(ckpt, tmp_path, capsys):
    root, d = ckpt
    newer = root / "iter_0000005"
    shutil.copytree(d, newer)
    _edit_meta(newer, iteration=5)
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    assert find_checkpoint(root) == newer
    (newer / "workbench.json").write_text('{"format": "workbench-mcore-v1", "iteration": 5, "compl')  # cut short
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(root)
    msg = str(e.value)
    assert str(newer / "workbench.json") in msg and "JSONDecodeError" in msg and f"point at {d}" in msg, msg
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and str(newer / "workbench.json") in out, out
    assert find_checkpoint(d) == d  # the older one, asked for explicitly, still loads


def test_resuming_a_run_that_is_already_past_train_iters_is_refused(ckpt):
    from workbench.config import preset
    from workbench.launch import launch_problems

    root, d = ckpt
    _edit_meta(d, iteration=6, has_optimizer=True)
    cfg = preset("tiny", **{"checkpoint.load_dir": str(root), "train.train_iters": 6, "parallel.device": "cpu"})
    cfg = cfg.replace(**{k: getattr(_converted_model(d), k.split(".")[1]) for k in _SHAPE})
    problems = [p for p in launch_problems(cfg) if p.field == "train.train_iters"]
    assert len(problems) == 1, launch_problems(cfg)
    assert "already at iteration 6" in problems[0].rule and "0 steps" in problems[0].rule
    assert "above 6" in problems[0].fix and "finetune" in problems[0].fix
    assert not [p for p in launch_problems(cfg.replace(**{"train.train_iters": 7, "train.lr_decay_iters": 7}))
                if p.field == "train.train_iters"]


_SHAPE = ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.vocab_size", "model.ffn_hidden_size",
          "model.max_position_embeddings", "model.seq_length", "model.position_embedding", "model.normalization",
          "model.activation", "model.gelu_approximate", "model.add_bias_linear", "model.tie_embeddings")


def _converted_model(d):
    from workbench.checkpoint import checkpoint_config, read_checkpoint

    return checkpoint_config(read_checkpoint(d)).model
