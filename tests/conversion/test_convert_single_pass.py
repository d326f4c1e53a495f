"""A conversion from a workbench checkpoint reads its data once and checks its checksums as it goes.

``reshape`` and ``megatron_to_hf`` read the source checkpoint's data file front to back, once, hashing it as they
read (:class:`workbench.checkpoint.ChecksummedReads`), where a verification pass followed by the conversion's own
reads would read every byte twice.  A file whose checksum differs is still refused, with the message
``verify_checkpoint`` gives, and the conversion leaves no output behind.
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")


def _read_syscall_bytes() -> int:
    """Bytes this process has read through read()-style system calls (Linux ``/proc/self/io`` ``rchar``), all threads."""
    with open("/proc/self/io") as fh:
        return int(dict(line.split(": ") for line in fh.read().splitlines())["rchar"])


def _counting_maps(monkeypatch) -> list[int]:
    """The lengths of the ranges the checksummed reader maps (bytes read without a read() system call): every range
    it is asked for, less those it reads directly (with preadv, which /proc/self/io counts)."""
    from workbench.checkpoint import ChecksummedReads, DirectReads

    lengths, real, direct = [], ChecksummedReads.hold, DirectReads.read
    monkeypatch.setattr(ChecksummedReads, "hold", lambda self, name, offset, length: lengths.append(length) or
                        real(self, name, offset, length))
    monkeypatch.setattr(DirectReads, "read", lambda self, fd, offset, length: lengths.append(-length) or
                        direct(self, fd, offset, length))
    return lengths


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two checkpoints of one ~40 MB Llama-shaped model (fp32): one to warm the imports up with, one to measure."""
    from workbench.conversion.api import hf_to_megatron, make_random_hf_model

    d = tmp_path_factory.mktemp("single-pass")
    hf = make_random_hf_model(d / "hf", "llama", hidden=256, layers=4, heads=4, vocab=16000, tied=False)
    out = [hf_to_megatron(hf, d / name, tp=2, pp=1, dtype="fp32", device="cpu", progress=False).output
           for name in ("warm", "ckpt")]
    return d, hf, out[0], out[1]


def _data_file(root):
    from workbench.checkpoint import find_checkpoint

    return find_checkpoint(root) / "__0_0.distcp"


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_reshape_and_export_read_the_checkpoint_once(ckpts, monkeypatch):
    from workbench.conversion.api import compare_hf_dirs, megatron_to_hf, reshape

    d, hf, warm, ckpt = ckpts
    reshape(warm, d / "warm-tp1", tp=1, pp=1)  # every lazy import of both paths, from another checkpoint
    megatron_to_hf(warm, d / "warm-hf", progress=False)
    size = sum(f.stat().st_size for f in _data_file(ckpt).parent.glob("*.distcp"))  # (the converter writes two)
    assert size > 30e6
    mapped = _counting_maps(monkeypatch)
    for name, run in (("reshape", lambda: reshape(ckpt, d / "tp1", tp=1, pp=1)),
                      ("megatron-to-hf", lambda: megatron_to_hf(ckpt, d / "hf-back", progress=False))):
        mapped.clear()
        before = _read_syscall_bytes()
        run()
        read = _read_syscall_bytes() - before + sum(mapped)
        assert size <= read < 1.25 * size, f"{name}: {read} bytes read for {size} bytes of data files (a second pass?)"
    assert compare_hf_dirs(hf, d / "hf-back")["identical"]


