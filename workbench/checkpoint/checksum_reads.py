"""A checkpoint's files read once while their checksums are taken (a conversion's reader).

:class:`ChecksummedReads` reads byte ranges of a checkpoint's data files past the page cache where the file system
allows (:class:`workbench.checkpoint.direct_io.DirectReads`), hashes them on helper threads while the caller uses them,
and compares every checksum of the save's list (:mod:`workbench.checkpoint.integrity`) after the last read.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

from workbench.checkpoint.direct_io import DirectReads
from workbench.checkpoint.integrity import _damaged, _manifest, _mismatch, _sha256, _unverifiable, checkpoint_member
from workbench.checkpoint.names import METADATA_FILE, CheckpointError

__all__ = ["ChecksummedReads", "HeldRange"]


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


class HeldRange:
    """Bytes :meth:`ChecksummedReads.hold` read: :attr:`view` until :meth:`done` (thread-safe, once); the bytes'
    buffer is reused once :meth:`done` is called and their hash is taken.  ``writable``: the bytes are in memory of
    this process (not a read-only mapping of the file), so an array over them may be written."""

    def __init__(self, view: memoryview, let_go: Any, writable: bool = False, hashed: Any = None) -> None:
        self.view, self.writable = view, writable
        self._let_go, self._parts, self._lock, self._done = let_go, 2 if hashed is not None else 1, threading.Lock(), False
        if hashed is not None:
            hashed.add_done_callback(lambda _: self._part_done())

    def _part_done(self) -> None:
        with self._lock:
            self._parts -= 1
            last = self._parts == 0
        if last and self._let_go is not None:
            self._let_go()

    def done(self) -> None:
        """The caller no longer uses the bytes (a second call does nothing)."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._part_done()


