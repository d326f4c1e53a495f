"""Generation throughput: the workbench engine vs HF ``generate`` on the same GPU, same weights.

For each model (GPT-2 small / medium, random weights) one HF ``GPT2LMHeadModel`` is built,
converted with ``workbench.conversion`` into the workbench's megatron-core model, and both
generate greedily from the same random 128-token prompts for exactly 128 new tokens (no EOS
stop), at batch 1 and batch 32.  Rows (``--variants``):

* ``workbench``        the engine: static KV cache, decode step captured in a CUDA graph,
                       host sync only every 16 tokens;
* ``workbench-eager``  the same engine with CUDA graphs off (what the graph buys);
* ``hf``               ``transformers`` ``model.generate(do_sample=False)`` (its default cache).

Tokens/s = batch * new tokens / wall time of the whole call (prefill included), median of
``--repeats`` after a warm-up call.  One JSON line per row goes to ``--out`` (default
``bench/results/generate_throughput.jsonl``) with device, date, git commit; workbench rows
carry ``speedup_vs_hf`` and the issue's target (3x at batch 1, 1.5x at batch 32).  The first
sequence's greedy tokens of every row are compared with HF's (``agree_prefix``: leading
tokens equal; bf16 rounding may legitimately split them late).

Run on a GPU machine from the repository root::

    python bench/generate_throughput.py                 # GPT-2 small + medium, batch 1 and 32
    python bench/generate_throughput.py --cpu-smoke     # tiny model on CPU (CI runs this)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "bench" / "results" / "generate_throughput.jsonl"
#: name -> (layers, hidden, heads)
MODELS = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "smoke": (2, 64, 4)}
TARGETS = {1: 3.0, 32: 1.5}  # the issue's speed-up targets over HF generate


def _git_commit() -> str:
    from workbench.provenance import git_commit

    return git_commit()


def _free_port() -> int:
    from workbench.run.files import free_port

    return free_port()


def build_pair(name: str, device: str, dtype: str, vocab: int, positions: int, seed: int = 0):
    """(HF model, workbench RunConfig, workbench mcore model) with identical weights."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from workbench.rank.build import build_model
    from workbench.conversion.hf import hf_to_mcore, run_config_from_hf

    layers, hidden, heads = MODELS[name]
    torch.manual_seed(seed)
    hcfg = GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=heads,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    hf = GPT2LMHeadModel(hcfg).eval()
    cfg = run_config_from_hf(hcfg.to_dict(), dtype=dtype)
    cfg = cfg.replace(**{"parallel.device": device, "model.attention_backend": "sdpa", "train.compile_kernels": False,
                         "train.micro_batch_size": 1, "train.global_batch_size": 1, "data.source": "synthetic"})
    model = build_model(cfg).eval()
    full = hf_to_mcore(hf.state_dict(), cfg, "gpt2")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            key = "embedding.word_embeddings.weight" if pname == "output_layer.weight" else pname
            p.copy_(full[key].to(p.dtype))
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    hf = hf.to(device=device, dtype=tdtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf, cfg, model


def _timed(fn, repeats: int, cuda: bool) -> tuple[float, Any]:
    import torch

    out = fn()  # warm-up (CUDA graph capture, allocator, kernels' autotuning)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import transformers

    from workbench.backend import distributed
    from workbench.backend.decoding import InferenceEngine
    from workbench.config import GenerationConfig

    cuda = not args.cpu_smoke
    device = "cuda" if cuda else "cpu"
    hf0, cfg0, _ = None, None, None
    first = True
    rows: list[dict[str, Any]] = []
    meta = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": _git_commit(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    for name in args.models:
        if first:
            from workbench.config import preset

            boot = preset("tiny", **{"parallel.device": device, "train.precision": "fp32"})
            distributed.initialize_for_tests(boot, port=_free_port())
            first = False
        hf, cfg, model = build_pair(name, device, args.dtype, args.vocab, args.positions)
        for batch in args.batch_sizes:
            g = torch.Generator().manual_seed(1000 + batch)
            prompts = torch.randint(0, args.vocab, (batch, args.prompt_len), generator=g)
            prompt_lists = prompts.tolist()
            gen = GenerationConfig(max_new_tokens=args.new_tokens, greedy=True)
            results: dict[str, tuple[float, list[int]]] = {}
            for variant in args.variants:
                if variant == "hf":
                    ids = prompts.to(device)
                    mask = torch.ones_like(ids)

                    def call():
                        with torch.inference_mode():
                            return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                               do_sample=False, pad_token_id=0)

                    secs, out = _timed(call, args.repeats, cuda)
                    first_tokens = out[0, args.prompt_len:].tolist()
                    graphs_used = None
                else:
                    graphs = variant == "workbench" and cuda
                    engine = InferenceEngine(model, vocab_size=args.vocab, max_positions=args.positions, pad_id=0,
                                             cuda_graphs=graphs)
                    secs, out = _timed(lambda: engine.generate(prompt_lists, gen, stop_ids=[], decode_text=False), args.repeats, cuda)
                    first_tokens = out[0].token_ids
                    graphs_used = engine.cuda_graphs  # False if capture failed and it fell back to eager
                    del engine
                results[variant] = (secs, first_tokens)
                row = {"bench": "generate_throughput", "model": name, "variant": variant, "batch": batch,
                       "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype,
                       "seconds": round(secs, 5), "tokens_per_s": round(batch * args.new_tokens / secs, 2),
                       "ms_per_token_step": round(1000 * secs / args.new_tokens, 4), "repeats": args.repeats,
                       "cuda_graphs": graphs_used if variant != "hf" else None, **meta}
                rows.append(row)
                print(f"{name:12s} batch {batch:3d} {variant:16s} {row['tokens_per_s']:10.1f} tok/s  "
                      f"({row['ms_per_token_step']:.3f} ms/token step)", flush=True)
            if "hf" in results:
                hf_secs, hf_tokens = results["hf"]
                for row in rows[-len(args.variants):]:
                    toks = results[row["variant"]][1]
                    agree = 0
                    for a, b in zip(toks, hf_tokens):
                        if a != b:
                            break
                        agree += 1
                    row["agree_prefix"] = agree
                    if row["variant"] != "hf":
                        row["speedup_vs_hf"] = round(hf_secs / row["seconds"], 3)
                        if batch in TARGETS and cuda:
                            row["target_speedup"] = TARGETS[batch]
                            row["meets_target"] = row["speedup_vs_hf"] >= TARGETS[batch]
        del hf, model
        if cuda:
            torch.cuda.empty_cache()
    distributed.destroy()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-small,gpt2-medium")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--variants", default="workbench,workbench-eager,hf")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, fp32, CPU, short prompts (for CI)")
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.batch_sizes = [int(b) for b in a.batch_sizes.split(",") if b]
    a.variants = [v for v in a.variants.split(",") if v]
    if a.cpu_smoke:
        a.models, a.batch_sizes, a.dtype, a.repeats = ["smoke"], [1, 3], "fp32", 1
        a.prompt_len, a.new_tokens, a.vocab, a.positions = 8, 8, 512, 64
        a.variants = [v for v in a.variants if v != "workbench-eager"] or ["workbench", "hf"]
    else:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA GPU visible: run on a GPU machine, or use --cpu-smoke")
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}: choose from {sorted(MODELS)}")
    bad = [v for v in a.variants if v not in ("workbench", "workbench-eager", "hf")]
    if bad:
        ap.error(f"unknown variant(s) {bad}: workbench, workbench-eager, hf")
    os.environ.setdefault("OMP_NUM_THREADS", "1" if a.cpu_smoke else "8")
    rows = run(a)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {out}")
    for r in rows:
        if "speedup_vs_hf" in r:
            tgt = f" (target {r['target_speedup']}x: {'met' if r['meets_target'] else 'NOT met'})" if "target_speedup" in r else ""
            print(f"  {r['model']} batch {r['batch']} {r['variant']}: {r['speedup_vs_hf']}x HF{tgt}; agree_prefix {r['agree_prefix']}/{r['new_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
