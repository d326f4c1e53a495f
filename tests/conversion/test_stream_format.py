"""The checkpoint a streaming conversion writes is the checkpoint megatron-core writes, read back identically.

For a tiny model of every family: ``hf_to_megatron`` writes its checkpoint chunk by chunk
(:class:`workbench.conversion.megatron_files.CheckpointWriter`); megatron-core loads it (``load_full_state_dict``) and saves
the same weights with its own ``dist_checkpointing.save`` (``save_full_state_dict``).  Both ``.metadata`` index
the same stored tensors (keys, global shapes, dtypes, chunks) and objects; every chunk and object holds the same
values; and the streaming reader (:class:`workbench.conversion.megatron_files.CheckpointReader`) reads megatron's save as
megatron reads the streamed one.
"""

from __future__ import annotations

import os

import pytest
import torch

from workbench.models.common.conversion_rules import ConversionError

pytestmark = pytest.mark.filterwarnings("ignore")

CASES = [("gpt2", {}), ("llama", {"tied": False}), ("megatron-bert", {"tied": False}),
         ("t5", {"feed_forward_proj": "gated-gelu", "tied": False})]


def _index(d):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from workbench.checkpoint import read_dist_metadata

    md = read_dist_metadata(d)
    out = {}
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            out[fqn] = (tuple(smd.size), smd.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks))
        else:
            out[fqn] = "bytes"
    return out


@pytest.mark.parametrize("model_type, kw", CASES, ids=[c[0] for c in CASES])
def test_streamed_checkpoint_is_megatrons_own(model_type, kw, tmp_path):
    from workbench.conversion.api import hf_to_megatron, make_random_hf_model
    from workbench.checkpoint import DcpReader
    from workbench.conversion.megatron_files import CheckpointReader, model_layout
    from workbench.conversion.runtime import load_full_state_dict, save_full_state_dict
    from workbench.models.common.one_process import single_process_group
    from workbench.checkpoint import checkpoint_config, find_checkpoint, read_metadata

    hf = make_random_hf_model(tmp_path / "hf", model_type, hidden=48, layers=2, heads=6, vocab=300, **kw)
    streamed = find_checkpoint(hf_to_megatron(hf, tmp_path / "streamed", tp=2, pp=1, dtype="fp32", device="cpu",
                                              progress=False).output)
    meta = read_metadata(streamed)
    cfg = checkpoint_config(meta)
    with single_process_group():
        full, loaded = load_full_state_dict(streamed)  # megatron-core's own load
        saved = save_full_state_dict(tmp_path / "saved", 0, full, cfg, extra=meta["extra"])  # and its own save
        layout = model_layout(cfg)
    assert loaded["extra"] == meta["extra"] and loaded["iteration"] == 0

    a, b = _index(streamed), _index(saved)
    assert a == b  # the same stored tensors (global shapes, dtypes, chunks) and objects
    ra, rb = DcpReader(streamed), DcpReader(saved)
    assert ra.common == rb.common == {"workbench_extra": meta["extra"], "iteration": 0}
    for fqn, entry in a.items():
        if entry == "bytes":
            continue
        for offsets, sizes in entry[2]:
            assert torch.equal(ra.region(fqn, offsets, sizes), rb.region(fqn, offsets, sizes)), (fqn, offsets)
    back = CheckpointReader(saved, layout)  # the streaming reader on megatron's save
    assert set(layout.infos) == set(full)
    for k, t in full.items():
        got = back.read(k)
        assert got.dtype == t.dtype and torch.equal(got, t), k


@pytest.mark.parametrize("direct", [True, False], ids=["direct-io", "page-cache"])
def test_safetensors_shards_written_tensor_by_tensor_are_what_safetensors_reads(tmp_path, monkeypatch, direct):
    """Headers written before the data (shards of at most ``max_shard_size``, an index), every dtype a model has,
    a 0-d and an empty tensor; safetensors' own loader validates and reads them; out-of-plan writes are refused.
    The same where the file system refuses O_DIRECT (written and read through the page cache)."""
    from safetensors.torch import load_file

    import workbench.conversion.hf_files as hf_files
    from workbench.conversion.hf_files import HFReader, SafetensorsWriter
    from workbench.models.common.conversion_rules import infos_of

    read_directly: list[int] = []
    if direct:
        real = hf_files.open_direct
        monkeypatch.setattr(hf_files, "open_direct", lambda path: (lambda fd: fd is None or read_directly.append(fd) or fd)(real(path)))
    else:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
        monkeypatch.setattr(hf_files, "open_direct", lambda path: None)

    g = torch.Generator().manual_seed(0)
    sd = {"a.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16), "b": torch.randn(300, generator=g),
          "c": torch.randn(3, 3, generator=g).half(), "d": torch.tensor(3.5, dtype=torch.float64),
          "e": torch.arange(6, dtype=torch.int64).reshape(2, 3), "f": torch.zeros(0, 4), "g": torch.tensor([True, False])}
    w = SafetensorsWriter(tmp_path, infos_of(sd), max_shard_size=1000)
    with pytest.raises(ValueError, match="out of plan order"):
        w.write("b", sd["b"])
    for k, t in sd.items():
        w.write(k, t)
    files = w.close()
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    got = {}
    for f in files:
        got.update(load_file(str(tmp_path / f)))
    assert got.keys() == sd.keys() and all(got[k].dtype == sd[k].dtype and torch.equal(got[k], sd[k]) for k in sd)
    r = HFReader(tmp_path)
    assert r.infos == infos_of(sd) and all(torch.equal(r.read(k), sd[k]) for k in sd)
    if direct and not read_directly:
        pytest.skip("this file system refuses O_DIRECT: the direct path did not run")


