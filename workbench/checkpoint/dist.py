"""The one checkpoint format of the workbench, saved and loaded by the ranks: mcore dist checkpoints in an iteration tree.

Layout of a checkpoint ROOT::

    ROOT/
      iter_0000100/                      # an mcore dist_checkpointing (torch_dist) save
        .metadata, __*.distcp, metadata.json
        workbench.json                   # {"format": "workbench-mcore-v1", "iteration", "config", "files", "complete": true, ...}
      latest_checkpointed_iteration.txt  # written LAST, atomically (tmp + os.replace)

Why this shape: dist checkpoints store *global* tensors keyed by stock megatron-core
names, so a checkpoint written at one TP/PP/VPP loads at any other; the iteration
tree and the tracker file are what Megatron-LM users already know.  A save goes to
``iter_XXXXXXX.tmp-<host>-<pid>`` and is renamed only after every rank has written and
``workbench.json`` says ``"complete": true``, so an interrupted save never shadows
the last good checkpoint, and :func:`find_checkpoint` never picks a partial one.
``"files"`` records each file's size and SHA-256; every load verifies them and reads
``.metadata`` and the stored objects through :mod:`workbench.checkpoint.safe_load` (an allow-list
unpickler: nothing in a checkpoint can run code; the checks: :mod:`workbench.checkpoint.integrity`), so a damaged or hostile checkpoint is
refused with the file named.

The one layout-dependent quantity is the vocab padding (``make_vocab_size_divisible_by
* tp``): :func:`load_checkpoint` re-pads the embedding / output rows when the loading
model is padded differently (the pad rows carry no information).

CPU note: mcore's save path calls ``torch.cuda.synchronize()`` / ``current_device()``
and its writer creates a ``spawn`` multiprocessing Manager for a results queue.  On a
machine without CUDA, :func:`save_checkpoint` no-ops the two CUDA calls *only while
saving* and hands the writer an in-process queue (the sync save runs in this
process), so no ``if __name__ == "__main__":`` guard is needed in the caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Sequence

from workbench.checkpoint.integrity import file_manifest, verify_checkpoint
from workbench.checkpoint.meta import checkpoint_config, read_metadata
from workbench.checkpoint.names import FORMAT, METADATA_FILE, TRACKER_FILE, CheckpointError, iter_dir_name
from workbench.checkpoint.safe_load import safe_dist_reading
from workbench.checkpoint.tree import find_checkpoint, partial_dir_name, remove_stale_partials
from workbench.run.files import write_text_atomic

__all__ = ["save_checkpoint", "finish_save", "load_checkpoint", "checkpoint_tensor_shapes", "vocab_keys", "CheckpointSaveError",
           "RNG_KEY", "rng_state", "set_rng_state"]

#: checkpoint keys whose first dimension is the (padded) vocabulary (BERT's LM head also has a vocab-sized output bias)
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def vocab_keys() -> tuple[str, ...]:
    return _VOCAB_KEYS


def checkpoint_tensor_shapes(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Global shape and dtype of every tensor stored in a checkpoint (reads metadata only, after
    :func:`~workbench.checkpoint.integrity.verify_checkpoint`; CheckpointError names a damaged file)."""
    from megatron.core import dist_checkpointing

    d = find_checkpoint(path)
    verify_checkpoint(d)
    with safe_dist_reading():
        md = dist_checkpointing.load_tensors_metadata(str(d))
    return {k: (tuple(v.global_shape), str(v.dtype).replace("torch.", "")) for k, v in md.items()}


# --------------------------------------------------------------------------- helpers


def _chunks(model_chunks: Any) -> list:
    if isinstance(model_chunks, (list, tuple)):
        return list(model_chunks)
    return [model_chunks]


