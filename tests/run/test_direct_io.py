"""Direct (O_DIRECT) reads of byte ranges: the exact bytes at any offset and length, buffers reused."""

import os

import pytest

from workbench.run.direct_io import ALIGN, DirectReads


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
        for offset, length in [(0, len(data)), (1, 10), (ALIGN - 1, 2), (ALIGN, ALIGN), (3 * ALIGN + 7, 10_000),
                               (len(data) - 5, 100), (len(data), 10), (17, 0)]:
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
