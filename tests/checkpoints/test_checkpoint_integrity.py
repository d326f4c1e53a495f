"""Checkpoint safety and integrity: nothing in a checkpoint runs code, damaged files are named,
and ``workbench generate`` / ``workbench convert`` refuse both (exit 2) before any process starts.

One real workbench checkpoint (a random HF GPT-2 through ``workbench.conversion.hf_to_megatron``,
megatron-core's torch_dist format, 1 CPU process); each test damages or poisons its own copy.
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import pickle
import shutil
import tempfile

import pytest

from workbench.checkpoint import CheckpointError, find_checkpoint
from tests.support.cli import run_cli

pytestmark = pytest.mark.filterwarnings("ignore")


class _Payload:
    """What a hostile checkpoint pickles: unpickling calls ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(marker: pathlib.Path) -> dict[str, _Payload]:
    return {
        "exec": _Payload(builtins.exec, f"open({str(marker)!r}, 'w').write('pwned')"),
        "os.system": _Payload(os.system, f"touch {marker}"),
        "dotted-name": _Payload(pathlib.Path.touch, pathlib.Path(marker)),  # pathlib.Path is admitted; Path.touch is not
    }


def _poison_metadata(d: pathlib.Path, payload: _Payload) -> pathlib.Path:
    """Replace ``.metadata`` with the real metadata carrying ``payload`` (what an attacker would ship)."""
    with open(d / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # our own, freshly saved file
    md.planner_data = payload
    with open(d / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return d / ".metadata"


def test_a_saved_checkpoint_records_its_files_and_passes(ckpt):
    from workbench.checkpoint import checkpoint_damage, checkpoint_tensor_shapes, read_dist_metadata

    root, d = ckpt
    files = json.loads((d / "workbench.json").read_text())["files"]
    assert {".metadata", "__0_0.distcp", "metadata.json"} <= set(files)
    for name, rec in files.items():
        assert rec["size"] == (d / name).stat().st_size and len(rec["sha256"]) == 64
    assert checkpoint_damage(d) == []
    md = read_dist_metadata(d)  # the allow-list admits everything a real megatron-core .metadata holds
    assert type(md).__name__ == "Metadata" and md.storage_data
    assert checkpoint_tensor_shapes(root)["embedding.word_embeddings.weight"][0][1] == 64


@pytest.mark.parametrize("kind", ["exec", "os.system", "dotted-name"])
def test_hostile_metadata_never_runs_and_every_entry_point_refuses_it(ckpt, tmp_path, capsys, kind):
    from workbench.checkpoint import checkpoint_tensor_shapes
    from workbench.config import load_config
    from workbench.checkpoint import load_problems

    root, d = ckpt
    marker = tmp_path / "pwned"
    meta = _poison_metadata(d, _payloads(marker)[kind])

    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and str(meta) in out and "trust" in out, out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 2 and str(meta) in out, out
    assert not (tmp_path / "hf").exists()
    rc, out = run_cli(["convert", "inspect", root], capsys)
    assert rc == 2 and str(meta) in out, out
    with pytest.raises(CheckpointError, match="never holds"):
        checkpoint_tensor_shapes(root)
    cfg = load_config(root / "workbench_config.json").replace(**{"checkpoint.load_dir": str(root)})  # as conversion wrote it
    problems = load_problems(cfg)  # the launch pre-check
    assert [p.field for p in problems] == ["checkpoint.load_dir"] and str(meta) in problems[0].rule
    assert not marker.exists()


def test_torch_readers_use_the_allow_list_inside_workbench_loads_only(ckpt, tmp_path):
    """The mechanism itself, under any verification: torch's reader (megatron's loads go through it)."""
    from torch.distributed.checkpoint import FileSystemReader

    from workbench.checkpoint import safe_dist_reading

    _, d = ckpt
    marker = tmp_path / "pwned"
    original = FileSystemReader.read_metadata
    _poison_metadata(d, _payloads(marker)["exec"])
    with safe_dist_reading(), safe_dist_reading():  # re-entrant
        with pytest.raises(CheckpointError, match=r"\.metadata refers to builtins\.exec"):
            FileSystemReader(str(d)).read_metadata()
    assert FileSystemReader.read_metadata is original and not marker.exists()


def test_hostile_object_inside_the_data_file_never_runs(gpt2_checkpoint, tmp_path):
    """Stored objects (the common state, _extra_state) are unpickled by torch with weights_only=False;
    under workbench loads they get weights_only=True."""
    from workbench.config import RunConfig
    from workbench.conversion.runtime import load_full_state_dict, save_full_state_dict
    from workbench.models.common.one_process import single_process_group
    from workbench.checkpoint import read_metadata

    marker = tmp_path / "pwned"
    meta = read_metadata(gpt2_checkpoint)
    cfg = RunConfig.from_dict(meta["config"])
    with single_process_group():
        full, _ = load_full_state_dict(gpt2_checkpoint)
        save_full_state_dict(tmp_path / "evil", 0, full, cfg, extra={"note": _payloads(marker)["exec"]})
        with pytest.raises(CheckpointError, match="'common_state/shard_0_1' holds more than tensors"):
            load_full_state_dict(tmp_path / "evil")
    assert not marker.exists()


def _truncate(p: pathlib.Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p: pathlib.Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, says", [
    ("truncate", "__0_0.distcp", "truncated"),
    ("delete", ".metadata", "missing"),
    ("flip", "__0_0.distcp", "checksum"),
    ("delete", "__0_0.distcp", "missing"),
    ("truncate", ".metadata", "damaged"),
])
def test_damaged_checkpoint_is_named_with_the_fix(ckpt, tmp_path, capsys, damage, file, says):
    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    target = d / file
    {"truncate": _truncate, "delete": os.remove, "flip": _flip}[damage](target)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(d)
    assert str(target) in str(e.value) and says in str(e.value) and " -> " in str(e.value)

    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and str(target) in out and "copy the checkpoint again" in out, out
    assert "Traceback" not in out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 2 and str(target) in out, out
    rc, out = run_cli(["convert", "inspect", root], capsys)
    assert rc != 0 and str(target) in out and says in out, out


def test_a_checkpoint_without_its_checksum_list_is_refused_until_trusted(ckpt, tmp_path, capsys):
    """With the list removed, a corrupted data file would load unnoticed: refused everywhere (exit 2, the fix named);
    a truncated file is still named from .metadata's own index; `workbench convert trust` records the list."""
    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    meta = json.loads((d / "workbench.json").read_text())
    del meta["files"]
    (d / "workbench.json").write_text(json.dumps(meta))
    _flip(d / "__0_0.distcp")  # what the list would have caught
    with pytest.raises(CheckpointError, match="records no checksums") as e:
        verify_checkpoint(d)
    assert f"workbench convert trust --ckpt {d}" in str(e.value)
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cpu"], capsys)
    assert rc == 2 and "records no checksums" in out and "Traceback" not in out, out
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 2 and "records no checksums" in out, out
    _truncate(d / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated"):
        verify_checkpoint(d)
    rc, out = run_cli(["convert", "trust", "--ckpt", root], capsys)
    assert rc == 2 and "truncated" in out, out  # a damaged copy is not trusted


def test_trust_records_the_list_of_a_sound_copy_and_refuses_foreign_files(ckpt, capsys):
    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    meta = json.loads((d / "workbench.json").read_text())
    saved = meta.pop("files")
    (d / "workbench.json").write_text(json.dumps(meta))
    (d / "common.pt").write_bytes(b"not from a save")
    rc, out = run_cli(["convert", "trust", "--ckpt", root], capsys)
    assert rc == 2 and str(d / "common.pt") in out and "never writes" in out, out
    os.remove(d / "common.pt")
    rc, out = run_cli(["convert", "trust", "--ckpt", root], capsys)
    assert rc == 0 and f"recorded the checksums of {len(saved)} files" in out, out
    assert json.loads((d / "workbench.json").read_text())["files"] == saved
    verify_checkpoint(d)
    _flip(d / "__0_0.distcp")
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        verify_checkpoint(d)
    rc, out = run_cli(["convert", "trust", "--ckpt", root], capsys)
    assert rc == 2 and "already records its checksums" in out, out


def test_damage_names_an_earlier_iteration_to_load(ckpt):
    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    later = root / "iter_0000007"
    shutil.copytree(d, later)
    meta = json.loads((later / "workbench.json").read_text())
    (later / "workbench.json").write_text(json.dumps({**meta, "iteration": 7}))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    _truncate(later / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=f"load an earlier iteration \\({d}\\)"):
        verify_checkpoint(find_checkpoint(root))


def test_generate_finds_the_checkpoint_of_a_run_directory(ckpt, tmp_path):
    from workbench.generation import checkpoint_info

    root, d = ckpt
    run = tmp_path / "run"
    (run / "events").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"checkpoint": {"save_dir": None}}))
    shutil.copytree(root, run / "checkpoints")
    assert checkpoint_info(run).path == run / "checkpoints" / d.name
    # a save_dir elsewhere, as the run's config.json records it
    other = tmp_path / "run2"
    (other / "events").mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"checkpoint": {"save_dir": str(root)}}))
    assert find_checkpoint(other) == d
    # a run that saved nothing: says so instead of "train with a save_dir"
    empty = tmp_path / "run3"
    (empty / "events").mkdir(parents=True)
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="run directory has no checkpoints"):
        find_checkpoint(empty)