def _unwrap(m: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers (their state dicts prefix keys with 'module.')."""
    import torch

    while isinstance(getattr(m, "module", None), torch.nn.Module):
        m = m.module
    return m


def _model_keys(n: int) -> list[str]:
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _model_sharded_sd(chunks: Sequence[Any]) -> dict[str, Any]:
    return {key: _unwrap(c).sharded_state_dict() for key, c in zip(_model_keys(len(chunks)), chunks)}


class CheckpointSaveError(OSError):
    """A save that could not be completed (disk full, file size limit, a rank lost); the previous checkpoint
    and ``latest`` are untouched (the iteration directory is only renamed into place once complete)."""


def _root_cause(e: BaseException) -> str:
    """The OSError under a torch checkpoint exception (e.g. ``[Errno 28] No space left on device``), else ``e``."""
    seen: list[BaseException] = []
    stack: list[Any] = [e]
    while stack:
        x = stack.pop()
        if not isinstance(x, BaseException) or x in seen:
            continue
        seen.append(x)
        if isinstance(x, OSError):
            return f"{type(x).__name__}: {x}"
        stack += [x.__cause__, x.__context__, *getattr(x, "args", ())]
        failures = getattr(x, "failures", None)  # torch.distributed.checkpoint.CheckpointException: rank -> error
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    text = str(e)
    return f"{type(e).__name__}: {text[:400]}"


def _space_note(root: Path) -> str:
    """Free space and this process's file size limit: megatron's writer workers drop the OSError itself."""
    parts = []
    try:
        parts.append(f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free on {root}")
    except OSError:
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            parts.append(f"file size limit {soft} bytes (ulimit -f)")
    except (ImportError, OSError, ValueError):
        pass
    return f" ({'; '.join(parts)})" if parts else ""


def _fault_point(where: str, iteration: int) -> None:
    """Fault injection for the data-safety tests; nothing happens unless ``WORKBENCH_FAULT`` is set.

    ``WORKBENCH_FAULT="<where>:<iteration>:<rank>:sleep=<s>"`` makes that rank sleep at that point of
    ``save_checkpoint`` (``save``: before writing, ``saved``: after its shards are written, before the
    rename, ``meta``: rank 0 only, before it writes ``workbench.json``), so a test can SIGKILL it mid-save;
    ``...:fsize=<bytes>`` caps the size of every file the rank writes from then on (``RLIMIT_FSIZE``; writes past
    it fail with EFBIG, as on a full disk); ``...:oserror=<errno>`` raises that ``OSError`` there (e.g. 28,
    ENOSPC: the disk filled up just then).
    """
    spec = os.environ.get("WORKBENCH_FAULT")
    if not spec:
        return
    w, it, rank, action = spec.split(":", 3)
    if w != where or int(it) != int(iteration) or int(rank) != _rank():
        return
    import sys

    kind, _, value = action.partition("=")
    print(f"[workbench] fault injection: rank {rank} (pid {os.getpid()}) {kind}={value} at {where} of iteration {it}",
          file=sys.stderr, flush=True)
    if kind == "sleep":
        import time

        time.sleep(float(value))
    elif kind == "oserror":
        raise OSError(int(value), os.strerror(int(value)))
    elif kind == "fsize":
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _broadcast_obj(obj: Any) -> Any:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _require_dist(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise CheckpointError(
            f"{what} needs torch.distributed to be initialised (mcore dist checkpointing is collective) -> "
            "call workbench.backend.distributed.initialize(cfg) first, or use "
            "workbench.models.common.one_process.single_process_group() for a one-process CPU group")


@contextlib.contextmanager
def _cpu_save_compat():
    """Make mcore's sync torch_dist save work without CUDA, only for the duration of the save."""
    import queue

    import torch

    if torch.cuda.is_available():
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    saved = (torch.cuda.synchronize, torch.cuda.current_device, fsa._results_queue)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # used as a tensor device for a failure-flag broadcast
    if fsa._results_queue is None:
        fsa._results_queue = queue.Queue()  # the sync writer runs in-process: no spawn Manager needed
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, fsa._results_queue = saved


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- save


def _optimizer_sharded_sd(optimizer: Any, model_sd: dict, is_loading: bool = False) -> dict:
    """The optimizer's sharded state, the distributed optimizer's as 'fully_reshardable'.

    mcore 0.19's default sharding of the distributed optimizer ('fully_sharded_model_space')
    uses flattened ranges that the torch_dist strategy refuses ("ShardedTensor.flattened_range
    is not supported"); 'fully_reshardable' stores canonical per-parameter state, loadable at
    any TP/PP/DP.  Other optimizers ignore the metadata.  For a load, a fresh torch Adam gets
    zero state first (:func:`_zero_adam_state`); :func:`_loadable_into_torch_adam` does the rest.
    """
    if is_loading:
        for opt in _distributed_optimizers_on_torch_adam(optimizer):
            if not _offloaded(opt):
                _zero_adam_state(opt.optimizer)
        for opt in _distributed_optimizers(optimizer):
            if _offloaded(opt) and not opt.optimizer.state:
                # optimizer CPU offload: megatron's HybridDeviceOptimizer makes its state (fp32 copies, moments, steps)
                # by a dummy step; without TE, state_dict() reads every parameter's step before megatron's own
                # load_state_dict would take that step.  The weights it moves are the checkpoint's again after the
                # load (the random states too where the checkpoint restores them)
                opt.optimizer.dummy_step()
    sd = optimizer.sharded_state_dict(model_sd, is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    return sd if is_loading else plain_param_groups(sd)


def plain_param_groups(sd: Any) -> Any:
    """``sd`` with every optimizer param group's class-valued entries dropped (in place; returned).

    megatron's HybridDeviceOptimizer (optimizer CPU offload) keeps its sub-optimizers' classes
    (``cpu_optimizer_cls``, ``gpu_optimizer_cls``) in every param group, and the distributed optimizer's
    'fully_reshardable' state stores the groups as common state: a checkpoint the workbench's loader
    (tensors and plain data only) would refuse.  Nothing reads them back (the optimizer keeps its classes)."""
    if isinstance(sd, dict):
        groups = sd.get("param_groups")
        if isinstance(groups, list):
            for g in groups:
                if isinstance(g, dict):
                    for k in [k for k, v in g.items() if isinstance(v, type)]:
                        del g[k]
        for v in sd.values():
            if isinstance(v, (dict, list)):
                plain_param_groups(v)
    elif isinstance(sd, list):
        for v in sd:
            plain_param_groups(v)
    return sd


def _settle_offloaded(optimizer: Any) -> None:
    """After loading into an offloading optimizer (megatron's HybridDeviceOptimizer): each sub-optimizer's moments and
    step as compact tensors on its parameter's device.  megatron's load leaves them as views of its full-size restore
    buffers (keeping those alive) and, without TE, moves a partly offloaded optimizer's GPU share to the host
    (``_move_new_state_to_right_device`` takes torch's AdamW for the CPU class); then the restore buffers go."""
    import torch

    settled = False
    for opt in _distributed_optimizers(optimizer):
        if not _offloaded(opt):
            continue
        for sub in opt.optimizer.sub_optimizers:
            for p, st in sub.state.items():
                for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
                    if torch.is_tensor(st.get(k)):
                        st[k] = st[k].to(p.device, copy=True)
        settled = True
    if settled:  # the restore buffers and megatron's first build go with one collection (and the pinned host cache)
        from workbench.backend.optimizer_paths import release_offload_startup

        release_offload_startup()


def _distributed_optimizers(optimizer: Any) -> list:
    from megatron.core.optimizer import distrib_optimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, distrib_optimizer.DistributedOptimizer)]


