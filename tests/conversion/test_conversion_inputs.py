"""``workbench convert`` on wrong input says what is wrong and what to do (exit 2), never a traceback or a
silent loss: a layout the model cannot take and a hostile HF ``pytorch_model.bin`` given to ``verify``; a
tokenizer recorded as a relative path exported from another directory; a checkpoint that records no tokenizer
reshaped.  Also: ``--help`` names every family's HF classes, and a save records a tokenizer path absolute."""

from __future__ import annotations

import builtins
import json
import shutil

import pytest

from workbench.checkpoint import find_checkpoint
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def source(gpt2_checkpoint):
    """(HF dir with a tokenizer, the workbench checkpoint converted from it)."""
    return gpt2_checkpoint.parent / "hf", gpt2_checkpoint


@pytest.fixture()
def trained_like(source, tmp_path):
    """A copy of the checkpoint as a training run leaves it: no ``tokenizer/`` beside it, the tokenizer recorded as
    the run's ``data.tokenizer`` was written (a path relative to where it was launched: ``launch/tok``)."""
    hf, ckpt = source
    root = tmp_path / "ckpt"
    shutil.copytree(ckpt, root)
    shutil.rmtree(root / "tokenizer")
    d = find_checkpoint(root)
    meta = json.loads((d / "workbench.json").read_text())
    meta["tokenizer"] = "tok"
    meta["config"]["data"]["tokenizer"] = "tok"
    (d / "workbench.json").write_text(json.dumps(meta))
    (tmp_path / "launch").mkdir()
    shutil.copytree(hf, tmp_path / "launch" / "tok", ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    return root, d


def test_verify_refuses_a_layout_the_model_cannot_take_before_starting_ranks(source, capsys):
    hf, ckpt = source
    rc, out = run_cli(["convert", "verify", "--ckpt", ckpt, "--hf", hf, "--tp", "3"], capsys)
    assert rc == 2, out
    assert "tp: num_attention_heads 4 is not divisible by tensor_parallel 3" in out and "--tp" in out, out
    assert "Traceback" not in out and "torch.distributed.run" not in out and "rank" not in out.lower(), out
    rc, out = run_cli(["convert", "verify", "--ckpt", ckpt, "--hf", hf, "--pp", "5"], capsys)
    assert rc == 2 and "pp: num_layers 2 is fewer than pipeline_parallel 5" in out, out


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return builtins.exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def test_verify_refuses_a_hostile_pytorch_model_bin_naming_it(source, tmp_path, capsys, monkeypatch):
    import torch

    hf, ckpt = source
    evil = tmp_path / "hf-evil"
    evil.mkdir()
    shutil.copy(hf / "config.json", evil / "config.json")
    marker = tmp_path / "pwned"
    torch.save({"transformer.wte.weight": _Payload(marker)}, evil / "pytorch_model.bin")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # the environment asks for full unpickling
    rc, out = run_cli(["convert", "verify", "--ckpt", ckpt, "--hf", evil], capsys)
    assert rc == 2, out
    assert str(evil / "pytorch_model.bin") in out and "holds more than tensors" in out and "safetensors" in out, out
    assert "Traceback" not in out
    assert not marker.exists()


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_verify_refuses_an_index_naming_weights_outside_the_model_directory(source, tmp_path, capsys, how):
    """An HF index whose weight map points out of the model directory (at a real, loadable copy of the weights):
    refused naming the index and the entry, before that file is read."""
    import torch
    from safetensors.torch import load_file

    hf, ckpt = source
    model = tmp_path / "hf-index"
    model.mkdir()
    shutil.copy(hf / "config.json", model / "config.json")
    outside = tmp_path / "elsewhere" / "pytorch_model.bin"
    outside.parent.mkdir()
    sd = load_file(str(hf / "model.safetensors"))
    torch.save(sd, outside)
    name = "../elsewhere/pytorch_model.bin" if how == "dotdot" else str(outside)
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {k: name for k in sd}}))
    rc, out = run_cli(["convert", "verify", "--ckpt", ckpt, "--hf", model], capsys)
    assert rc == 2 and str(model / "pytorch_model.bin.index.json") in out and repr(name) in out, out
    assert "Traceback" not in out


