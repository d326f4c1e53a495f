"""T5 benchmark rows: one-GPU training throughput of the presets as shipped against HF's own
``T5ForConditionalGeneration``, planner prediction against the measured peak, and generation speed against HF
``generate``.

Rows (``--rows``, comma list):

- ``throughput`` (the headline rows): ``t5-base`` (v1.0: ReLU, tied head) and ``t5-v1_1-base`` (gated GELU, untied)
  AT THEIR PRESETS' DEFAULTS (hidden dropout 0.1, attention dropout 0, encoder 512 / decoder 114 tokens,
  micro-batch 16, 8 micro-batches, bf16) trained by the workbench's Trainer (real mcore T5Model, DDP, Megatron
  optimizer; the kernel path the rule picks) and by the yardstick (``bench/reference_t5.py``: HF
  ``T5ForConditionalGeneration`` with SDPA attention, whole-model ``torch.compile``, bf16 autocast, fused AdamW,
  clip 1.0, the same dropout) on the same synthetic span-corruption batches, same GPU, same run: tokens/s
  (encoder tokens), ratio (target >= 1.15x), MFU.
- ``throughput-dropout0``: ``t5-base`` with dropout 0 on both sides (not the preset's setting; named so).
- ``planner``: ``t5-base`` and ``t5-v1_1-base`` as shipped: the planner's peak allocated against
  ``torch.cuda.max_memory_allocated`` of the workbench's steps (target within 10%).
- ``dropout``: ``t5-base`` with dropout 0.1 on the workbench's attention backends (sdpa, te, auto).
- ``generate``: t5-base shape (random weights, bf16): the workbench engine (encoder once, KV-cached decoder,
  CUDA-graph decode step) against HF ``generate`` on the same weights, 128 encoder tokens, 128 new tokens
  (greedy, no early stop), batch 1 and 32: new tokens/s and ratio (target >= 3x at batch 1), tokens equal.
- ``generate-te``: the same with ``model.attention_backend: te`` (the engine on T5's TE layer).

Each row runs in its own torchrun process; results are appended as JSON lines (device, date, commit) to
``--out`` (default ``bench/results/t5_bench.jsonl``), then a table of the throughput rows' ratios is printed.
``--cpu-smoke`` runs t5-tiny shapes on CPU (a smoke of the script; ratios there mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


def _cfg(preset_name: str, smoke: bool, **over: Any):
    return harness.bench_cfg(preset_name, smoke, smoke_preset="t5-tiny", **over)


def _train_worker(kind: str, preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    def reference(cfg: Any, **kw: Any) -> Any:
        from bench.reference_t5 import ReferenceT5

        return ReferenceT5(cfg, **kw)

    def dataset(cfg: Any) -> Any:
        from workbench.models.t5.data import SyntheticT5Dataset

        return SyntheticT5Dataset(cfg)

    return harness.train_worker(kind, preset_name, _cfg(preset_name, a.cpu_smoke, **harness.overrides(a)), a, reference=reference, dataset=dataset,
                                tmp_prefix="wb-t5-bench-")


def _generate_worker(preset_name: str, a: argparse.Namespace) -> dict[str, Any]:
    """The workbench engine and HF generate on the same weights (random init), greedy, fixed lengths."""
    import torch

    from bench.reference_t5 import build_hf_t5
    from workbench.backend import distributed
    from workbench.rank.build import build_model
    from workbench.config import GenerationConfig
    from workbench.models.t5.generate import T5Engine
    from workbench.conversion.hf import mcore_to_hf
    from workbench.models.t5.model import TE_KEYS

    cuda = not a.cpu_smoke
    cfg = _cfg(preset_name, a.cpu_smoke, **{"model.make_vocab_size_divisible_by": 128 if cuda else 64, **harness.overrides(a)})
    distributed.initialize(cfg)
    torch.manual_seed(0)
    model = build_model(cfg)
    def family_name(key: str) -> str:  # TE's fused-norm names -> the family's (what its checkpoints hold)
        for te_name, name in TE_KEYS.items():
            key = key.replace(te_name, name)
        return key

    full = {family_name(k): v for k, v in model.state_dict().items() if not k.endswith("_extra_state") and hasattr(v, "shape")}
    hf = build_hf_t5(cfg, "cuda" if cuda else "cpu").eval()
    missing, unexpected = hf.load_state_dict(mcore_to_hf(full, cfg, "t5"), strict=False)
    assert not unexpected and all("embed_tokens" in k or k == "lm_head.weight" for k in missing), (missing, unexpected)
    dtype = torch.bfloat16 if cuda else torch.float32
    hf = hf.to(dtype)
    eng = T5Engine(model, vocab_size=cfg.model.vocab_size, eos_id=None, pad_id=0)
    P, new = (128, 128) if cuda else (16, 8)
    out: dict[str, Any] = {"preset": preset_name, "prompt_tokens": P, "new_tokens": new, "attention_backend": cfg.model.attention_backend,
                           "device": torch.cuda.get_device_name() if cuda else "cpu", "rows": []}
    for batch in (1, 32) if cuda else (1, 4):
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(2, cfg.model.vocab_size, (batch, P), generator=g)
        gen = GenerationConfig(greedy=True, max_new_tokens=new)
        for _ in range(2):
            ours = eng.generate(prompts.tolist(), gen, decode_text=False)
        t_ours = harness.median([(harness.sync(cuda), eng.generate(prompts.tolist(), gen, decode_text=False), harness.sync(cuda),
                                  eng.last_timing["seconds"])[-1] for _ in range(3)])
        dev_prompts = prompts.to(hf.device)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1, pad_token_id=0, decoder_start_token_id=0)
        with torch.inference_mode():
            for _ in range(2):
                ref = hf.generate(input_ids=dev_prompts, **kw)
            t_hf = harness.median(harness.time_steps(lambda: hf.generate(input_ids=dev_prompts, **kw), 3, cuda))
        same = [o.token_ids for o in ours] == ref[:, 1:].tolist()
        out["rows"].append({"batch": batch, "workbench_tokens_per_s": batch * new / t_ours, "hf_tokens_per_s": batch * new / t_hf,
                            "ratio": t_hf / t_ours, "tokens_equal": same, "workbench_s": t_ours, "hf_s": t_hf})
    distributed.destroy()
    return out


def rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    want = harness.wanted(a)
    base = "t5-tiny" if a.cpu_smoke else "t5-base"
    out = harness.training_rows(SCRIPT, a, [base] if a.cpu_smoke else ["t5-base", "t5-v1_1-base"],
                                lambda name, **over: _cfg(name, a.cpu_smoke, **over))
    if "generate" in want:
        res = harness.measure(SCRIPT, "generate", base, a)
        out.append({"row": "generate", **res, "target": ">= 3x at batch 1"})
    if "generate-te" in want:  # the engine on T5's TE layer (attention_backend: te)
        res = harness.measure(SCRIPT, "generate", base, a, {"model.attention_backend": "te"})
        out.append({"row": "generate-te", **res})
    return out


def _worker(a: argparse.Namespace) -> dict[str, Any]:
    return _generate_worker(a.preset, a) if a.worker == "generate" else _train_worker(a.worker, a.preset, a)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, rows="throughput,throughput-dropout0,planner,generate",
                        rows_help="comma list: throughput, throughput-dropout0, planner, dropout, generate, generate-te",
                        smoke_help="t5-tiny on CPU, 2 steps (smoke)", out="t5_bench.jsonl", preset="t5-base")
    return harness.run(ap.parse_args(argv), _worker, rows)


if __name__ == "__main__":
    sys.exit(main())