def _offloaded(opt: Any) -> bool:
    """Whether a DistributedOptimizer steps through megatron's HybridDeviceOptimizer (``parallel.optimizer_cpu_offload``)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    return isinstance(opt.optimizer, HybridDeviceOptimizer)


def _distributed_optimizers_on_torch_adam(optimizer: Any) -> list:
    """The DistributedOptimizers under ``optimizer`` whose inner optimizer is torch's Adam, i.e.
    when megatron found neither TE nor apex (their fused Adam keeps no per-parameter step); an offloaded one's
    HybridDeviceOptimizer steps torch AdamWs too."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return _distributed_optimizers(optimizer)


@contextlib.contextmanager
def _loadable_into_torch_adam(optimizer: Any):
    """Two mends to mcore 0.19 loading a 'fully_reshardable' distributed-optimizer state into
    torch Adam (no TE/apex), which keeps a per-parameter ``step`` tensor:

    - megatron restores ``step`` from the param groups, then copies every tensor of each
      parameter's state from the checkpoint, where no ``step`` is stored (KeyError: 'step'):
      the copy is told ``step`` is absent, so it skips it as it skips non-tensor entries;
    - it gives every parameter the *same* step tensor, which unfused Adam then increments once
      per parameter each step (wrong bias correction after a resume): each gets its own copy.
    """
    import torch

    patched = _distributed_optimizers_on_torch_adam(optimizer)
    for opt in patched:
        opt._set_main_param_and_optimizer_states = (
            lambda orig: lambda param, tensors: orig(param, {"step": None, **tensors}))(opt._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states  # back to the class's method
            for st in opt.optimizer.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()  # (an offloaded one's then goes beside its parameter: _settle_offloaded)


def _zero_adam_state(inner: Any) -> None:
    """Zero Adam moments and a step of 0 for each parameter of a torch optimizer that has none.

    Loading describes the distributed optimizer's state first (``state_dict()``), which without
    TE/apex reads every parameter's ``step``; a freshly built optimizer has no state yet.  The
    load then overwrites all of it.
    """
    import torch

    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state[p]
            if "step" not in st:
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))
                st["step"] = torch.tensor(0.0)


