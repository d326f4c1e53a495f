"""Generation's ranks: load a checkpoint's model stage, ask its family for the engine, run a request.

Entry point (one process per rank, started by torchrun like training)::

    python -m workbench.rank.inference --ckpt DIR --request REQ.json --out OUT.json

``REQ.json``: ``{"prompt_ids": [[...], ...]}`` (or ``"prompts": [text, ...]``) plus either
``"generation": {GenerationConfig fields}`` or ``"runs": {name: {...}, ...}`` (several decoding
configs, model loaded once).  ``OUT.json`` (written by the last stage's first TP rank):
``{"runs": {name: {"outputs": [GenerationOutput dicts], "seconds", "tokens_per_s", ...}}, "tp", "pp", ...}``.
The engines are the families' generation parts (:meth:`workbench.models.parts.FamilyParts.generation`,
built from the blocks of :mod:`workbench.backend.decoding`); the notebook-side API that validates and
launches this is :mod:`workbench.generation`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state

from workbench.backend import cpu_mode, distributed
from workbench.backend.decoding import dist_ready, pp_info
from workbench.checkpoint import checkpoint_config, checkpoint_info, load_checkpoint, read_checkpoint
from workbench.config import GenerationConfig
from workbench.data.tokenizer import resolve_tokenizer, special_ids
from workbench.launch.stores import private_world
from workbench.models.parts import parts_of
from workbench.run.files import write_json_atomic

__all__ = ["load_engine", "run_request", "initialize_for_generation", "main"]


# --------------------------------------------------------------------------- from a checkpoint


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer (files next to it, its recorded spec, or the run's data.tokenizer)."""
    return resolve_tokenizer(checkpoint_info(path))


def load_engine(ckpt: str | Path, *, device: str | None = None, cuda_graphs: bool | str = "auto",
                say: Any = None) -> Any:
    """Build this rank's stage of the checkpoint's model, load its weights, return its family's engine.

    Needs model parallel initialised (``workbench.backend.distributed``) with the TP/PP
    wanted; dist checkpoints load at any layout.  ``say``: called with a line as building and loading start.
    """
    from workbench.rank.build import build_model

    meta = read_checkpoint(ckpt)
    path = meta.path
    cfg = checkpoint_config(meta)  # the recorded config as data: hooks it names are never imported
    if parallel_state.model_parallel_is_initialized():
        cfg = cfg.replace(**{"parallel.tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
                             "parallel.pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
                             "parallel.sequence_parallel": False, "parallel.virtual_pipeline_parallel": None,
                             "parallel.context_parallel": 1,  # decoding runs without context parallelism
                             "parallel.recompute": "none", **({"parallel.device": device} if device else {})})
    pp_rank, pp = pp_info()
    say = say or (lambda line: None)
    m = cfg.model
    say(f"building the model: {m.arch}, {m.num_layers} layers x hidden {m.hidden_size}")
    with cpu_mode.tensor_cuda_is_identity(cfg.parallel.device == "cpu"):
        model = build_model(cfg, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1)
    say(f"loading checkpoint {path}")
    load_checkpoint(path, [model], load_optimizer=False)
    tok = _load_tokenizer(Path(path))
    ids = special_ids(tok)
    generation = parts_of(cfg).generation()
    if generation is None:
        raise ValueError(f"model.arch {cfg.model.arch!r}: the {cfg.model.arch} family has no generation engine")
    return generation.make_engine(model, cfg, tok, ids, cuda_graphs=cuda_graphs)


