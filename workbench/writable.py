"""Whether a directory can be written, asked before a long job writes there (bottom layer: stdlib only).

- :func:`existing_ancestor`: where a directory that is missing would be made (the nearest existing ancestor).
- :func:`dir_write_problem`: why no file can be made in a directory (made if missing), as a phrase naming the path.

``workbench preprocess`` asks before it tokenizes; the launch checks (:mod:`workbench.launch.preflight`) ask of every
directory a run writes.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["existing_ancestor", "dir_write_problem"]


def existing_ancestor(p: str | Path) -> Path:
    """``p`` (absolute) or its nearest ancestor that exists: where a directory to be made would be made."""
    p = Path(p).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


_WRITE_ERRORS = {errno.EROFS: "is on a read-only file system", errno.EACCES: "is not writable by this user",
                 errno.EPERM: "is not writable by this user", errno.ENOSPC: "is on a full file system"}


def dir_write_problem(d: str | Path) -> str | None:
    """Why no file can be made in directory ``d`` (made if missing; nothing is made here but a probe file in the nearest
    existing ancestor, removed at once), as a phrase naming the path; None when one can."""
    d = Path(d).expanduser().absolute()
    base = existing_ancestor(d)
    prefix = "" if base == d else f"{d} cannot be made: "
    if not base.is_dir():
        return f"{prefix}{base} is a file, not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".workbench-probe-", dir=base)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        what = _WRITE_ERRORS.get(e.errno or 0)
        return f"{prefix}{base} {what}" if what else f"{prefix}no file can be made in {base} ({e.strerror or e})"
    return None