#: the per-rank random states in a training checkpoint (megatron's ``rng_state``: one object per (PP, TP) rank;
#: data-parallel ranks hold the same states, seeded alike, so DP rank 0 writes them)
RNG_KEY = "rng_state"


def rng_state(cuda: bool) -> dict[str, Any]:
    """This rank's random states, as tensors and plain values (what a weights-only load accepts): Python's,
    NumPy's, torch's CPU and (``cuda``) CUDA generators, and megatron's tracked states (TP-sharded dropout;
    TE's graph-safe generators under megatron's CUDA graphs are stored by their state)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {"python": [version, list(internal), gauss],
                           "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
                           "torch": torch.get_rng_state()}
    if cuda:
        out["cuda"] = torch.cuda.get_rng_state()
    tracked = tensor_parallel.get_cuda_rng_tracker().get_states()
    out["tracker"] = {k: (v.get_state() if isinstance(v, torch.Generator) else v).clone() for k, v in tracked.items()}
    return out


def set_rng_state(state: dict[str, Any], cuda: bool) -> None:
    """Restore :func:`rng_state`'s states.  Graph-safe generators are set in place (CUDA graphs captured later
    keep reading the same generator objects)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if cuda and "cuda" in state and state["cuda"].numel() == torch.cuda.get_rng_state().numel():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    restored = dict(tracker.get_states())  # a stream the checkpoint lacks keeps this run's seeding
    for k, saved in state["tracker"].items():
        if k not in restored:
            continue  # a stream this run does not track
        if isinstance(restored[k], torch.Generator):
            restored[k].set_state(saved)
        elif restored[k].numel() == saved.numel():
            restored[k] = saved
    tracker.set_states(restored)


def _cuda_started() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _rng_sharded(data: Any) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(RNG_KEY, data, (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))  # CP ranks: one seed, replicas


def _rng_layout_change(meta: dict) -> str:
    """Why the checkpoint's random states do not fit this job ("" when they do): they are per (PP, TP) rank."""
    from megatron.core import parallel_state as ps

    saved = (meta.get("config") or {}).get("parallel") or {}
    now = {"tensor_parallel": ps.get_tensor_model_parallel_world_size(), "pipeline_parallel": ps.get_pipeline_model_parallel_world_size()}
    changed = [f"{k} {saved.get(k, 1)} -> {v}" for k, v in now.items() if int(saved.get(k, 1)) != v]
    device = "cuda" if _cuda_started() else "cpu"  # CPU mode's states are not a GPU's
    if saved.get("device", "cuda") != device:
        changed.append(f"device {saved.get('device', 'cuda')} -> {device}")
    return ", ".join(changed)


