"""Direct (O_DIRECT) reads of byte ranges: the exact bytes at any offset and length, buffers reused."""

import os

import pytest

from workbench.checkpoint import ALIGN, DirectReads, DirectWriter


@pytest.fixture()
def data_file(tmp_path):
    data = os.urandom(5 * ALIGN + 123)
    f = tmp_path / "data.bin"
    f.write_bytes(data)
    return str(f), data


def test_ranges_at_any_offset_and_length_are_the_file_s_bytes(data_file):
    path, data = data_file
    reads = DirectReads()
    fd = reads.open(path)
    if fd is None:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        for offset, length in [(0, 0), (ALIGN, 0), (0, len(data)), (1, 10), (ALIGN - 1, 2), (ALIGN, ALIGN),
                               (3 * ALIGN + 7, 10_000), (len(data) - 5, 100), (len(data), 10), (17, 0)]:
            buf, view = reads.read(fd, offset, length)
            assert bytes(view) == data[offset:offset + length], (offset, length)
            view.release()
            reads.release(buf)
    finally:
        reads.close()


def test_a_buffer_handed_back_serves_the_next_read_and_only_the_largest_idle_one_is_kept(tmp_path):
    data = os.urandom(5 << 20)  # more than one allocation step (2 MiB): the buffers differ in size
    path = str(tmp_path / "big.bin")
    (tmp_path / "big.bin").write_bytes(data)
    reads = DirectReads()
    fd = reads.open(path)
    if fd is None:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        big, v1 = reads.read(fd, 0, len(data))
        small, v2 = reads.read(fd, 0, 10)  # the big one is taken: a second buffer
        assert small is not big
        v1.release(), v2.release()
        reads.release(small)
        reads.release(big)
        assert small.closed and not big.closed  # one idle buffer stays: the largest
        again, v3 = reads.read(fd, 100, 10)
        assert again is big and bytes(v3) == data[100:110]
        v3.release()
        reads.release(again)
    finally:
        reads.close()
    assert big.closed


def _chunks(total: int, seed: int = 0) -> list[bytes]:
    import random

    rng, out, n = random.Random(seed), [], 0
    while n < total:
        k = min(total - n, rng.choice([1, 7, 4096, 4095, 100_003, 3 << 20, 9 << 20]))
        out.append(os.urandom(k))
        n += k
    return out


def _direct_writer(path, hashed: bool = False) -> DirectWriter:
    """A :class:`DirectWriter` of ``path``; the test is skipped where the file system refuses O_DIRECT writes."""
    from workbench.checkpoint import open_for_writing

    fh = open_for_writing(str(path), hashed=hashed)
    if not isinstance(fh, DirectWriter):
        fh.close()
        pytest.skip("this file system refuses O_DIRECT writes")
    return fh


def test_a_direct_writer_s_file_is_exactly_the_bytes_written(tmp_path):
    from workbench.checkpoint import close_synced

    path = tmp_path / "out.bin"
    fh = _direct_writer(path)
    parts = _chunks(2 * DirectWriter.BLOCK + 12345)  # two full blocks and an unaligned tail
    for p in parts:
        assert fh.write(memoryview(p)) == len(p)
    assert fh.tell() == sum(map(len, parts))
    close_synced(fh)
    assert path.read_bytes() == b"".join(parts)


@pytest.mark.parametrize("blocks", [0, 1, DirectWriter.BUFFERS + 2])
def test_a_hashing_direct_writer_s_sha256_is_the_file_s(tmp_path, blocks):
    """Whole blocks hashed on the helper thread (more than there are buffers: each buffer reused), then the tail."""
    import hashlib

    from workbench.checkpoint import close_synced

    path = tmp_path / "out.bin"
    fh = _direct_writer(path, hashed=True)
    for p in _chunks(blocks * DirectWriter.BLOCK + 777, seed=blocks):
        fh.write(p)
    close_synced(fh)
    assert fh.sha.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_where_direct_writes_are_refused_a_plain_file_takes_them(tmp_path, monkeypatch):
    from workbench.checkpoint import close_synced, open_for_writing

    monkeypatch.delattr(os, "O_DIRECT", raising=False)  # a platform or file system without it
    fh = open_for_writing(str(tmp_path / "out.bin"))
    assert not isinstance(fh, DirectWriter)
    parts = _chunks(5 << 20, seed=1)
    for p in parts:
        fh.write(p)
    close_synced(fh)
    assert (tmp_path / "out.bin").read_bytes() == b"".join(parts)


def test_an_abandoned_direct_writer_lets_go_of_its_file(tmp_path):
    from workbench.checkpoint import abandon

    path = tmp_path / "out.bin"
    fh = _direct_writer(path)
    fh.write(os.urandom(DirectWriter.BLOCK + 5))
    abandon(fh)
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(path) not in held
    path.unlink()


def test_a_failed_direct_write_is_raised_and_abandoning_the_writer_raises_nothing(tmp_path, monkeypatch):
    """A write the disk refuses (here: no space) comes back from a later ``write``, as that error; abandoning the
    writer after it lets go of the file and raises nothing of its own."""
    import errno

    from workbench.checkpoint import abandon

    path = tmp_path / "out.bin"
    fh = _direct_writer(path)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError) as e:
        for _ in range(DirectWriter.BUFFERS + 2):
            fh.write(os.urandom(DirectWriter.BLOCK))
    assert e.value.errno == errno.ENOSPC
    abandon(fh)
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(path) not in held
