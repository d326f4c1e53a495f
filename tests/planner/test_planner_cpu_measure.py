"""The planner's activation model against the real megatron-core model, measured on CPU.

A ``TorchDispatchMode`` sees every tensor the model's forward creates; weak references on
their storages tell which are still alive when the forward returns: exactly what autograd
keeps for backward (plus the loss).  The model is the backend's own ``build_model`` (stock
megatron linears, workbench SDPA / norms, mcore's unfused attention for ``local``) wrapped in
megatron's ``Float16Module`` for bf16, run in a subprocess because CPU mode patches torch.

CPU kernels differ from CUDA ones in a few places, so the variants stay where both agree:
LayerNorm (CPU has no fused RMSNorm kernel: it upcasts), no dropout (CPU SDPA falls back to
the math kernel with dropout and keeps s^2 probabilities).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

VARIANTS = {
    "bf16-sdpa": {"train.precision": "bf16"},
    "bf16-sdpa-small-vocab": {"train.precision": "bf16", "model.vocab_size": 64},
    "fp32-sdpa": {"train.precision": "fp32", "model.vocab_size": 64},
    "bf16-local-attention": {"train.precision": "bf16", "model.attention_backend": "local", "model.vocab_size": 64},
    "bf16-rope": {"train.precision": "bf16", "model.position_embedding": "rope", "model.vocab_size": 64},
    "bf16-swiglu-gqa-nobias": {"train.precision": "bf16", "model.activation": "swiglu", "model.attention_type": "grouped",
                               "model.num_query_groups": 2, "model.add_bias_linear": False, "model.vocab_size": 64},
    "bf16-full-recompute": {"train.precision": "bf16", "parallel.recompute": "full", "parallel.recompute_num_layers": 2},
    # megatron's per-head q/k norms: their stats, and the normed q, k attention keeps without RoPE
    "bf16-qk-norm-gqa": {"train.precision": "bf16", "model.qk_layernorm": True, "model.attention_type": "grouped",
                         "model.num_query_groups": 2, "model.vocab_size": 64},
    "bf16-rope-qk-norm": {"train.precision": "bf16", "model.qk_layernorm": True, "model.position_embedding": "rope",
                          "model.vocab_size": 64},
}
#: OLMoE's q/k RMSNorms over all heads, against the same model without them: CPU's RMSNorm upcasts unlike CUDA's (the
#: whole model is off), so the planner's q/k terms are held to the measured difference the norms make
_RMS = {"train.precision": "bf16", "model.normalization": "rmsnorm", "model.position_embedding": "rope",
        "model.attention_type": "grouped", "model.num_query_groups": 2, "model.vocab_size": 64}
PAIR = {"rmsnorm-gqa": _RMS, "rmsnorm-gqa-qk-all-heads": {**_RMS, "model.qk_layernorm": True, "model.qk_norm_scope": "all_heads"}}


def _probe(variants: dict[str, dict], port: int) -> dict[str, dict]:
    """Runs in the subprocess: build each variant, measure live bytes after forward and the forward peak."""

    import torch

    from workbench import planner
    from workbench.backend import distributed
    from workbench.rank.build import build_model
    from workbench.backend.model import transformer_config
    from workbench.config import preset

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # tests/support (also when run as a script)
    from live_bytes import LiveBytes

    results = {}
    first = True
    for name, overrides in variants.items():
        cfg = preset("tiny", **overrides)
        if first:
            distributed.initialize_for_tests(cfg, port=port)
            first = False
        torch.manual_seed(0)
        model = build_model(cfg)
        if cfg.train.precision != "fp32":
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(transformer_config(cfg), model)
        model.train()
        b, s = cfg.train.micro_batch_size, cfg.model.seq_length
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s))
        pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
        labels = torch.randint(0, cfg.model.vocab_size, (b, s))
        tracker = LiveBytes(list(model.parameters()) + list(model.buffers()) + [tokens, pos, labels])
        with tracker:
            loss = model(tokens, pos, None, labels=labels)
            kept = tracker.cur
            fwd_peak = tracker.peak
        loss.float().mean().backward()
        # the planner's view of the same micro-batch on this (cuda-like, eager) kernel path
        a = planner.PlannerAssumptions(transformer_engine=False, compiled_layer=False, optimizer="foreach")
        st = planner.predict(cfg.replace(**{"parallel.device": "cuda", "train.compile_kernels": False}), assumptions=a).stages[0]
        results[name] = {
            "measured_kept": kept,
            "measured_forward_peak": fwd_peak,
            # megatron's global buffer (local attention's baddbmm input) is allocated by the forward too
            "predicted_kept": st.components["activations"] + st.detail["logits_kept"] + st.detail["global_buffer"],
            "predicted_forward_peak": st.components["activations"] + st.components["logits_loss"] + st.detail["global_buffer"],
        }
    distributed.destroy()
    return results


@pytest.fixture(scope="module")
def measured():
    from tests.support import free_port  # here, not at the top: this file also runs as a script

    root = Path(__file__).resolve().parents[2]
    port = free_port()  # other test runs may share this machine
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps({**VARIANTS, **PAIR}), str(port)], cwd=root,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kept_activations_match_megatron_model(measured, variant):
    r = measured[variant]
    err = (r["predicted_kept"] - r["measured_kept"]) / r["measured_kept"]
    assert abs(err) < 0.03, (variant, r, f"{100 * err:.1f}%")


@pytest.mark.slow
def test_all_heads_qk_norm_terms_match_what_the_norms_keep(measured):
    """The all-heads q/k norms keep an fp32 copy, the normed bf16 tensor and a per-token rstd for q and for k: the
    planner's terms equal the bytes the norms add to the same model (exactly, on this shape)."""
    base, qk = measured["rmsnorm-gqa"], measured["rmsnorm-gqa-qk-all-heads"]
    added = qk["measured_kept"] - base["measured_kept"]
    assert added > 0 and qk["predicted_kept"] - base["predicted_kept"] == pytest.approx(added, rel=0.02), (base, qk)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16-sdpa", "fp32-sdpa", "bf16-local-attention"])
def test_forward_peak_matches_megatron_model(measured, variant):
    # the forward's peak adds the logits transient (bf16 logits next to their fp32 copy) to what is kept
    r = measured[variant]
    err = (r["predicted_forward_peak"] - r["measured_forward_peak"]) / r["measured_forward_peak"]
    assert abs(err) < 0.05, (variant, r, f"{100 * err:.1f}%")


if __name__ == "__main__":
    print("RESULT " + json.dumps(_probe(json.loads(sys.argv[1]), int(sys.argv[2]))), flush=True)
    import os

    os._exit(0)  # skip interpreter teardown: gloo / CPU-mode patches can hang it, and nothing is left to flush