def test_help_names_every_familys_hf_classes(capsys):
    from workbench.cli import main
    from workbench.families import FAMILIES

    classes = [cls for f in FAMILIES.values() for _, cls in f.supports.hf_classes]
    assert {"GPT2LMHeadModel", "LlamaForCausalLM", "MegatronBertForPreTraining", "T5ForConditionalGeneration",
            "MT5ForConditionalGeneration"} <= set(classes)
    for argv in (["convert", "--help"], ["convert", "hf-to-megatron", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        missing = [c for c in classes if c not in text]
        assert not missing, (argv, missing, text)


def test_reshape_of_a_checkpoint_without_a_tokenizer_names_the_checkpoint(trained_like, tmp_path, capsys):
    root, d = trained_like
    meta = json.loads((d / "workbench.json").read_text())
    meta["tokenizer"] = None
    meta["config"]["data"]["tokenizer"] = ""
    (d / "workbench.json").write_text(json.dumps(meta))
    rc, out = run_cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"], capsys)
    assert rc == 0, out
    assert "None" not in out and f"checkpoint {d} names no tokenizer" in out, out


def test_export_from_another_directory_refuses_a_relative_tokenizer_it_cannot_find(trained_like, tmp_path, capsys,
                                                                                    monkeypatch):
    root, _ = trained_like
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf1"], capsys)
    assert rc == 2, out
    assert "'tok'" in out and "relative" in out and str(elsewhere) in out and "--tokenizer" in out, out
    assert not (tmp_path / "hf1").exists()
    rc, out = run_cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs", "--tp", "1", "--pp", "1"], capsys)
    assert rc == 2 and "'tok'" in out, out
    # the fix the message names: --tokenizer, or the directory the run was launched from
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf2", "--tokenizer",
                    tmp_path / "launch" / "tok"], capsys)
    assert rc == 0 and (tmp_path / "hf2" / "tokenizer.json").is_file(), out
    monkeypatch.chdir(tmp_path / "launch")
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf3"], capsys)
    assert rc == 0 and (tmp_path / "hf3" / "tokenizer.json").is_file(), out
    rc, out = run_cli(["convert", "reshape", "--ckpt", root, "--out", tmp_path / "rs2", "--tp", "1", "--pp", "1"], capsys)
    assert rc == 0 and (tmp_path / "rs2" / "tokenizer" / "tokenizer.json").is_file(), out


def test_a_save_records_a_tokenizer_path_as_an_absolute_one(source, tmp_path, monkeypatch):
    from workbench.conversion.runtime import load_full_state_dict, save_full_state_dict
    from workbench.models.common.one_process import single_process_group
    from workbench.checkpoint import checkpoint_config, read_checkpoint

    hf, ckpt = source
    monkeypatch.chdir(hf.parent)
    cfg = checkpoint_config(read_checkpoint(ckpt))
    with single_process_group():
        full, _ = load_full_state_dict(ckpt)
        out = save_full_state_dict(tmp_path / "saved", 3, full, cfg, tokenizer="hf")
        named = save_full_state_dict(tmp_path / "named", 3, full, cfg, tokenizer="demo")
    assert read_checkpoint(out).tokenizer == str(hf.resolve())
    assert read_checkpoint(named).tokenizer == "demo"


def test_an_output_disk_too_small_is_refused_before_anything_is_written(source, tmp_path, capsys, monkeypatch):
    """The free space of ``--out``'s file system (the operating system's answer, the one thing faked) is checked
    against the bytes the conversion writes: exit 2 naming both, nothing written."""
    import workbench.conversion.api as api

    hf, ckpt = source
    real = shutil.disk_usage
    monkeypatch.setattr(api.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    for argv in (["hf-to-megatron", "--hf", hf], ["megatron-to-hf", "--ckpt", ckpt], ["reshape", "--ckpt", ckpt, "--tp", "1", "--pp", "1"]):
        out_dir = tmp_path / argv[0]
        rc, out = run_cli(["convert", *argv, "--out", out_dir], capsys)
        assert rc == 2, out
        assert f"--out {out_dir}: 0.00 GB free on its file system, the output takes" in out and "larger disk" in out, out
        assert not out_dir.exists() and not list(tmp_path.glob(f"{argv[0]}.tmp-*")), argv


def test_a_disk_that_fills_up_mid_conversion_is_named_and_leaves_no_output(source, tmp_path, capsys, monkeypatch):
    """A write refused with ENOSPC halfway through (the disk fills up while the conversion runs; the failing write
    is the one thing faked): the command says so, not torch's "unexpected pos", exits 1, and removes its partial
    output."""
    import errno

    import workbench.checkpoint.dcp as dcp
    from workbench.checkpoint import direct_io

    hf, _ = source
    written = [0]

    class Filling:
        def __init__(self, fh):
            self._fh = fh
            self.sha = getattr(fh, "sha", None)

        def write(self, data):
            written[0] += memoryview(data).nbytes
            if written[0] > 200_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self._fh.write(data)

        def __getattr__(self, name):
            return getattr(self._fh, name)

    real = direct_io.open_for_writing
    monkeypatch.setattr(dcp, "open_for_writing", lambda path, hashed=False: Filling(real(path, hashed)))
    out_dir = tmp_path / "out"
    rc, out = run_cli(["convert", "hf-to-megatron", "--hf", hf, "--out", out_dir], capsys)
    assert rc == 1, out
    assert "No space left on device" in out and "free space on that file system" in out, out
    assert "unexpected pos" not in out and "Traceback" not in out, out
    assert not out_dir.exists() and not list(tmp_path.glob("out.tmp-*"))
