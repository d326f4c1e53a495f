"""``workbench.data`` re-exports its modules' functions by name (imported on first use): the name is the function,
also where a module of the same name exists (``preprocess``, ``inspect``-style clashes)."""

from __future__ import annotations

import subprocess
import sys


def test_every_re_exported_name_is_what_its_module_defines():
    code = (
        "import workbench.data as d\n"
        "from workbench.data import preprocess\n"
        "assert callable(preprocess) and preprocess.__module__ == 'workbench.data.preprocess', preprocess\n"
        "for name in d.__all__:\n"
        "    assert getattr(d, name) is not None, name\n"
        "assert d.preprocess is preprocess\n"
        "from workbench.data import *  # noqa: F401,F403\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
