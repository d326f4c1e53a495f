"""Prove a checkpoint: run it at a TP/PP/VPP layout on CPU (real torchrun, gloo) and compare with HF logits.

``forward_logits`` launches ``torchrun --nproc_per_node tp*pp -m workbench.conversion.verify`` under the
launch supervisor (:func:`workbench.launch.run_supervised`);
every rank builds its model chunk(s) with the workbench builder, loads the checkpoint through
:func:`workbench.checkpoint.load_checkpoint` (so the layout change is megatron's own
resharding), and runs a forward-only pass.  Pipeline stages pass activations with gloo
``send``/``recv`` in virtual-stage order (stage 0 chunk 0, stage 1 chunk 0, ..., stage 0
chunk 1, ...), which is exactly the layer order of interleaved pipelining.  The last stage
gathers the vocab-parallel logits over TP and writes them (pad rows included).

What a forward needs is the checkpoint's model family's: its ``hf`` part makes the inputs
(``verify_inputs``: token ids for GPT; ids, padding mask and token types for BERT) and the HF
reference logits (``hf_logits``), its ``step`` part runs one chunk on them (``logits_forward``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from workbench.checkpoint import checkpoint_config, checkpoint_info, load_checkpoint, read_metadata, safe_torch_load
from workbench.config import ConfigError
from workbench.generation import layout_problems
from workbench.launch import local_torchrun, run_supervised
from workbench.models.common.conversion_rules import ConversionError
from workbench.models.common.one_process import model_overrides
from workbench.models.parts import parts_of
from workbench.run.files import atomic_output

__all__ = ["forward_logits", "verify_against_hf", "main", "worker_argv", "worker_env", "worker_world"]


def worker_world(tp: int = 1, pp: int = 1, ep: int = 1) -> int:
    """Ranks a forward at this layout needs: ``tp x pp x ep`` (an MoE model's expert ranks are data-parallel ones)."""
    return tp * pp * max(ep, 1)


def worker_env() -> dict[str, str]:
    """The environment of this module's worker ranks: one OpenMP thread, unbuffered, this checkout importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def worker_argv(ckpt: str | Path, tokens_path: str | Path, out_path: str | Path, tp: int = 1, pp: int = 1,
                vpp: int | None = None, ep: int = 1) -> list[str]:
    """The arguments of this module's worker (:func:`main`) for one forward: the one place they are spelled."""
    return (["--ckpt", str(ckpt), "--tokens", str(tokens_path), "--out", str(out_path), "--tp", str(tp), "--pp", str(pp),
             "--ep", str(max(ep, 1))] + (["--vpp", str(vpp)] if vpp and vpp > 1 else []))


def forward_logits(ckpt: str | Path, tokens: Any, tp: int = 1, pp: int = 1, vpp: int | None = None,
                   timeout_s: float = 300.0, ep: int = 1) -> Any:
    """Logits ``[b, s, padded_vocab]`` (fp32) of the checkpoint run at the given layout on CPU under torchrun.

    ``tokens``: token ids ``[b, s]``, or the dict of inputs the checkpoint's family reads (its
    ``hf.verify_inputs``; e.g. BERT's padding mask and token types).  ``ep``: expert parallelism of an MoE model
    (its ranks are data-parallel ones: world ``tp x pp x ep``)."""
    import torch

    world = worker_world(tp, pp, ep)
    inputs = dict(tokens) if isinstance(tokens, dict) else {"tokens": tokens}
    with tempfile.TemporaryDirectory(prefix="wb-verify-") as td:
        tok_path, out_path = Path(td) / "inputs.pt", Path(td) / "logits.pt"
        torch.save({k: v.cpu() for k, v in inputs.items()}, tok_path)
        cmd = [*local_torchrun(world),  # one node: its stores on the loopback only
               "-m", "workbench.conversion.verify", *worker_argv(ckpt, tok_path, out_path, tp, pp, vpp, ep)]
        env = worker_env()
        # the one launch path: under the supervisor, so a killed caller leaves no rank behind
        res = run_supervised(cmd, Path(td) / "run", env=env, timeout=timeout_s)
        if res.returncode != 0 or not out_path.exists():
            tail = "\n".join(res.output.splitlines()[-40:])
            raise RuntimeError(f"verification run (torchrun, {world} CPU ranks) failed with exit code {res.returncode}:\n{tail}")
        return safe_torch_load(str(out_path), source=str(out_path))


def _family_hf(ckpt: str | Path) -> Any:
    """The checkpoint's family's HF adapter, which must make verify's inputs and reference logits."""
    parts = parts_of(((read_metadata(ckpt).get("config") or {}).get("model") or {}).get("arch", "gpt"))
    hf = parts.hf()
    if hf is None:
        raise ConversionError(f"the {parts.family.name} family has no Hugging Face adapter, so its checkpoints have no HF "
                              "reference to verify against -> compare two of its own checkpoints instead")
    return hf


def verify_against_hf(ckpt: str | Path, hf_dir: str | Path, tp: int = 1, pp: int = 1, vpp: int | None = None,
                      seq_length: int = 16, batch_size: int = 2, atol: float = 1e-4, seed: int = 0, ep: int = 1) -> dict[str, Any]:
    """Compare HF logits with the checkpoint's at a layout (fp32, CPU), at the positions the family compares
    (BERT: the unpadded ones). Returns max_abs_diff and ok."""
    from workbench.conversion.hf import read_hf_config
    from workbench.conversion.hf_files import HFReader

    info = checkpoint_info(ckpt)  # a damaged or hostile checkpoint is refused before torchrun starts
    problems = layout_problems(info, tp, pp, "cpu", vpp=vpp)
    if problems:  # a layout the model cannot take: said here, not as a traceback of every rank
        raise ConfigError(problems)
    hf = _family_hf(ckpt)
    vocab = int(read_hf_config(hf_dir)["vocab_size"])
    HFReader(hf_dir).check()  # every weight file loads as tensors only (else a ConversionError naming it), one at a time
    inputs = hf.verify_inputs(vocab, batch_size, seq_length, seed)
    ref, where = hf.hf_logits(hf_dir, inputs)
    got = forward_logits(ckpt, inputs, tp=tp, pp=pp, vpp=vpp, ep=ep)[..., :vocab]
    delta = (got - ref).abs()
    diff = float((delta[where] if where is not None else delta).max())
    return {"max_abs_diff": diff, "ok": diff <= atol, "tokens": inputs["tokens"], "inputs": inputs, "hf_logits": ref,
            "mcore_logits": got}


# --------------------------------------------------------------------------- worker (runs under torchrun)


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from workbench.backend.cpu_mode import tensor_cuda_is_identity
    from workbench.backend.distributed import destroy, initialize
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config

    cfg = checkpoint_config(read_metadata(args.ckpt))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    vpp = args.vpp if args.vpp and args.vpp > 1 else None
    cfg = cfg.replace(**{
        "parallel.tensor_parallel": args.tp, "parallel.pipeline_parallel": args.pp,
        "parallel.virtual_pipeline_parallel": vpp, "parallel.nnodes": 1, "parallel.nproc_per_node": world,
        "parallel.expert_parallel": args.ep, "parallel.context_parallel": 1,
        "parallel.device": "cpu", "parallel.sequence_parallel": False, "parallel.distributed_optimizer": False,
        "parallel.overlap_grad_reduce": False, "parallel.overlap_param_gather": False,
        "train.precision": "fp32", "train.compile_kernels": False, "model.attention_backend": "sdpa",
        "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
    })
    initialize(cfg)
    try:
        pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), args.pp
        nchunks = vpp or 1
        config = transformer_config(cfg, **model_overrides(cfg))
        chunks = []
        with tensor_cuda_is_identity():
            for v in range(nchunks):
                pre = pp_rank == 0 and v == 0
                post = pp_rank == pp_size - 1 and v == nchunks - 1
                chunks.append(build_model(cfg, pre_process=pre, post_process=post, vp_stage=v if vpp else None, config=config))
        load_checkpoint(args.ckpt, chunks, load_optimizer=False)
        for c in chunks:
            c.eval()
        inputs = safe_torch_load(args.tokens, source=args.tokens)
        if not isinstance(inputs, dict):
            inputs = {"tokens": inputs}
        b, s = inputs["tokens"].shape
        step = parts_of(cfg).step()  # the family's forward for logits
        h = cfg.model.hidden_size
        nxt, prv = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
        last = pp_size * nchunks - 1
        logits = None
        with torch.no_grad():
            for vs in range(pp_size * nchunks):
                stage, v = vs % pp_size, vs // pp_size
                if stage != pp_rank:
                    continue
                chunk = chunks[v]
                if vs > 0:
                    hidden = torch.empty(s, b, h, dtype=torch.float32)
                    dist.recv(hidden, src=prv)
                    chunk.set_input_tensor(hidden)
                out = step.logits_forward(chunk, inputs)
                if vs < last:
                    dist.send(out.contiguous(), dst=nxt)
                else:
                    logits = tensor_parallel.gather_from_tensor_model_parallel_region(out)
        if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            with atomic_output(args.out) as tmp:
                torch.save(logits.float().contiguous(), tmp)
        dist.barrier()
    finally:
        destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="forward a workbench checkpoint at a TP/PP layout (run under torchrun)")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tokens", required=True, help="torch file: token ids [b, s], or the dict of the family's inputs")
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=None)
    p.add_argument("--ep", type=int, default=1)
    _worker(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
