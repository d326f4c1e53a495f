"""Large sequential file I/O past the page cache (``O_DIRECT``), through page-aligned buffers that are reused.

A conversion reads and writes every byte of a multi-GB checkpoint once.  Through the page cache each byte costs the
kernel a cache page to fill (or dirty), map and later reclaim or write back, and the process a fresh allocation to
fault in; a direct read or write moves the bytes between the disk and a buffer this process already holds.
``O_DIRECT`` moves whole 4 KiB blocks at 4 KiB offsets to and from memory aligned the same way:

- :class:`DirectReads` reads byte ranges of files: a range is widened to the blocks around it and the caller gets a
  view of the bytes it asked for.  Bytes other processes wrote and the kernel has not yet flushed are flushed
  before a direct read returns them (the kernel's rule), so a direct read sees what a cached one would.
- :class:`DirectWriter` writes a file front to back through staging buffers (:func:`open_for_writing`).

Where the platform or file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6, some network file systems),
:func:`open_direct` answers None and :func:`open_for_writing` a plain buffered file, and callers read and write
through the page cache as they otherwise would.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Any

#: offsets, lengths and buffer addresses of direct reads are multiples of this (the largest logical block size
#: Linux file systems use)
ALIGN = 4096
#: buffers are allocated in steps of this (fewer sizes, so one buffer serves the next ranges)
_STEP = 2 << 20


def open_direct(path: str) -> int | None:
    """A read-only ``O_DIRECT`` descriptor of ``path``, None where the platform or file system refuses one."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


def read_blocks(fd: int, dst: Any, start: int) -> int:
    """Fill ``dst`` (page-aligned, a multiple of :data:`ALIGN` long) from direct descriptor ``fd`` at ``start`` (a
    multiple of :data:`ALIGN`); the bytes read, fewer at the end of the file."""
    view, got = memoryview(dst).cast("B"), 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], start + got)
        got += n
        if n <= 0 or n % ALIGN:  # the end of the file
            break
    return got