def _bin_shards(d, n_shards=2, per_shard=8, zip_format=True):
    """A sharded ``pytorch_model.bin`` (``pytorch_model-0000i-of-0000n.bin`` and its index) of ``per_shard`` 1 MiB
    fp32 tensors a shard; {name: tensor}, {name: its file's name}."""
    import json

    g = torch.Generator().manual_seed(1)
    sd, where = {}, {}
    d.mkdir(parents=True, exist_ok=True)
    for s in range(n_shards):
        name = f"pytorch_model-{s + 1:05d}-of-{n_shards:05d}.bin"
        part = {f"layers.{s}.w{i}": torch.randn(256, 1024, generator=g) for i in range(per_shard)}
        torch.save(part, d / name, _use_new_zipfile_serialization=zip_format)
        sd.update(part)
        where.update({k: name for k in part})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": where}))
    return sd, where


def _counting_loads(monkeypatch):
    """[(file, mmap)] of every call to the safe torch loader (the boundary every ``.bin`` read goes through)."""
    import workbench.checkpoint as checkpoint

    calls, real = [], checkpoint.safe_torch_load
    monkeypatch.setattr(checkpoint, "safe_torch_load",
                        lambda f, **kw: calls.append((str(f), kw.get("mmap", False))) or real(f, **kw))
    return calls


def _read_syscall_bytes() -> int:
    """Bytes this process has read through read()-style system calls (Linux ``/proc/self/io`` ``rchar``)."""
    with open("/proc/self/io") as fh:
        return int(dict(line.split(": ") for line in fh.read().splitlines())["rchar"])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
@pytest.mark.parametrize("order", ["file", "alternating"])
def test_sharded_bin_tensors_are_read_once_whatever_the_order(tmp_path, monkeypatch, order):
    """Reading every tensor of a 2-shard ``.bin`` checkpoint, in file order or alternating between the shards (as a
    conversion's rule order does when a layer's tensors sit in different shards): no shard is read whole, let
    alone again for each tensor; the bytes read besides the tensors' own pages stay well under one pass over the
    files; every tensor comes back equal and independent of the reader."""
    from workbench.conversion.hf_files import HFReader

    sd, where = _bin_shards(tmp_path / "hf")
    total = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.bin"))
    torch.save({"warm": torch.zeros(1)}, tmp_path / "warm.pt")
    torch.load(tmp_path / "warm.pt", weights_only=True, mmap=True)  # the loader's lazy imports: not counted
    calls = _counting_loads(monkeypatch)
    names = sorted(sd) if order == "file" else [n for pair in zip(*[sorted(k for k in sd if where[k] == f)
                                                                     for f in sorted(set(where.values()))]) for n in pair]
    before = _read_syscall_bytes()
    r = HFReader(tmp_path / "hf")
    got = {n: r.read(n) for n in names} if order == "alternating" else dict(r.tensors())
    read = _read_syscall_bytes() - before
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    got[names[0]].add_(1)  # the caller's own copy: the next read is unchanged
    assert torch.equal(r.read(names[0]), sd[names[0]])
    assert read < total / 4, f"{read} bytes read from {total} bytes of shards ({len(calls)} opens)"
    assert not [f for f, mapped in calls if not mapped], calls  # no shard loaded whole


def test_legacy_bin_shards_are_loaded_once_each_when_read_in_file_order(tmp_path, monkeypatch):
    """Shards in torch's pre-zip format can only be loaded whole: listing them loads each once, and reading every
    tensor starts with the shard still held, so two shards cost three loads, one shard held at a time."""
    from workbench.conversion.hf_files import HFReader

    sd, _ = _bin_shards(tmp_path / "hf", zip_format=False)
    calls = _counting_loads(monkeypatch)
    r = HFReader(tmp_path / "hf")
    got = dict(r.tensors())
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert len(calls) == 3 and not any(mapped for _, mapped in calls), calls


def test_a_safetensors_file_cut_short_after_it_was_opened_is_refused_by_name(tmp_path):
    from safetensors.torch import save_file

    from workbench.conversion.hf_files import HFReader

    save_file({"a": torch.randn(64, 64), "b": torch.randn(256, 256)}, str(tmp_path / "model.safetensors"))
    r = HFReader(tmp_path)  # the headers are read (and checked) here
    f = tmp_path / "model.safetensors"
    os.truncate(f, f.stat().st_size - 1000)
    with pytest.raises(ConversionError, match=r"model.safetensors.* -> copy the model again"):
        r.read("b")
