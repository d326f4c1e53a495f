"""Checkpoints: the format, its metadata, its integrity and safe reading, in one package.  Torch-free at import.

- :mod:`~workbench.checkpoint.names`: the tree's names (``iter_XXXXXXX``, the tracker, ``workbench.json``), the
  completeness test, :class:`CheckpointError`.  Stdlib only.
- :mod:`~workbench.checkpoint.tree`: which iteration a path means (:func:`find_checkpoint`); what a killed save left.
- :mod:`~workbench.checkpoint.meta`: ``workbench.json`` (:class:`CheckpointMeta`), the recorded config as data, the
  checks before a load (:func:`load_problems`, :func:`checkpoint_info`): what crosses to the notebook side, typed.
- :mod:`~workbench.checkpoint.config_check`: does the recorded config describe the stored tensors.
- :mod:`~workbench.checkpoint.safe_load`: the allow-list unpickler, ``torch.load(weights_only=True)``, and torch's and
  megatron-core's readers patched while a load runs (:func:`safe_dist_reading`).
- :mod:`~workbench.checkpoint.integrity`: the checksum list (``"files"``) and :func:`verify_checkpoint`.
- :mod:`~workbench.checkpoint.checksum_reads`: a checkpoint's files read once while their checksums are taken.
- :mod:`~workbench.checkpoint.direct_io`: large sequential reads and writes past the page cache (``O_DIRECT``).
- :mod:`~workbench.checkpoint.dcp`: torch's DCP (``torch_dist``) files read and written by hand, chunk by chunk.
- :mod:`~workbench.checkpoint.dist`: megatron-core's dist-checkpoint save and load on the ranks (RNG states, vocab
  re-padding); imports torch and megatron-core when called.

Other packages import from here, not from the modules.
"""

from workbench.checkpoint.checksum_reads import ChecksummedReads  # noqa: F401
from workbench.checkpoint.dcp import NOWHERE, DATA_FILES, DcpReader, DcpWriter, common_unique_key, pickled_list  # noqa: F401
from workbench.checkpoint.direct_io import (  # noqa: F401
    ALIGN, DirectReads, DirectWriter, abandon, close_synced, open_direct, open_for_writing, read_blocks,
)
from workbench.checkpoint.dist import (  # noqa: F401
    CheckpointSaveError, checkpoint_tensor_shapes, finish_save, load_checkpoint, save_checkpoint, vocab_keys,
)
from workbench.checkpoint.integrity import checkpoint_damage, file_manifest, record_checksums, verify_checkpoint  # noqa: F401
from workbench.checkpoint.meta import (  # noqa: F401
    CheckpointInfo, CheckpointMeta, checkpoint_config, checkpoint_info, hook_note, load_problems, read_checkpoint,
    read_metadata, recorded_hooks,
)
from workbench.checkpoint.names import FORMAT, METADATA_FILE, TRACKER_FILE, CheckpointError, iter_dir_name, list_checkpoints  # noqa: F401
from workbench.checkpoint.safe_load import read_dist_metadata, safe_dist_reading, safe_torch_load  # noqa: F401
from workbench.checkpoint.tree import find_checkpoint, partial_dir_name, remove_stale_partials  # noqa: F401
