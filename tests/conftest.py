"""Fixtures shared by every test folder (unit/, multiprocess/, notebooks/).

Plain helpers (no fixtures) live in ``tests/support``; test files import those from there and
never from each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import free_port as _free_port
from tests.support import write_rank_script


@pytest.fixture()
def free_port() -> int:
    """A TCP port that is free right now on 127.0.0.1 (for a rendezvous / master port)."""
    return _free_port()


@pytest.fixture()
def rank_script(tmp_path: Path) -> Path:
    """The launch's fake rank (``tests.support.RANK_SCRIPT``) as a script in this test's tmp dir."""
    return write_rank_script(tmp_path)
