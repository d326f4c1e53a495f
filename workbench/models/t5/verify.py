"""Prove a T5 checkpoint: run it at a TP layout on CPU (torchrun, gloo) and compare its logits with HF's.

``verify_against_hf(ckpt, hf_dir, tp)`` starts ``torchrun --nproc_per_node tp -m workbench.models.t5.verify``
under the launch supervisor; every rank builds the T5 model with the workbench builder, loads the
checkpoint through :func:`workbench.backend.checkpointing.load_checkpoint` (megatron's own resharding),
runs one forward over random encoder inputs (right-padded, with a padding mask) and decoder inputs,
and rank 0 writes the TP-gathered logits.  The notebook side only compares tensors (it never imports
megatron-core).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from workbench.launch import run_supervised
from workbench.run.files import free_port

__all__ = ["verify_against_hf", "main"]


def _inputs(vocab: int, seed: int, batch: int = 3, enc_len: int = 19, dec_len: int = 11) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, vocab, (batch, enc_len), generator=g)
    lengths = torch.tensor([enc_len] + [max(2, enc_len - 5 * (i + 1)) for i in range(batch - 1)])
    mask = (torch.arange(enc_len)[None] < lengths[:, None]).long()
    dec = torch.randint(2, vocab, (batch, dec_len), generator=g)
    dec[:, 0] = 0
    return {"enc": enc, "mask": mask, "dec": dec}


def verify_against_hf(ckpt: str | Path, hf_dir: str | Path, tp: int = 1, atol: float = 1e-4, seed: int = 0,
                      timeout_s: float = 300.0) -> dict[str, Any]:
    """Max |logits - HF logits| of ``ckpt`` run at ``tp`` CPU ranks (fp32); ``ok`` when within ``atol``
    relative to the largest HF logit (at least 1)."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    ref = AutoModelForSeq2SeqLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    vocab = int(ref.config.vocab_size)
    x = _inputs(vocab, seed)
    with torch.no_grad():
        want = ref(input_ids=x["enc"], attention_mask=x["mask"], decoder_input_ids=x["dec"]).logits
    with tempfile.TemporaryDirectory(prefix="wb-t5-verify-") as td:
        inp, out = Path(td) / "inputs.pt", Path(td) / "logits.pt"
        torch.save(x, inp)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(tp),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "workbench.models.t5.verify",
               "--ckpt", str(ckpt), "--inputs", str(inp), "--out", str(out), "--tp", str(tp)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[3])] + [p for p in [env.get("PYTHONPATH")] if p])
        res = run_supervised(cmd, Path(td) / "run", env=env, timeout=timeout_s)
        if res.returncode != 0 or not out.exists():
            tail = "\n".join(res.output.splitlines()[-40:])
            raise RuntimeError(f"T5 verification run (torchrun, {tp} CPU ranks) failed with exit code {res.returncode}:\n{tail}")
        got = torch.load(out, weights_only=True)[..., :vocab]
    diff = float((got - want).abs().max())
    scale = max(float(want.abs().max()), 1.0)
    return {"max_abs_diff": diff, "max_abs_logit": scale, "ok": diff <= atol * scale, "tp": tp,
            "shape": tuple(want.shape)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workbench.models.t5.verify")
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from workbench.backend import cpu_mode, distributed
    from workbench.backend.checkpointing import load_checkpoint
    from workbench.backend.model import build_model
    from workbench.config import RunConfig
    from workbench.models.t5.step import encoder_mask
    from workbench.run.checkpoint import read_checkpoint

    meta = read_checkpoint(args.ckpt)
    cfg = RunConfig.from_dict(meta.config).replace(**{
        "parallel.tensor_parallel": args.tp, "parallel.pipeline_parallel": 1, "parallel.nnodes": 1,
        "parallel.nproc_per_node": args.tp, "parallel.device": "cpu", "parallel.sequence_parallel": False,
        "parallel.distributed_optimizer": False, "train.precision": "fp32", "train.compile_kernels": False,
        "model.attention_backend": "sdpa"})
    distributed.initialize(cfg)
    with cpu_mode.tensor_cuda_is_identity(True):
        model = build_model(cfg)
    load_checkpoint(meta.path, [model], load_optimizer=False)
    model.eval()
    x = torch.load(args.inputs, weights_only=True)
    mask = encoder_mask(x["mask"])
    with torch.no_grad():
        logits = model(x["enc"], x["dec"], mask, None, mask)  # [b, s, V/tp]
        if args.tp > 1:
            logits = gather_from_tensor_model_parallel_region(logits.contiguous())
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(logits.float().contiguous(), args.out)
    torch.distributed.barrier()
    distributed.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
