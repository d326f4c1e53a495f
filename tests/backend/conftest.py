"""Fixtures of the backend tests."""

import pytest

from tests.support import free_port
from workbench.config import preset


@pytest.fixture(scope="module")
def dist_group():
    """megatron-core's process groups over one CPU rank (gloo), for the tiny preset it yields."""
    from workbench.backend import cpu_mode
    from workbench.backend.distributed import destroy, initialize_for_tests

    cfg = preset("tiny")
    initialize_for_tests(cfg, port=free_port())
    yield cfg
    destroy()
    cpu_mode.disable()