def test_generate_refuses_a_layout_before_any_process_starts(ckpt, tmp_path, capsys, monkeypatch):
    import torch

    root, _ = ckpt
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where generate's work dir would appear
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--tp", "3", "--device", "cpu"], capsys)
    assert rc == 2 and "tp: num_attention_heads 4 is not divisible by tensor_parallel 3" in out and "--tp" in out, out
    rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--pp", "5", "--device", "cpu"], capsys)
    assert rc == 2 and "pp: num_layers 2 is fewer than pipeline_parallel 5" in out, out
    if torch.cuda.device_count() == 0:
        rc, out = run_cli(["generate", "--ckpt", root, "--prompt", "hello", "--device", "cuda"], capsys)
        assert rc == 2 and "device: is 'cuda' but no CUDA GPU" in out and "--device cpu" in out, out
    assert list(private.iterdir()) == []  # nothing was launched: no work dir was even made


# --------------------------------------------------------------------------- names that lead out of the checkpoint


def _reseal(d: pathlib.Path) -> None:
    """Record the current size and SHA-256 of ``d``'s ``.metadata`` in its checksum list, as the author of a crafted
    checkpoint would (so only the names inside it can give it away)."""
    import hashlib

    meta = json.loads((d / "workbench.json").read_text())
    data = (d / ".metadata").read_bytes()
    meta["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "workbench.json").write_text(json.dumps(meta))


def _edit_storage(d: pathlib.Path, fn) -> pathlib.Path:
    """Rewrite every storage entry of ``d``'s ``.metadata`` (a real ``_StorageInfo``) with ``fn(entry)``, then reseal."""
    with open(d / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # our own, freshly saved file
    md.storage_data = {k: fn(k, v) for k, v in md.storage_data.items()}
    with open(d / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    _reseal(d)
    return d / ".metadata"


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_metadata_data_file_outside_the_checkpoint_is_refused_before_it_is_read(ckpt, tmp_path, capsys, how):
    """``.metadata`` pointing its tensors at a file outside the checkpoint (here an intact copy of the real data file,
    so every size and range checks out): refused at verification, by the streaming reader and by the CLI (exit 2),
    naming ``.metadata`` and the entry."""
    import dataclasses

    from workbench.checkpoint import DcpReader, verify_checkpoint

    root, d = ckpt
    outside = tmp_path / "elsewhere" / "stolen.distcp"
    outside.parent.mkdir()
    shutil.copy(d / "__0_0.distcp", outside)
    name = os.path.relpath(outside, d) if how == "dotdot" else str(outside)
    assert (name.startswith("../") if how == "dotdot" else os.path.isabs(name))
    meta = _edit_storage(d, lambda k, v: dataclasses.replace(v, relative_path=name))
    for check in (verify_checkpoint, DcpReader):
        with pytest.raises(CheckpointError) as e:
            check(d)
        msg = str(e.value)
        assert str(meta) in msg and repr(name) in msg and "outside checkpoint" in msg and " -> " in msg, msg
    rc, out = run_cli(["convert", "megatron-to-hf", "--ckpt", root, "--out", tmp_path / "hf"], capsys)
    assert rc == 2 and str(meta) in out and repr(name) in out and "Traceback" not in out, out
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("linked", ["__0_0.distcp", "metadata.json"])
def test_a_checkpoint_file_that_is_a_symlink_out_of_the_checkpoint_is_refused(ckpt, tmp_path, capsys, linked):
    """A file of the checkpoint replaced by a symlink to an identical copy elsewhere (its checksum still matches):
    refused by verification and by ``convert trust``, naming the file."""
    from workbench.checkpoint import verify_checkpoint

    root, d = ckpt
    outside = tmp_path / "elsewhere" / linked
    outside.parent.mkdir()
    shutil.move(d / linked, outside)
    (d / linked).symlink_to(outside)
    with pytest.raises(CheckpointError) as e:
        verify_checkpoint(d)
    assert repr(linked) in str(e.value) and f"resolves to {outside}" in str(e.value), str(e.value)
    rc, out = run_cli(["convert", "inspect", root], capsys)
    assert rc == 2 and repr(linked) in out and "outside checkpoint" in out, out
    meta = json.loads((d / "workbench.json").read_text())
    del meta["files"]
    (d / "workbench.json").write_text(json.dumps(meta))
    rc, out = run_cli(["convert", "trust", "--ckpt", root], capsys)
    assert rc == 2 and repr(linked) in out and "outside checkpoint" in out, out
    assert "files" not in json.loads((d / "workbench.json").read_text())


@pytest.mark.parametrize("where", ["dotdot", "absolute"])
def test_a_checksum_list_naming_a_file_outside_the_checkpoint_is_refused_unhashed(ckpt, tmp_path, where, monkeypatch):
    """``workbench.json``'s list naming a file elsewhere: refused naming ``workbench.json`` and the entry, before
    that file is opened (hashed, or its size reported)."""
    import workbench.checkpoint.integrity as integrity

    root, d = ckpt
    secret = tmp_path / "secret.txt"
    secret.write_text("not the checkpoint's")
    name = os.path.relpath(secret, d) if where == "dotdot" else str(secret)
    meta = json.loads((d / "workbench.json").read_text())
    meta["files"][name] = {"size": 3, "sha256": "0" * 64}
    (d / "workbench.json").write_text(json.dumps(meta))
    hashed = []
    real = integrity._sha256
    monkeypatch.setattr(integrity, "_sha256", lambda p: hashed.append(pathlib.Path(p)) or real(p))
    with pytest.raises(CheckpointError) as e:
        integrity.verify_checkpoint(d)
    msg = str(e.value)
    assert str(d / "workbench.json") in msg and repr(name) in msg and "outside checkpoint" in msg, msg
    assert secret not in hashed, hashed


@pytest.mark.parametrize("offset, length", [(-8, None), (0, -1), ("past-end", None)])
def test_a_storage_range_outside_its_data_file_is_refused_when_the_reader_opens(ckpt, offset, length):
    """A negative offset or length, or a range that ends past the data file: refused naming the file and the entry,
    by verification and by the streaming reader as it opens (before any chunk is read)."""
    import dataclasses

    from workbench.checkpoint import DcpReader, verify_checkpoint

    _, d = ckpt
    data = d / "__0_0.distcp"
    size = data.stat().st_size
    victim = []

    def edit(k, v):
        if victim or k.fqn.startswith("common") or "extra_state" in k.fqn:
            return v  # one tensor chunk: the reader would reach it only when that tensor is read
        victim.append(k.fqn)
        return dataclasses.replace(v, offset=size if offset == "past-end" else offset if offset is not None else v.offset,
                                   length=length if length is not None else v.length)

    meta = _edit_storage(d, edit)
    for check in (verify_checkpoint, DcpReader):
        with pytest.raises(CheckpointError) as e:
            check(d)
        msg = str(e.value)
        if offset == "past-end":
            assert str(data) in msg and "truncated" in msg, msg
        else:
            assert str(meta) in msg and repr(victim[0]) in msg and "offset" in msg and " -> " in msg, msg