def _flip_inside_a_tensor(f):
    """Flip one byte in the middle of the largest stored chunk (its raw values: the chunk still loads)."""
    from workbench.checkpoint import read_dist_metadata

    info = max(read_dist_metadata(f.parent).storage_data.values(), key=lambda i: i.length)
    with open(f.parent / info.relative_path, "r+b") as fh:
        fh.seek(info.offset + info.length // 2)
        b = fh.read(1)
        fh.seek(info.offset + info.length // 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def _refuse_direct_reads(monkeypatch) -> list[str]:
    """Make the file system refuse O_DIRECT (tmpfs before Linux 6.6, some network file systems); the paths asked."""
    from workbench.checkpoint import DirectReads

    asked: list[str] = []
    monkeypatch.setattr(DirectReads, "open", lambda self, path: asked.append(path) or None)
    return asked


def test_where_direct_reads_are_refused_the_checkpoint_is_read_through_the_page_cache(ckpts, tmp_path, monkeypatch):
    from workbench.conversion.api import compare_hf_dirs, megatron_to_hf, reshape

    _, hf, _, ckpt = ckpts
    asked = _refuse_direct_reads(monkeypatch)
    tp1 = reshape(ckpt, tmp_path / "tp1", tp=1, pp=1).output
    megatron_to_hf(tp1, tmp_path / "hf-back", progress=False)
    assert any(p.endswith("__0_0.distcp") for p in asked), asked
    assert compare_hf_dirs(hf, tmp_path / "hf-back")["identical"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct-reads", "cached-reads"])
@pytest.mark.parametrize("step", ["reshape", "megatron-to-hf"])
def test_a_tampered_data_file_is_refused_after_the_pass_and_leaves_no_output(ckpts, tmp_path, step, direct, monkeypatch):
    import shutil

    from workbench.conversion.api import megatron_to_hf, reshape
    from workbench.checkpoint import CheckpointError, checkpoint_info

    from tests.support import count_direct_reads

    _, _, _, ckpt = ckpts
    read_directly: list[int] = []
    if direct:
        read_directly = count_direct_reads(monkeypatch)
    else:
        _refuse_direct_reads(monkeypatch)
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    f = _data_file(src)
    _flip_inside_a_tensor(f)
    checkpoint_info(src, hashes=False)  # sizes, index and list of files intact: only the checksum can tell
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        if step == "reshape":
            reshape(src, out, tp=1, pp=1)
        else:
            megatron_to_hf(src, out, progress=False)
    msg = str(e.value)
    assert f"{f} does not match its checksum from the save" in msg and "copy the checkpoint again" in msg, msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no staging directory left behind
    if direct and not read_directly:
        pytest.skip("this file system refuses O_DIRECT: the direct path did not run")
    # nothing stays open while the refusal's traceback lives (a notebook keeps it): no deleted output holding the disk,
    # no descriptor of the source
    held = [t for t in _open_files() if t.startswith((str(out), str(src)))]
    assert not held, held


def _open_files() -> list[str]:
    """What this process's file descriptors point at."""
    import os

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_a_chunk_that_is_part_of_a_larger_tensor_is_saved_from_its_own_memory():
    """``torch.save`` writes a tensor's whole storage; the writer hands it the chunk's own bytes without copying them
    (SwiGLU's fc1 halves are such chunks), and what it saves loads back as the chunk."""
    import io

    import torch

    from workbench.checkpoint.dcp import _own_storage

    for dtype in (torch.bfloat16, torch.float32):
        big = torch.randn(64, 48).to(dtype)
        for part in (big[32:], big[:32], big):
            own = _own_storage(part)
            assert own.data_ptr() == part.data_ptr() and own.untyped_storage().nbytes() == part.numel() * part.element_size()
            buf, ref = io.BytesIO(), io.BytesIO()
            torch.save(own, buf)
            torch.save(part.clone(), ref)
            assert len(buf.getvalue()) == len(ref.getvalue())
            buf.seek(0)
            back = torch.load(buf, weights_only=True)
            assert back.dtype == dtype and torch.equal(back, part)
    t = big.t()  # not contiguous: a copy
    assert _own_storage(t).is_contiguous() and torch.equal(_own_storage(t), t)


@pytest.mark.parametrize("direct", [True, False], ids=["direct-writes", "cached-writes"])
def test_safetensors_shards_reach_the_disk_before_the_writer_closes(tmp_path, monkeypatch, direct):
    """Every shard is on the disk before ``close`` returns (so before the output is renamed into place).  Written past
    the page cache, a shard is synced as it is finished (its bytes are already on the disk); written through the
    cache, nothing waits for the disk between shards (the next shard is written while the last goes out) and every
    shard is synced at ``close``."""
    import torch

    import workbench.conversion.hf_files as hf_files
    from workbench.models.common.conversion_rules import TensorInfo
    from workbench.checkpoint import DirectWriter

    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(hf_files.os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    plan = {f"t{i}": TensorInfo((256, 256), torch.float32) for i in range(6)}
    w = hf_files.SafetensorsWriter(tmp_path, plan, 2 * 256 * 256 * 4)
    for name, info in plan.items():
        w.write(name, torch.full(info.shape, float(name[1:])))
    if direct and not isinstance(w._fh, DirectWriter):
        pytest.skip("this file system refuses O_DIRECT writes")
    if not direct:
        assert synced == [], synced  # nothing waited for while writing
    names = w.close()
    assert len(names) == 3 and sorted({os.path.basename(p) for p in synced}) == sorted(names)
    from safetensors.torch import load_file

    got = {k: v for n in names for k, v in load_file(tmp_path / n).items()}
    assert all(torch.equal(got[k], torch.full((256, 256), float(k[1:]))) for k in plan)


def test_chunks_a_conversion_wrote_are_read_back_without_a_copy(ckpts, monkeypatch):
    """The converter writes each chunk aligned in its data file, so a reader makes each tensor over the bytes it read
    past the page cache (a weights-only load onto the meta device for the layout, no data copied out), and the
    values are the stored ones."""
    import io

    import torch

    import workbench.checkpoint.safe_load as safe_load
    from workbench.checkpoint import DcpReader, open_direct

    _, _, _, ckpt = ckpts
    data = _data_file(ckpt)
    fd = open_direct(str(data))
    if fd is None:
        pytest.skip("this file system refuses O_DIRECT: chunks are copied out of a read-only mapping instead")
    os.close(fd)
    loads, real = [], safe_load.safe_torch_load
    monkeypatch.setattr(safe_load, "safe_torch_load",
                        lambda f, **kw: loads.append(kw.get("map_location", "cpu")) or real(f, **kw))
    reader = DcpReader(data.parent)
    loads.clear()  # (its common state, read when it opens)
    got = {}
    for fqn, smd in reader.tensors.items():
        for c in smd.chunks:
            got[(fqn, tuple(c.offsets))] = reader.region(fqn, tuple(c.offsets), tuple(c.sizes))
    reader.finish()  # every tensor still alive: a buffer reused under one of them would show in the values below
    assert len(loads) == len(got) > 10 and set(loads) == {"meta"}, loads
    index = safe_load.read_dist_metadata(data.parent).storage_data
    for (fqn, offsets), t in got.items():  # the same chunks as torch.load reads them from the files
        info = next(i for k, i in index.items() if k.fqn == fqn and tuple(k.offset) == offsets)
        with open(data.parent / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            assert torch.equal(t, real(io.BytesIO(fh.read(info.length)), source=fqn)), fqn
    assert {i.relative_path for i in index.values()} == {"__0_0.distcp", "__0_1.distcp"}