def _make_tmp_dir(root: Path, final: Path) -> Path:
    """Rank 0 clears stale partial saves and makes a fresh temporary directory for ``final``; all ranks get its path."""
    tmp = None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for line in remove_stale_partials(root):  # what an earlier, killed save left behind
            print(f"[workbench] checkpoint {root}: {line}", flush=True)
        tmp = root / partial_dir_name(final.name, "tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    return Path(_broadcast_obj(str(tmp) if tmp else None))


def _save_state(chunks: list, iteration: int, optimizer: Any, scheduler: Any, extra: dict[str, Any] | None,
                rng: bool) -> dict[str, Any]:
    """The sharded state dict to save: model, optimizer, scheduler, extra, iteration and (``rng``) random states."""
    sharded = _model_sharded_sd(chunks)
    if optimizer is not None:
        sharded["optimizer"] = _optimizer_sharded_sd(optimizer, sharded)
    if scheduler is not None:
        sharded["scheduler"] = scheduler.state_dict()
    sharded["workbench_extra"] = dict(extra or {})
    sharded["iteration"] = int(iteration)
    if rng:
        sharded[RNG_KEY] = _rng_sharded(rng_state(_cuda_started()))
    return sharded


def _last_note(root: Path) -> str:
    """What the failure message says about the last complete checkpoint under ``root`` (from the tracker file)."""
    tracker = root / TRACKER_FILE
    last = tracker.read_text().strip() if tracker.is_file() else None
    return (f"the last complete checkpoint (iteration {last}) is intact and still the latest"
            if last else "no earlier checkpoint exists")


def _write_shards(sharded: dict[str, Any], tmp: Path, root: Path, iteration: int) -> None:
    """Collectively write ``sharded`` into ``tmp``; a failure is a CheckpointSaveError naming the last good one."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    try:
        _fault_point("save", iteration)
        with _cpu_save_compat():
            dist_checkpointing.save(sharded, str(tmp), sharded_strategy=TorchDistSaveShardedStrategy())
        _fault_point("saved", iteration)
    except BaseException as e:  # a full disk, a file size limit, a lost rank: said plainly, the last good one named
        if isinstance(e, (KeyboardInterrupt, SystemExit)):  # (torch's CheckpointException is a BaseException)
            raise
        note = _last_note(root)
        cause = _root_cause(e) + _space_note(root)
        raise CheckpointSaveError(f"{root}: saving the checkpoint of iteration {iteration} failed on rank {_rank()}: {cause} -> "
                              f"free disk space (or raise the file size limit) and resume; " + note) from e


def _finish_on_rank0(root: Path, tmp: Path, final: Path, iteration: int, chunks: list, cfg: Any, optimizer: Any,
                     scheduler: Any, extra: dict[str, Any] | None, tokenizer: Any, rng: bool) -> str | None:
    """Rank 0 commits the save (:func:`finish_save`); the failure message every rank raises, or None."""
    failure = None
    if _rank() == 0:
        try:
            finish_save(root, tmp, final, iteration, chunks, cfg, optimizer, scheduler, extra, tokenizer, rng)
        except OSError as e:  # a full disk or a file size limit while workbench.json / the tracker is written
            shutil.rmtree(tmp, ignore_errors=True)
            note = _last_note(root)
            failure = (f"{root}: saving the checkpoint of iteration {iteration} failed on rank 0 while writing its "
                       f"{METADATA_FILE}: {type(e).__name__}: {e}{_space_note(root)} -> free disk space (or raise the file "
                       "size limit) and resume; " + note)
    return _broadcast_obj(failure)  # every rank fails alike (no rank left waiting at a barrier)


def save_checkpoint(
    root: str | Path,
    iteration: int,
    model_chunks: Any,
    cfg: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    tokenizer: Any = None,
    rng: bool = False,
) -> Path:
    """Collectively save ``model_chunks`` (one GPTModel or the list of VPP chunks) to ``root/iter_XXXXXXX``.

    Every rank of the job calls this.  ``optimizer`` is an mcore optimizer (its
    ``sharded_state_dict`` is stored next to the model's); ``scheduler`` anything with
    ``state_dict()``; ``extra`` rank-common state (data position, RNG seeds...) that must
    survive ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers);
    ``tokenizer`` a JSON-able spec (e.g. a tokenizer dir or name) for exporters and generation;
    ``rng``: store every rank's random states (:func:`rng_state`; a training run's, so a resume under dropout
    repeats the straight run).  Returns the final iteration directory.
    """
    _require_dist("save_checkpoint")
    root = Path(root)
    chunks = _chunks(model_chunks)
    final = root / iter_dir_name(iteration)
    tmp = _make_tmp_dir(root, final)
    sharded = _save_state(chunks, iteration, optimizer, scheduler, extra, rng)
    _write_shards(sharded, tmp, root, iteration)
    _barrier()
    failure = _finish_on_rank0(root, tmp, final, iteration, chunks, cfg, optimizer, scheduler, extra, tokenizer, rng)
    if failure:
        raise CheckpointSaveError(failure)
    return final


def _tokenizer_record(tokenizer: Any) -> Any:
    """The tokenizer spec as a checkpoint records it: a path that exists here becomes absolute (so an exporter
    run from another directory finds it), anything else (a name such as ``demo``) is kept as given."""
    named = ("demo", "demo-wordpiece", "demo-t5")  # what workbench.data.tokenizer.load_tokenizer reads as names
    if isinstance(tokenizer, (str, Path)) and str(tokenizer) and str(tokenizer) not in named:
        p = Path(tokenizer).expanduser()
        if p.exists():
            return str(p.resolve())
    return tokenizer


def finish_save(root: Path, tmp: Path, final: Path, iteration: int, chunks: list, cfg: Any, optimizer: Any,
                scheduler: Any, extra: dict | None, tokenizer: Any, rng: bool,
                hashed: dict[str, tuple[int, str]] | None = None) -> None:
    """Rank 0, once every rank's shards are written: ``workbench.json`` (the manifest, ``complete``), the rename
    into place and the tracker, in that order (an interruption anywhere leaves the previous checkpoint the latest).
    ``hashed``: files whose size and SHA-256 their writer computed as it wrote them (:func:`file_manifest`)."""
    _fault_point("meta", iteration)
    cfg_dict = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    meta = {
        "format": FORMAT,
        "iteration": int(iteration),
        "config": cfg_dict,
        "tokenizer": _tokenizer_record(tokenizer),
        "has_optimizer": optimizer is not None,
        "has_scheduler": scheduler is not None,
        "has_rng": bool(rng),
        "num_model_chunks": len(chunks),
        "extra": _jsonable(dict(extra or {})),
        "files": file_manifest(tmp, hashed),  # size + SHA-256 of every file: verify_checkpoint names a damaged one
        "complete": True,
    }
    _fsync_write(tmp / METADATA_FILE, json.dumps(meta, indent=2))
    old = None
    if final.exists():  # re-saving the same iteration: keep the old one until the new one is in place
        old = root / partial_dir_name(final.name, "old")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    write_text_atomic(root / TRACKER_FILE, str(int(iteration)))


# --------------------------------------------------------------------------- load


_ARCH_FIELDS = (
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_query_groups", "num_query_groups"),
    ("ffn_hidden_size", "ffn_hidden_size"),
    ("kv_channels", "kv_channels"),
)


def _check_config(ckpt: Path, meta: dict, chunks: Sequence[Any]) -> None:
    """Name the first architectural field that differs between checkpoint and model."""
    ccfg = (meta.get("config") or {}).get("model") or {}
    if not ccfg:
        return
    try:
        cm = checkpoint_config(meta).model
    except Exception:  # an old/foreign config: the tensor-shape check below still applies
        return
    tc = getattr(_unwrap(chunks[0]), "config", None)
    if tc is None:
        return
    want = {
        "num_layers": cm.num_layers,
        "hidden_size": cm.hidden_size,
        "num_attention_heads": cm.num_attention_heads,
        "num_query_groups": cm.query_groups,
        "ffn_hidden_size": cm.ffn_size,
        "kv_channels": cm.head_dim,
    }
    diffs = []
    for name, ckey in _ARCH_FIELDS:
        have = getattr(tc, ckey, None)
        if have is not None and want[name] is not None and int(have) != int(want[name]):
            diffs.append(f"model.{name}: checkpoint {want[name]}, model {have}")
    if bool(getattr(tc, "gated_linear_unit", False)) != cm.gated_mlp:
        diffs.append(f"model.activation: checkpoint {cm.activation}, model {'gated' if getattr(tc, 'gated_linear_unit', False) else 'not gated'}")
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit the model being loaded ({'; '.join(diffs)}) -> "
            "build the model from the checkpoint's config (workbench.json 'config'), or point load_dir at a matching checkpoint")


def _retarget_vocab_entries(sharded: dict, ckpt_shapes: dict, ckpt: Path) -> list[tuple[Any, Any]]:
    """Replace vocab-dim ShardedTensors whose padded size differs from the checkpoint's.

    Each such entry is swapped for a request of the *whole* stored tensor (main replica
    on rank 0 only, so integrity checks hold); after loading, :func:`_copy_vocab_rows`
    copies the rows that exist into the local shard and zeroes new pad rows.
    Returns (original ShardedTensor, full-tensor ShardedTensor) pairs.
    """
    import torch
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    pairs: list[tuple[Any, Any]] = []
    rank = _rank()

    def visit(x: Any) -> Any:
        if isinstance(x, ShardedTensor) and x.key in _VOCAB_KEYS and x.key in ckpt_shapes:
            stored = ckpt_shapes[x.key][0]
            if tuple(x.global_shape) != tuple(stored):
                if tuple(x.global_shape[1:]) != tuple(stored[1:]) or x.flattened_range is not None:
                    raise CheckpointError(
                        f"checkpoint {ckpt}: tensor {x.key} has shape {tuple(stored)}, the model wants {tuple(x.global_shape)} -> "
                        "hidden sizes differ: load a checkpoint of the same architecture")
                full = torch.empty(stored, dtype=x.data.dtype, device=x.data.device)
                req = ShardedTensor.from_rank_offsets(x.key, full, replica_id=rank)
                pairs.append((x, req))
                return req
        return x

    dict_list_map_inplace(visit, sharded)
    return pairs


def _copy_vocab_rows(pairs: list[tuple[Any, Any]]) -> None:
    import torch

    with torch.no_grad():
        for orig, req in pairs:
            local = orig.data
            start = orig.global_offset[0]
            n = local.shape[0]
            stored = req.data.to(local.dtype)
            take = max(0, min(n, stored.shape[0] - start))
            local.zero_()
            if take:
                local[:take].copy_(stored[start:start + take])


def _drop_fresh_heads(sharded: dict, chunks: Sequence[Any], ckpt_shapes: dict) -> list[tuple[str, str]]:
    """Take out of the load request the entries a fine-tuning load initialises fresh: those under a chunk's
    ``fresh_on_finetune`` prefixes (e.g. a new classification head) that the checkpoint does not hold.
    Returns (model key, state-dict key) of each; the chunk keeps its initialised values there."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    dropped = []
    for mkey, chunk in zip(_model_keys(len(chunks)), chunks):
        prefixes = tuple(getattr(_unwrap(chunk), "fresh_on_finetune", ()))
        for k in [k for k in sharded[mkey] if prefixes and k.startswith(prefixes)]:
            x = sharded[mkey][k]
            if isinstance(x, ShardedTensor) and x.key not in ckpt_shapes:
                del sharded[mkey][k]
                dropped.append((mkey, k))
    return dropped