class DirectReads:
    """``O_DIRECT`` descriptors of files and the buffers their reads go into; thread-safe.

    :meth:`read` returns a buffer with a view of the range; :meth:`release` hands the buffer back once the view is no
    longer used (the ``keep`` largest idle buffers stay allocated for the next reads: as many as a reader holds at
    once, so no read waits for fresh pages)."""

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    def open(self, path: str) -> int | None:
        """A direct descriptor of ``path`` (opened once, closed by :meth:`close`), None where the file system refuses
        ``O_DIRECT``."""
        with self._lock:
            if path in self._fds:
                return self._fds[path]
        fd = open_direct(path)
        with self._lock:
            if path in self._fds:  # another thread opened it meanwhile
                if fd is not None:
                    os.close(fd)
                return self._fds[path]
            if fd is not None:
                self._fds[path] = fd
            return fd

    def _take(self, n: int) -> mmap.mmap:
        with self._lock:
            fits = [b for b in self._idle if len(b) >= n]
            if fits:
                buf = min(fits, key=len)
                self._idle.remove(buf)
                return buf
        buf = mmap.mmap(-1, max(1, -(-n // _STEP)) * _STEP)  # anonymous: page-aligned
        if hasattr(mmap, "MADV_HUGEPAGE"):  # fresh memory on huge pages: faulted in at several times the pace
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        return buf

    def release(self, buf: mmap.mmap) -> None:
        """Hand ``buf`` back (every view of it released first)."""
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=len, reverse=True)
            for old in self._idle[self.keep:]:
                try:
                    old.close()
                except BufferError:  # an array over it is being freed: unmapped once it has gone
                    pass
            del self._idle[self.keep:]

    def read(self, fd: int, offset: int, length: int) -> tuple[mmap.mmap, memoryview]:
        """``length`` bytes at ``offset`` of the file of direct descriptor ``fd`` (fewer at its end): (buffer, view of
        the bytes).  An ``OSError`` (say the file system refuses a direct read after all) leaves nothing taken."""
        start = offset - offset % ALIGN
        stop = -(-(offset + length) // ALIGN) * ALIGN
        buf = self._take(stop - start)
        whole = memoryview(buf)
        try:
            got = read_blocks(fd, whole[:stop - start], start)
        except BaseException:
            whole.release()
            self.release(buf)
            raise
        lo = offset - start
        view = whole[lo:max(lo, min(got, lo + length))]
        whole.release()
        return buf, view

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            for b in self._idle:
                try:
                    b.close()
                except BufferError:  # an array over it is being freed: unmapped once it has gone
                    pass
            self._idle = []


class DirectWriter:
    """A file written front to back past the page cache: :meth:`write` copies into page-aligned staging buffers, and
    each full buffer goes to the disk (``O_DIRECT``) on a helper thread while the next fills; :meth:`close` writes
    the tail (padded to a block, then the file cut to its size) and syncs the file.  With ``hashed``, the file's
    SHA-256 (:attr:`sha`) is taken from the same buffers on a second helper thread, in file order, while they are
    written.  Where the file system refuses ``O_DIRECT``, :func:`open_for_writing` returns a plain buffered file
    instead.  The bytes of the file are whatever :meth:`write` was given, in order; an error of a helper thread is
    raised by a later call."""

    BLOCK = 16 << 20  # bytes per direct write: 8 MB blocks wrote the Llama-3.1-8B shape 16% slower (megatron-to-hf)
    BUFFERS = 3  # staging buffers: the one filling, and up to two being written (and hashed)

    def __init__(self, fd: int, path: str, hashed: bool = False) -> None:
        import hashlib
        from concurrent.futures import ThreadPoolExecutor

        self.name = path
        self._fd, self._size, self._fill = fd, 0, 0
        self._bufs = [mmap.mmap(-1, self.BLOCK) for _ in range(self.BUFFERS)]
        self._pending: list[list[Any]] = [[] for _ in self._bufs]  # per buffer: the work still reading it
        self._cur = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-direct-write")  # one: writes in order
        self.sha: Any = hashlib.sha256() if hashed else None
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-direct-hash") if hashed else None
        self._written = 0  # bytes on the disk (a multiple of ALIGN until the tail)
        self.closed = False

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], []
        for f in pending:
            f.result()

    def _write_block(self, buf: mmap.mmap, n: int, offset: int) -> None:
        view = memoryview(buf)[:n]
        try:
            done = 0
            while done < n:
                k = os.pwrite(self._fd, view[done:], offset + done)
                if k <= 0 or (done + k < n and k % ALIGN):  # nothing written, or a rest no direct write can take
                    raise OSError(errno.EIO, f"{self.name}: a direct write of {n - done} bytes wrote {k}")
                done += k
        finally:
            view.release()

    def _hash_block(self, buf: mmap.mmap, n: int) -> None:
        view = memoryview(buf)[:n]
        try:
            self.sha.update(view)
        finally:
            view.release()

    def _flush_full(self) -> None:
        """Send the current (full) buffer to the disk (and the hash) and move to the next one, once it is free."""
        i, buf = self._cur, self._bufs[self._cur]
        self._pending[i].append(self._io.submit(self._write_block, buf, self.BLOCK, self._written))
        if self._hasher is not None:
            self._pending[i].append(self._hasher.submit(self._hash_block, buf, self.BLOCK))
        self._written += self.BLOCK
        self._cur, self._fill = (i + 1) % len(self._bufs), 0
        self._wait(self._cur)

    def write(self, data: Any) -> int:
        import numpy as np

        src = memoryview(data).cast("B")
        n, done = len(src), 0
        while done < n:
            k = min(self.BLOCK - self._fill, n - done)
            # without the GIL; no array over the buffer outlives the copy (a buffer with a view cannot be closed)
            np.copyto(np.frombuffer(self._bufs[self._cur], np.uint8, k, self._fill), np.frombuffer(src, np.uint8, k, done))
            self._fill += k
            done += k
            if self._fill == self.BLOCK:
                self._flush_full()
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass  # the bytes reach the disk in blocks, and at close()

    def _finish_threads(self) -> None:
        try:
            for i in range(len(self._bufs)):
                self._wait(i)
        finally:
            self._io.shutdown(wait=True)
            if self._hasher is not None:
                self._hasher.shutdown(wait=True)

    def close(self) -> None:
        """The tail written, the file cut to its size and synced to the disk."""
        if self.closed:
            return
        try:
            self._finish_threads()
            if self._fill:
                tail = -(-self._fill // ALIGN) * ALIGN
                buf = self._bufs[self._cur]
                if self.sha is not None:
                    self._hash_block(buf, self._fill)
                buf[self._fill:tail] = bytes(tail - self._fill)
                self._write_block(buf, tail, self._written)
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            self._release()

    def abort(self) -> None:
        """Close without finishing the file (a write that failed: its directory is removed)."""
        if not self.closed:
            try:
                self._finish_threads()
            except OSError:
                pass
            finally:
                self._release()

    def _release(self) -> None:
        self.closed = True
        os.close(self._fd)
        for b in self._bufs:
            try:
                b.close()
            except BufferError:  # still viewed by a caller's traceback: freed with it
                pass
        self._bufs = []

    def __enter__(self) -> "DirectWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close() if exc[0] is None else self.abort()


def open_for_writing(path: str, hashed: bool = False) -> Any:
    """``path`` created (truncated) for writing front to back: a :class:`DirectWriter` where the file system takes
    ``O_DIRECT`` (``hashed``: taking the file's SHA-256 as it writes), else a plain buffered binary file.  Either has
    ``write``, ``tell``, ``flush`` and ``close``; close of a :class:`DirectWriter` also syncs the file to the disk."""
    flag = getattr(os, "O_DIRECT", 0)
    if flag:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o666)  # the umask applies, as to open()
        except OSError:
            fd = None
        if fd is not None:
            probe = mmap.mmap(-1, ALIGN)  # page-aligned, as a direct write's memory must be
            try:
                os.pwrite(fd, probe, 0)  # some file systems accept the flag but refuse the write
                os.ftruncate(fd, 0)
            except OSError:
                os.close(fd)
                fd = None
            finally:
                probe.close()
            if fd is None:
                return open(path, "wb")
            try:
                return DirectWriter(fd, str(path), hashed)
            except BaseException:
                os.close(fd)
                raise
    return open(path, "wb")


def close_synced(fh: Any) -> None:
    """Close a file :func:`open_for_writing` opened, its bytes on the disk first."""
    if isinstance(fh, DirectWriter):
        fh.close()
        return
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()


def abandon(fh: Any) -> None:
    """Close a file :func:`open_for_writing` opened without finishing it (its directory is about to be removed)."""
    if isinstance(fh, DirectWriter):
        fh.abort()
    else:
        fh.close()
