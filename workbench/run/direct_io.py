"""Large sequential reads that bypass the page cache (``O_DIRECT``), into page-aligned buffers that are reused.

A conversion reads every byte of a multi-GB checkpoint once.  Through the page cache (a memory-mapped range, or
``read()``) each byte costs the kernel a cache page to fill, map and later reclaim, and the process a fresh
allocation to fault in; a direct read moves the bytes from the disk into a buffer this process already holds.
:class:`DirectReads` does that for byte ranges of files: ``O_DIRECT`` reads whole 4 KiB blocks at 4 KiB offsets
into memory aligned the same way, so a range is widened to the blocks around it and the caller gets a view of the
bytes it asked for.  Where the file system refuses ``O_DIRECT`` (tmpfs, some network file systems) :meth:`open`
answers None and the caller reads as it otherwise would.  Bytes other processes wrote and the kernel has not yet
flushed are flushed before a direct read returns them (the kernel's rule), so a direct read sees what a cached one
would.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

#: offsets, lengths and buffer addresses of direct reads are multiples of this (the largest logical block size
#: Linux file systems use)
ALIGN = 4096
#: buffers are allocated in steps of this (fewer sizes, so one buffer serves the next ranges)
_STEP = 2 << 20


class DirectReads:
    """``O_DIRECT`` descriptors of files and the buffers their reads go into; thread-safe.

    :meth:`read` returns a buffer with a view of the range; :meth:`release` hands the buffer back once the view is no
    longer used (the largest idle buffer stays allocated for the next reads)."""

    KEEP = 1

    def __init__(self) -> None:
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    def open(self, path: str) -> int | None:
        """A direct descriptor of ``path`` (opened once), None where the file system refuses ``O_DIRECT``."""
        with self._lock:
            if path in self._fds:
                return self._fds[path]
        flag = getattr(os, "O_DIRECT", 0)
        fd = None
        if flag:
            try:
                fd = os.open(path, os.O_RDONLY | flag)
            except OSError:
                fd = None
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
        return mmap.mmap(-1, -(-n // _STEP) * _STEP)  # anonymous: page-aligned

    def release(self, buf: mmap.mmap) -> None:
        """Hand ``buf`` back (every view of it released first)."""
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=len, reverse=True)
            for old in self._idle[self.KEEP:]:
                old.close()
            del self._idle[self.KEEP:]

    def read(self, fd: int, offset: int, length: int) -> tuple[mmap.mmap, memoryview]:
        """``length`` bytes at ``offset`` of the file of direct descriptor ``fd`` (fewer at its end): (buffer, view of
        the bytes).  An ``OSError`` (say the file system refuses a direct read after all) leaves nothing taken."""
        start = offset - offset % ALIGN
        stop = -(-(offset + length) // ALIGN) * ALIGN
        buf = self._take(stop - start)
        whole = memoryview(buf)
        try:
            got = 0
            while start + got < stop:
                n = os.preadv(fd, [whole[got:stop - start]], start + got)
                got += n
                if n <= 0 or n % ALIGN:  # the end of the file
                    break
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
                b.close()
            self._idle = []