def _drop_absent_extra_state(sharded: dict, ckpt: Path) -> list[tuple[str, str]]:
    """Take out of the load request the Transformer Engine ``_extra_state`` objects (FP8 scaling metadata)
    the checkpoint does not hold: a checkpoint of the non-TE path loads into TE's layers, which start
    their FP8 history fresh.  Returns (model key, state-dict key) of each; the model keeps its own."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from torch.distributed.checkpoint import FileSystemReader

    with safe_dist_reading():
        stored = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    dropped = []
    for mkey in [k for k in sharded if k.startswith("model")]:
        for k in [k for k, x in sharded[mkey].items() if k.endswith("_extra_state") and isinstance(x, ShardedObject)]:
            if sharded[mkey][k].unique_key not in stored:
                del sharded[mkey][k]
                dropped.append((mkey, k))
    return dropped


def _check_shapes(sharded: dict, ckpt_shapes: dict, ckpt: Path) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    problems = []
    for x in nested_values(sharded):
        if isinstance(x, ShardedTensor) and x.key in ckpt_shapes and x.key not in _VOCAB_KEYS:
            stored = ckpt_shapes[x.key][0]
            if tuple(stored) != tuple(x.global_shape):
                problems.append(f"{x.key}: checkpoint {tuple(stored)}, model {tuple(x.global_shape)}")
    missing = sorted({x.key for x in nested_values(sharded) if isinstance(x, ShardedTensor)} - set(ckpt_shapes))
    missing = [k for k in missing if not k.startswith("optimizer")]
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit the model being loaded:\n  " + "\n  ".join(problems[:10]) +
            "\n-> build the model from the checkpoint's config (workbench.json 'config'), or use a matching checkpoint")


def _add_optimizer(sharded: dict, optimizer: Any, chunks: Sequence[Any], ckpt: Path, meta: dict, pairs: list) -> None:
    """Ask for the optimizer state too; refused when the checkpoint has none or its vocab padding changed."""
    if not meta.get("has_optimizer"):
        raise CheckpointError(f"checkpoint {ckpt} holds no optimizer state -> load with load_optimizer=False (finetune)")
    if pairs:
        raise CheckpointError(
            f"checkpoint {ckpt} was saved with a different vocab padding (tensor parallel size changed); "
            "optimizer state cannot be re-padded -> load with load_optimizer=False (finetune), "
            "or resume at the original tensor_parallel")
    sharded["optimizer"] = _optimizer_sharded_sd(optimizer, _model_sharded_sd(chunks), is_loading=True)


def _add_rng(sharded: dict, meta: dict) -> str:
    """Ask for the random states when the checkpoint has them for this layout; else why not (``meta["rng"]``)."""
    layout = _rng_layout_change(meta)
    if not meta.get("has_rng"):
        return "the checkpoint holds no random states (this run's own seeding: the dropout streams restart)"
    if layout:
        return (f"the checkpoint's random states are per (PP, TP) rank and the layout changed ({layout}): "
                "this run's own seeding (the dropout streams restart)")
    sharded[RNG_KEY] = _rng_sharded(None)
    return "not asked for"


def _read_shards(sharded: dict, ckpt: Path, pairs: list) -> dict:
    """Collectively read ``sharded`` from ``ckpt`` (nothing unpickled outside the allow-list)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    with safe_dist_reading():  # nothing in the checkpoint is unpickled outside the allow-list
        return dist_checkpointing.load(sharded, str(ckpt), sharded_strategy=TorchDistLoadShardedStrategy(),
                                       validate_access_integrity=not pairs)


