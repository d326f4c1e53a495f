"""The run contract, torch-free: what a run directory holds and how it is written and read.

- :mod:`workbench.run.events`: typed event records (one dataclass per kind) and :class:`EventWriter`.
- :mod:`workbench.run.reader`: :class:`RunReader`, the one incremental reader of a run directory
  (events by kind, kernel path and layout, ``launch.json``, ``exit_status.json``, ``config.json``).
- :mod:`workbench.run.files`: atomic file writes, ``read_json``, ``free_port``.
- :mod:`workbench.run.nodes`: a multi-node run's shared run directory (one set of launch files
  per node).
- :mod:`workbench.run.writer`: one writer per checkpoint folder (the claim a launch, or a backend's rank 0, holds
  on ``checkpoint.save_dir``).

The processes that write and follow a run directory are :mod:`workbench.launch`; a checkpoint's format, metadata
(``workbench.json``) and integrity are :mod:`workbench.checkpoint`.

Nothing here imports torch or megatron-core.
"""

from workbench.run.events import (  # noqa: F401
    KINDS, Checkpoint, Error, Eval, Event, EventWriter, Layout, Microbatch, RunEnd, RunStart, Step, event_file, events_dir,
    parse_line, parse_record,
)
from workbench.run.files import free_port, read_json, write_json_atomic, write_text_atomic  # noqa: F401
from workbench.run.reader import RunReader, read_events, read_records  # noqa: F401
