"""Tiny random HF MoE models made to show conversion mistakes, and the checks the Qwen3-MoE and OLMoE conversion
tests share on them."""

from __future__ import annotations

import torch


def spread(model, head_dim: int | None = None, seed: int = 1):
    """Move ``model``'s fresh weights (in place) so a conversion mistake shows in its logits: every weight nudged, the
    routers' logits spread far from top-k ties, the q/k norms far from ones; ``head_dim``: the q/k projections' heads
    also scaled unequally, so a norm over each head differs from one over all heads.  Returns ``model`` in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
            if name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
            if name.endswith("_norm.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
            if head_dim and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = p.shape[0] // head_dim
                p.mul_(torch.linspace(0.3, 3.0, heads).repeat_interleave(head_dim)[:, None])
    return model.eval()


def save_random(model_cls, config, root, head_dim: int | None = None):
    """A fresh ``model_cls(config)`` (torch seed 0), :func:`spread` (``head_dim`` as there) and saved to ``root``:
    ``(root, model)``."""
    torch.manual_seed(0)
    model = model_cls(config)
    spread(model, head_dim=head_dim).save_pretrained(root)
    return root, model


def convert(hf_dir, out, **kw):
    """``hf_dir`` converted to a megatron-core checkpoint at ``out`` on CPU (``kw``: ``hf_to_megatron``'s layout)."""
    from workbench.conversion import hf_to_megatron

    return hf_to_megatron(hf_dir, out, device="cpu", progress=False, **kw)


def tokens(vocab: int):
    """The same two sequences of 12 token ids below ``vocab`` on every call."""
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))


def forwards(first, second, vocab: int):
    """Two checkpoints' logits on :func:`tokens` from one launch of four ranks (``tests.support.verify_runs``: verify's
    worker once per job): ``first`` at EP=1 (its other ranks data-parallel replicas), ``second`` at TP=2 x EP=2."""
    from tests.support.verify_runs import forward_logits_many

    return forward_logits_many([dict(ckpt=first, tokens=tokens(vocab)),
                                dict(ckpt=second, tokens=tokens(vocab), tp=2, ep=2)])


def hf_logits(hf, vocab: int):
    """HF model ``hf``'s fp32 logits on :func:`tokens`."""
    with torch.no_grad():
        return hf(tokens(vocab)).logits.float()


def assert_logits_match(got, hf, vocab: int, **layout):
    """Megatron logits ``got`` (padded vocab) match ``hf``'s own on :func:`tokens`, which are far from zero."""
    ref = hf_logits(hf, vocab)
    got = got[..., :vocab]
    assert ref.abs().max() > 0.5
    assert (got - ref).abs().max() < 1e-4, layout


def assert_same_tensors(a: dict, b: dict):
    """Two state dicts with the same names and bit-identical tensors."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def export_back(ckpt, out):
    """Checkpoint ``ckpt`` exported to HF at ``out``: its ``config.json`` as a dict and the model read back (fp32)."""
    import json

    from transformers import AutoModelForCausalLM

    from workbench.conversion import megatron_to_hf

    megatron_to_hf(ckpt, out, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    return cfg, AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)


def per_expert_names(sd: dict) -> dict:
    """``sd`` with transformers 5's fused expert tensors (``mlp.experts.gate_up_proj / down_proj``) under the
    published per-expert names (``mlp.experts.<e>.gate_proj / up_proj / down_proj``)."""
    old = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                old[f"{p}{e}.gate_proj.weight"], old[f"{p}{e}.up_proj.weight"] = v[e].chunk(2, dim=0)
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                old[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            old[k] = v
    return old


def rules(model_type: str, sd: dict, cfg):
    """HF state dict ``sd`` of ``model_type`` through the GPT family's HF -> megatron-core conversion rules."""
    from workbench.models.common.conversion_rules import infos_of, run_rules
    from workbench.models.gpt import hf as gpt_hf

    return run_rules(gpt_hf.hf_to_mcore_rules(infos_of(sd), cfg, model_type), sd)


def refused_through_cli(tmp_path, config_json: str) -> str:
    """``convert hf-to-megatron`` through the CLI on an HF dir holding only ``config_json``: refused (exit 2, no
    traceback, nothing written).  Returns its output, for the reason."""
    import subprocess
    import sys

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(config_json)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "hf-to-megatron", "--hf", str(tmp_path / "hf"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr + proc.stdout
    assert "Traceback" not in err and not (tmp_path / "out").exists(), err
    return err