def _load_model_states(loaded: dict, chunks: Sequence[Any], pairs: list, fresh: list, own_extra: list) -> None:
    """Load each chunk's state strictly, keeping its own re-padded vocab shards, fresh heads and absent extra state."""
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        state = loaded[key]
        if pairs:  # these entries were loaded as whole stored tensors; the local shards were filled in place
            own = _unwrap(chunk).state_dict(keep_vars=False)
            for k in list(state):
                if k in own and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape):
                    state[k] = own[k]
        if fresh or own_extra:
            own = _unwrap(chunk).state_dict(keep_vars=False)
            state.update({k: own[k] for mk, k in fresh + own_extra if mk == key and k in own})
        _unwrap(chunk).load_state_dict(state, strict=True)


def load_checkpoint(
    path: str | Path,
    model_chunks: Any,
    optimizer: Any = None,
    scheduler: Any = None,
    load_optimizer: bool = True,
    fresh_heads: bool = False,
    load_rng: bool = False,
) -> dict[str, Any]:
    """Collectively load a checkpoint (root or iter dir) into ``model_chunks``, at any TP/PP/VPP.

    Optimizer state is loaded when ``optimizer`` is given, ``load_optimizer`` is true and the
    checkpoint has it (fine-tuning passes ``load_optimizer=False``).  ``fresh_heads`` (fine-tuning):
    tensors under a model's ``fresh_on_finetune`` prefixes that the checkpoint lacks (a new task
    head) keep their initialised values (``meta["fresh"]`` names them); any other missing tensor is
    still an error.  ``load_rng`` (a resume): restore the random states where the checkpoint has them for this
    job's (PP, TP) layout.  Returns the metadata dict (``iteration``, ``config``, ``tokenizer``, ``extra`` -
    with tensors restored -, ``path``, ``fresh``, ``rng``: "restored" or why not).
    """
    _require_dist("load_checkpoint")
    ckpt = find_checkpoint(path)
    meta = read_metadata(ckpt)
    chunks = _chunks(model_chunks)
    _check_config(ckpt, meta, chunks)
    ckpt_shapes = checkpoint_tensor_shapes(ckpt)

    sharded = _model_sharded_sd(chunks)
    fresh = _drop_fresh_heads(sharded, chunks, ckpt_shapes) if fresh_heads else []
    own_extra = _drop_absent_extra_state(sharded, ckpt)
    _check_shapes(sharded, ckpt_shapes, ckpt)
    pairs = _retarget_vocab_entries(sharded, ckpt_shapes, ckpt)
    want_optim = optimizer is not None and load_optimizer
    if want_optim:
        _add_optimizer(sharded, optimizer, chunks, ckpt, meta, pairs)
    rng_note = _add_rng(sharded, meta) if load_rng else "not asked for"

    loaded = _read_shards(sharded, ckpt, pairs)
    _copy_vocab_rows(pairs)
    _load_model_states(loaded, chunks, pairs, fresh, own_extra)
    if want_optim:
        with _loadable_into_torch_adam(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
        _settle_offloaded(optimizer)
    if scheduler is not None and "scheduler" in loaded and load_optimizer:
        scheduler.load_state_dict(loaded["scheduler"])
    meta["extra"] = loaded.get("workbench_extra", meta.get("extra") or {})
    meta["iteration"] = int(loaded.get("iteration", meta.get("iteration", 0)))
    meta["path"] = str(ckpt)
    meta["fresh"] = sorted({k for _, k in fresh})
    if RNG_KEY in sharded:
        set_rng_state(loaded[RNG_KEY], _cuda_started())
        rng_note = "restored"
    meta["rng"] = rng_note
    _barrier()
    return meta
