"""A trained checkpoint through the conversion tools: export, verify, round trip, generate (one chain, two users).

``tests/gpu_proofs/two_gpu_conversion.py`` runs it on checkpoints trained on two GPUs;
``tests/conversion/test_two_rank_conversion.py`` on checkpoints trained by two CPU ranks under gloo.
Steps, all through the workbench's own conversion and generation paths:

1. ``megatron_to_hf`` (what ``workbench convert megatron-to-hf`` runs) writes an fp32 HF directory;
2. ``verify_against_hf`` (``workbench convert verify``) runs the trained checkpoint at its training layout
   (TP x PP CPU ranks under gloo, fp32) against the HF model's logits: max |difference| <= ``atol``;
   families without generation (BERT): the argmax of the compared logits equals HF's at every position
   (the fill-mask answer);
3. the round trip: ``hf_to_megatron`` at the training layout, then ``megatron_to_hf`` again: every tensor
   bit-identical to the first export;
4. generation (families that generate): ``workbench.generation.generate`` (``workbench generate``:
   supervised torchrun ranks at the checkpoint's layout), greedy, on the round-tripped fp32 checkpoint,
   token for token equal to HF ``generate(do_sample=False)`` on the exported model (fp32, TF32 off); a
   sequence the workbench ended at its EOS is compared up to it.  The trained checkpoint's own greedy
   tokens are reported beside (leading tokens that agree with HF's fp32 ones; bf16 training: informational).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["PROMPTS", "convert", "same_tokens", "hf_greedy"]

PROMPTS = ["And God said", "In the beginning God created", "And the LORD spake unto Moses, saying", "Blessed"]


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def same_tokens(ours: Any, theirs: list[int]) -> bool:
    """The workbench's greedy tokens against HF's (generated to full length without stopping): equal, or
    where the workbench stopped at its EOS, equal up to that token."""
    toks = list(ours.token_ids)
    return toks == theirs[: len(toks)] if ours.finish_reason == "stop" else toks == theirs


def hf_greedy(hf_dir: Path, prompts: list[list[int]], new: int, device: str, seq2seq: bool, dtype: str = "fp32") -> list[list[int]]:
    """HF ``generate`` greedy, one prompt at a time (no padding), ``new`` tokens without stopping at EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cls = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    tdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = cls.from_pretrained(str(hf_dir), dtype=tdt).to(device).eval()
    cfg = model.config
    model.generation_config.eos_token_id = None  # all ``new`` tokens, the distribution untouched (no EOS suppression)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            kw: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, num_beams=1,
                                      attention_mask=torch.ones_like(ids), pad_token_id=cfg.pad_token_id or 0)
            if seq2seq:
                kw["decoder_start_token_id"] = cfg.decoder_start_token_id if cfg.decoder_start_token_id is not None else 0
            seq = model.generate(input_ids=ids, **kw)
            out.append(seq[0, 1:].tolist() if seq2seq else seq[0, ids.shape[1]:].tolist())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def convert(ckpt: Path, work: Path, device: str, atol: float = 1e-4, new: int = 24) -> dict[str, Any]:
    """Run the chain on ``ckpt`` (files under ``work``); a dict of every number, ``pass`` when all steps hold."""
    import torch

    from workbench.config import GenerationConfig, RunConfig
    from workbench.conversion.api import compare_hf_dirs, hf_to_megatron, megatron_to_hf
    from workbench.conversion.verify import verify_against_hf
    from workbench.generation import generate
    from workbench.families import family_of
    from workbench.models.parts import parts_of
    from workbench.checkpoint import read_metadata

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    meta = read_metadata(ckpt)
    cfg = RunConfig.from_dict(meta["config"])
    fam = family_of(cfg)
    p = cfg.parallel
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    vpp = p.virtual_pipeline_parallel if p.vpp > 1 else None
    rec: dict[str, Any] = {"family": fam.name, "tp": tp, "pp": pp, "vpp": vpp, "iteration": meta.get("iteration"),
                           "precision": cfg.train.precision, "checkpoint": str(meta.get("path"))}
    t0 = time.time()
    hf = megatron_to_hf(ckpt, work / "hf", dtype="fp32", force=True, progress=False).output
    rec["export_seconds"] = round(time.time() - t0, 1)

    t0 = time.time()
    v = verify_against_hf(ckpt, hf, tp=tp, pp=pp, vpp=vpp, atol=atol)
    rec.update(verify_max_abs_diff=v["max_abs_diff"], verify_atol=atol, verify_ok=bool(v["ok"]),
               verify_seconds=round(time.time() - t0, 1))
    if not fam.supports.generation:  # BERT: the masked-token answer of the verified logits (fill-mask) is HF's
        ref, where = parts_of(fam).hf().hf_logits(hf, v["inputs"])
        vocab = ref.shape[-1]
        a, b = v["mcore_logits"][..., :vocab].argmax(-1), ref.argmax(-1)
        if where is not None:
            a, b = a[where], b[where]
        rec.update(argmax_positions=int(a.numel()), argmax_equal=int((a == b).sum()))

    t0 = time.time()
    back = hf_to_megatron(hf, work / "back", tp=tp, pp=pp, vpp=vpp, dtype="fp32", device=device, force=True, progress=False).output
    again = megatron_to_hf(back, work / "hf-again", dtype="fp32", force=True, progress=False).output
    cmp = compare_hf_dirs(hf, again)
    rec.update(round_trip_identical=bool(cmp["identical"]), round_trip_tensors=cmp["tensors"],
               round_trip_differing=cmp["differing"][:10], round_trip_seconds=round(time.time() - t0, 1))

    gen_ok = True
    if fam.supports.generation:
        t0 = time.time()
        greedy = GenerationConfig(greedy=True, max_new_tokens=new)
        trained = generate(ckpt, PROMPTS, greedy, device=device, work_dir=work / "gen-trained", timeout=600)
        ids = [list(r.prompt_ids) for r in trained]
        ours = generate(back, gen=greedy, prompt_ids=ids, device=device, work_dir=work / "gen-fp32", timeout=600)
        seq2seq = any(cls.endswith("ForConditionalGeneration") for _, cls in fam.supports.hf_classes)  # encoder-decoder
        theirs = hf_greedy(hf, ids, new, device, seq2seq)
        equal = [same_tokens(o, t) for o, t in zip(ours, theirs)]
        gen_ok = all(equal) and len(equal) == len(PROMPTS)
        rec.update(generate_equal=gen_ok, generate_equal_per_prompt=equal, prompt_ids=ids,
                   workbench_tokens=[o.token_ids for o in ours], workbench_finish=[o.finish_reason for o in ours],
                   hf_tokens=theirs, trained_precision_agree_prefix=[_agree(r.token_ids, t) for r, t in zip(trained, theirs)],
                   trained_text=[r.text for r in trained], new_tokens=new, generate_seconds=round(time.time() - t0, 1))
    rec["pass"] = bool(rec["verify_ok"] and rec["round_trip_identical"] and gen_ok
                       and rec.get("argmax_equal", 0) == rec.get("argmax_positions", 0))
    return rec
