"""A checkpoint trained on several GPUs (or ranks) through the conversion tools: export, verify, round trip, generate.

    python3 tests/gpu_proofs/two_gpu_conversion.py --ckpt RUN/checkpoints --work DIR --result DIR/result.json [--device cuda]

Run by ``tests/gpu_proofs/two_gpu_proof.py --phase b`` on each checkpoint it trains (GPT and Llama at TP=2 and PP=2,
BERT and T5 at TP=2); the chain is ``tests/support/conversion_chain.py`` (the CPU test of two-rank
checkpoints runs the same one).  Steps, all through the workbench's own conversion and generation paths:

1. ``megatron_to_hf`` (what ``workbench convert megatron-to-hf`` runs) writes an fp32 HF directory;
2. ``verify_against_hf`` (``workbench convert verify``) runs the trained checkpoint at its training layout
   (TP x PP CPU ranks under gloo, fp32) against the HF model's logits: max |difference| <= ``--atol``;
   BERT: also the argmax of the compared logits equals HF's at every position (its fill-mask answer);
3. the round trip: ``hf_to_megatron`` at the training layout, then ``megatron_to_hf`` again: every tensor
   bit-identical to the first export;
4. generation (families that generate): ``workbench.generation.generate`` (``workbench generate``:
   supervised torchrun ranks at the checkpoint's layout), greedy, on the round-tripped fp32 checkpoint,
   token for token equal to HF ``generate(do_sample=False)`` on the exported model (fp32, TF32 off); a
   sequence the workbench ended at its EOS is compared up to it.  The trained bf16 checkpoint's own
   greedy tokens are reported beside (how many leading tokens agree with HF's fp32 ones; informational).

Writes one JSON object (``pass`` and every number) to ``--result``; exit 0 when it passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, type=Path, help="the trained checkpoint (root or iter_ directory)")
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--result", required=True, type=Path)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--atol", type=float, default=1e-4, help="convert verify's bar (fp32 logits)")
    ap.add_argument("--new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    from tests.support.conversion_chain import convert

    try:
        rec = convert(args.ckpt, args.work, args.device, args.atol, args.new_tokens)
    except Exception as e:  # recorded, not raised: the proof's table says what failed
        rec = {"pass": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    args.result.parent.mkdir(parents=True, exist_ok=True)
    args.result.write_text(json.dumps(rec, default=str))
    print(json.dumps({k: v for k, v in rec.items() if k not in ("traceback",)}, default=str)[:3000], flush=True)
    return 0 if rec["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
