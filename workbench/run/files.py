"""Small file and port helpers shared by the whole package (bottom layer: stdlib only).

- :func:`write_text_atomic` / :func:`write_json_atomic`: write a temp file next to the target,
  fsync it, then ``os.replace`` it over the target, so a reader never sees half a file;
  :func:`atomic_output` is the same for any writer (``torch.save(x, tmp)``).
- :func:`read_json`: a JSON file as a dict, or None when it is missing or unreadable.
- :func:`free_port`: a TCP port that was free a moment ago and that no outgoing connection can take (for a
  private rendezvous).

Whether a directory can be written at all: :mod:`workbench.writable`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from pathlib import Path
from typing import Any, Iterator

__all__ = ["atomic_output", "write_text_atomic", "write_json_atomic", "read_json", "free_port"]


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """A temp path next to ``path`` to write to; renamed over ``path`` when the block succeeds, removed if not."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str, *, fsync: bool = True) -> Path:
    """Replace ``path`` with ``text`` in one step (temp file in the same directory + ``os.replace``)."""
    path = Path(path)
    with atomic_output(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            if fsync:
                try:
                    os.fsync(fh.fileno())
                except OSError:
                    pass
    return path


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 2, fsync: bool = True) -> Path:
    """:func:`write_text_atomic` of ``json.dumps(data)`` (non-JSON values written with ``str``)."""
    return write_text_atomic(path, json.dumps(data, indent=indent, default=str), fsync=fsync)


def read_json(path: str | Path) -> dict | None:
    """The JSON object in ``path``; None when the file is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


#: ports :func:`free_port` hands out start here and stay below the OS's ephemeral range
PORT_FLOOR = 20000


def _ephemeral_floor() -> int:
    """The lowest port the OS gives an outgoing connection (Linux: ``ip_local_port_range``; 32768 when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` and on every address (IPv4 and, where the machine has it, IPv6):
    a rendezvous store listens on all of them, so a listener on any address takes the port from it."""
    for family, addr in ((socket.AF_INET, host), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            try:
                sock.bind((addr, port))
            except OSError as e:
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 present but without an address to bind
                return False
    return True


def _lock(fh, seconds: float = 5.0) -> bool:
    """Take ``fh``'s exclusive lock within ``seconds`` (a caller stopped while holding it must not hang the rest)."""
    import fcntl
    import time

    end = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as e:  # only a lock another holds is waited for; any other failure: no lock at once
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) or time.monotonic() > end:
                return False
            time.sleep(0.01)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that no one was listening on when asked, for a listener bound a moment later.

    The port comes from below the OS's ephemeral range, so no outgoing connection (a gloo pair, a client socket of
    another process) can take it between this call and the listener's bind, as one the OS picks can (seen: a
    rendezvous store's ``EADDRINUSE`` under parallel tests).  Processes on the machine take ports in turn through a
    locked counter file in the temp dir, so two callers a moment apart never get the same one.  Where that file
    cannot be used (or its lock is held for seconds), or the range below the ephemeral one is too small, the OS
    picks."""
    import random
    import tempfile

    ceiling = _ephemeral_floor()
    span = ceiling - PORT_FLOOR
    if span >= 1000:
        try:
            with open(Path(tempfile.gettempdir()) / f"workbench-ports-{os.getuid()}", "a+") as fh:
                if not _lock(fh):
                    raise OSError("the port counter's lock is held")
                fh.seek(0)
                try:
                    last = int(fh.read().strip())
                except ValueError:
                    last = PORT_FLOOR + random.randrange(span)
                for step in range(1, span + 1):
                    port = PORT_FLOOR + (last - PORT_FLOOR + step) % span
                    if _bindable(host, port):
                        fh.seek(0)
                        fh.truncate()
                        fh.write(str(port))
                        fh.flush()
                        return port
        except OSError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