class ChecksummedReads:
    """Byte ranges of the files of checkpoint directory ``d``, read while their SHA-256 is taken: a conversion reads
    each byte once, where a verification followed by the conversion's own reads would read it twice.

    For a directory :func:`verify_checkpoint` has passed with ``hashes=False`` (names, sizes, byte ranges, the
    closed list of files).  The files of the checksum list not in ``streamed`` are hashed when it opens; each file
    of ``streamed`` as it is read: :meth:`read` hashes the bytes that continue the file from where its hash stands
    (a gap of up to :attr:`GAP` bytes is read and hashed first), and :meth:`finish` hashes whatever was not read in
    that order and compares every checksum.  A file that differs is the :class:`CheckpointError`
    :func:`verify_checkpoint` raises for it, when it opens or from :meth:`finish`; until :meth:`finish` returns,
    what was read is known only to have loaded as weights-only data, so the caller writes into a staging directory
    it removes when :meth:`finish` raises.  One thread reads at a time (a conversion's read thread): the hashes
    follow the order of the reads."""

    #: the largest stretch of a streamed file read (and hashed) only to keep its hash going
    GAP = 4 << 20
    #: a range at least this long is hashed on a helper thread while the caller uses it
    PARALLEL = 4 << 20
    #: how many ranges may still be hashing once the caller is done with them: the next ranges are read from the
    #: disk while the last are hashed, one per file of a checkpoint written in two (each keeps its buffer until hashed)
    BEHIND = 2

    def __init__(self, d: str | Path, streamed: Any) -> None:
        self.dir = Path(d)
        manifest = _manifest(self.dir)
        if manifest is None:
            raise CheckpointError(_unverifiable(self.dir))
        want: dict[str, str] = {}
        problems: list[str] = []
        for name, rec in sorted(manifest.items()):
            f = checkpoint_member(self.dir, name, source=str(self.dir / METADATA_FILE), what="the file", entry='its "files" list')
            sha = rec.get("sha256") if isinstance(rec, dict) else None
            if not sha:
                continue
            if name in streamed:
                want[name] = sha
            elif not f.is_file():
                problems.append(f"{f} is missing")
            elif _sha256(f) != sha:
                problems.append(_mismatch(f))
        if problems:
            raise _damaged(self.dir, problems)
        self._want = want
        self._sha = {n: hashlib.sha256() for n in want}
        self._pos = {n: 0 for n in want}
        self._fds: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._lock = threading.Lock()
        self._pools: dict[str, Any] = {}
        self._behind: collections.deque = collections.deque()  # the hash futures of ranges not yet settled, oldest first
        self._direct: DirectReads | None = DirectReads(keep=self.BEHIND + 1)

    def _fd(self, name: str) -> int:
        if name not in self._fds:
            path = checkpoint_member(self.dir, name, source=f"checkpoint {self.dir}", what="the file")
            self._fds[name], self._paths[name] = os.open(path, os.O_RDONLY), str(path)
        return self._fds[name]

    def _pread(self, name: str, length: int, offset: int) -> bytes:
        fd = self._fd(name)
        data = os.pread(fd, length, offset)
        if 0 < len(data) < length:  # a read of more than the kernel hands out at once
            parts = [data]
            got = len(data)
            while got < length:
                more = os.pread(fd, length - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        return data

    def _hash(self, name: str, offset: int, data: Any) -> None:
        """Take the bytes ``data`` at ``offset`` of ``name`` into its hash where they continue it (after a short gap)."""
        if name not in self._sha:
            return
        sha, pos = self._sha[name], self._pos[name]
        if pos < offset <= pos + self.GAP:
            sha.update(self._pread(name, offset - pos, pos))
            pos = offset
        if offset <= pos < offset + len(data):
            sha.update(data[pos - offset:])
            self._pos[name] = offset + len(data)

    @contextlib.contextmanager
    def view(self, name: str, offset: int, length: int) -> Iterator[memoryview]:
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed (a large range on a helper
        thread while the block runs); valid inside the block only (:meth:`hold`)."""
        held = self.hold(name, offset, length)
        try:
            yield held.view
        finally:
            held.done()

    def hold(self, name: str, offset: int, length: int) -> "HeldRange":
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed: a large range on a helper
        thread while the caller uses it (the reads go on meanwhile; at most :attr:`BEHIND` ranges still hashing).
        Read past the page cache into a reused buffer (:class:`workbench.checkpoint.direct_io.DirectReads`) where the file
        system allows (``writable``), else memory-mapped read-only (the kernel copies nothing; unmapped once let go,
        so the pages leave the process).  The caller calls :meth:`HeldRange.done` when it no longer uses the bytes;
        the buffer is reused once that is called and the hash is taken."""
        import mmap

        with self._lock:
            fd = self._fd(name)
            end = min(offset + length, os.fstat(fd).st_size)
        if end <= offset:
            return HeldRange(memoryview(b""), None)
        direct, pooled = self._direct, False
        dfd = direct.open(self._paths[name]) if direct is not None else None
        if dfd is not None and not _same_file(dfd, fd):  # the path names another file now: read the one opened
            dfd = None
        if dfd is not None:
            try:
                buf, mv = direct.read(dfd, offset, end - offset)
                pooled = True
            except OSError:  # refused after all: cached reads from now on
                self._direct = None
                direct.close()
        if not pooled:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            buf = mmap.mmap(fd, end - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ, offset=start)
            mv = memoryview(buf)[offset - start:]

        def let_go() -> None:
            try:
                mv.release()
            except BufferError:  # a caller's array of these bytes is being freed: it lets go of them itself
                pass
            if pooled:
                direct.release(buf)
            else:
                try:
                    buf.close()
                except BufferError:  # (as above: unmapped once the last view goes)
                    pass

        if len(mv) < self.PARALLEL and not self._behind:
            try:
                self._hash(name, offset, mv)
            except BaseException:
                let_go()
                raise
            return HeldRange(mv, let_go, writable=pooled)
        if name not in self._pools:  # a thread per file: files read side by side are hashed side by side
            self._pools[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wb-checksum")
        hashed = self._pools[name].submit(self._hash, name, offset, mv)  # one thread: in the order of the reads
        held = HeldRange(mv, let_go, writable=pooled, hashed=hashed)
        self._behind.append(hashed)
        self._settle(self.BEHIND)
        return held

    def _settle(self, keep: int) -> None:
        """Wait for the hashes still running until at most ``keep`` are (an error of one is raised here)."""
        while len(self._behind) > keep:
            self._behind.popleft().result()

    def read(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``name`` from ``offset`` (fewer at its end), hashed (:meth:`view`, copied out)."""
        with self.view(name, offset, length) as mv:
            return bytes(mv)

    def finish(self) -> None:
        """Hash the rest of every streamed file and compare; the :class:`CheckpointError` naming each that differs."""
        problems = []
        self._settle(0)
        with self._lock:
            for name, want in sorted(self._want.items()):
                sha, pos = self._sha[name], self._pos[name]
                while True:
                    block = self._pread(name, 16 << 20, pos)
                    if not block:
                        break
                    sha.update(block)
                    pos += len(block)
                self._pos[name] = pos
                if sha.hexdigest() != want:
                    problems.append(_mismatch(self.dir / name))
            self.close()
        if problems:
            raise _damaged(self.dir, problems)

    def close(self) -> None:
        while getattr(self, "_behind", None):  # after a failed read too: no buffer goes while its hash reads it
            try:
                self._settle(0)
            except Exception:  # noqa: BLE001  (closing after a failure: the failure is what is reported)
                pass
        for pool in getattr(self, "_pools", {}).values():
            pool.shutdown(wait=False)  # idle: every hash it ran was waited for (and this may run on its thread)
        self._pools = {}
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}
        if getattr(self, "_direct", None) is not None:
            self._direct.close()

    def __del__(self) -> None:
        self.close()