def run_request(engine: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Execute a request: prompts (``prompt_ids`` or ``prompts`` text) and either one
    ``generation`` dict or several named ones under ``runs`` ({name: generation dict}), all
    on the model loaded once.  Returns {"runs": {name: {"outputs": [...], ...}}} (one run is
    named "default")."""
    if request.get("prompt_ids"):
        prompt_ids = [list(map(int, p)) for p in request["prompt_ids"]]
    else:
        if engine.tokenizer is None:
            raise ValueError("the checkpoint has no tokenizer: pass prompt_ids instead of prompts")
        prompt_ids = [list(engine.tokenizer.encode(p)) for p in request["prompts"]]
    runs = request.get("runs") or {"default": request.get("generation", {})}
    out: dict[str, Any] = {}
    for name, options in runs.items():
        gen = GenerationConfig(**options)
        outs = engine.generate(prompt_ids, gen, early_stopping=request.get("early_stopping", False))
        new_tokens = sum(len(o.token_ids) for o in outs)
        secs = engine.last_timing.get("seconds", 0.0)
        out[name] = {"outputs": [o.to_dict() for o in outs], "generation": asdict(gen), "seconds": secs,
                     "new_tokens": new_tokens, "tokens_per_s": new_tokens / secs if secs > 0 else None}
    return {"runs": out}


def _checkpoint_config(ckpt: str | Path):
    """The RunConfig stored with a checkpoint (``workbench.json``), read without megatron."""
    return checkpoint_config(read_checkpoint(ckpt))


def initialize_for_generation(ckpt: str | Path, tp: int, pp: int, device: str):
    """Start torch.distributed + megatron model parallel for generating from ``ckpt`` at TP x PP.

    The checkpoint's config gives the architecture; the layout is the caller's (dist
    checkpoints load at any TP/PP).  Returns the RunConfig used.
    """
    cfg = _checkpoint_config(ckpt)
    world = int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1
    if world != tp * pp:
        raise SystemExit(f"generation at tp={tp} x pp={pp} needs {tp * pp} processes, torchrun started {world}: "
                         f"use --nproc-per-node {tp * pp}")
    overrides = {"parallel.tensor_parallel": tp, "parallel.pipeline_parallel": pp, "parallel.device": device,
                 "parallel.nnodes": 1, "parallel.nproc_per_node": world, "parallel.sequence_parallel": False,
                 "parallel.virtual_pipeline_parallel": None, "parallel.recompute": "none", "parallel.context_parallel": 1}
    if device == "cpu" and cfg.train.precision == "fp16":
        overrides["train.precision"] = "fp32"
    cfg = cfg.replace(**overrides)
    if not dist_ready() and "TORCHELASTIC_RUN_ID" not in os.environ:
        # one process started without torchrun: a private 1-rank world that listens for no peers
        private_world(device)
    distributed.initialize(cfg)
    return cfg


def _progress_writer(path: str | None):
    """``say(line)``: one progress line appended to ``path`` (the caller's progress file, which
    :mod:`workbench.generation` echoes to stderr) by global rank 0; a no-op without a path or on other ranks."""
    rank = int(os.environ.get("RANK", "0"))
    if not path or rank != 0:
        return lambda line: None

    def say(line: str) -> None:
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(line.replace("\n", " ") + "\n")
        except OSError:
            pass

    return say


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.rank.inference", description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint root or iter_XXXXXXX directory")
    ap.add_argument("--request", required=True, help="request JSON: prompts / prompt_ids + generation options")
    ap.add_argument("--out", required=True, help="results JSON (written by the last stage's first TP rank)")
    ap.add_argument("--tp", type=int, default=None, help="tensor parallel size (default: world size / pp)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    args = ap.parse_args(argv)
    request = json.loads(Path(args.request).read_text())
    device = args.device or request.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1")) if "TORCHELASTIC_RUN_ID" in os.environ else 1
    tp = args.tp or max(world // args.pp, 1)
    say = _progress_writer(request.get("progress"))
    say(f"initialising model parallel: {world} rank(s) on {device}, tp {tp}, pp {args.pp}")
    initialize_for_generation(args.ckpt, tp, args.pp, device)
    engine = load_engine(args.ckpt, device=device, cuda_graphs=request.get("cuda_graphs", "auto"), say=say)
    n_prompts = len(request.get("prompt_ids") or request.get("prompts") or [])
    runs = request.get("runs") or {"default": request.get("generation", {})}
    n_new = max(int((g or {}).get("max_new_tokens", 0) or 0) for g in runs.values()) if runs else 0
    say(f"generating up to {n_new} tokens for {n_prompts} prompt(s)" + (f", {len(runs)} decoding configs" if len(runs) > 1 else ""))
    result = run_request(engine, request)
    result.update({"tp": tp, "pp": args.pp, "device": device, "ckpt": str(args.ckpt)})
    pp_rank, pp = pp_info()
    if pp_rank == pp - 1 and parallel_state.get_tensor_model_parallel_rank() == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, result)
    if dist_ready():
        torch.distributed.barrier()
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
