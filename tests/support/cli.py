"""``workbench ARGS`` in the test process (``workbench.cli.main``): the exit code and output a shell would see.

For the refusals and reports that need no rank process: calling ``main`` skips a fresh interpreter's ~5 s of
importing torch and megatron-core.  A command that exits (argparse, ``SystemExit``) is read as the interpreter
would: ``None`` is 0, an int is itself, a message is 1 with the message on stderr.  Tests that check what a real
shell sees (exit status of a process, its own stderr) keep one real process.
"""

from __future__ import annotations

import subprocess
from typing import Any

__all__ = ["cli_process", "run_cli"]


def cli_process(argv: Any, capsys: Any) -> subprocess.CompletedProcess:
    """Run ``workbench`` with ``argv`` (any values, made strings) in this process; ``capsys`` is pytest's fixture."""
    from workbench.cli import main

    args = [str(a) for a in argv]
    capsys.readouterr()
    message = ""
    try:
        code = main(args)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        message = "" if e.code is None or isinstance(e.code, int) else f"{e.code}\n"
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err + message)


def run_cli(argv: Any, capsys: Any) -> tuple[int, str]:
    """:func:`cli_process` as (exit code, stdout + stderr)."""
    res = cli_process(argv, capsys)
    return res.returncode, res.stdout + res.stderr
