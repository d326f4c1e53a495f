"""HF MegatronBertForPreTraining <-> megatron-core BERT: round trip bit-exact through TP=2 and a PP=3
reshape, MLM and sentence-order logits within 1e-4 of HF (fp32, CPU) on an odd shape (vocab 999 padded
to 1024, 6 heads of 10), and HF's post-LN ``bert`` refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

SCRIPT = r'''
import json, sys, torch
from pathlib import Path
from transformers import MegatronBertForPreTraining
from workbench.config import RunConfig
from workbench.conversion.api import make_random_hf_model, hf_to_megatron, megatron_to_hf, reshape, compare_hf_dirs
from workbench.models.common.one_process import build_full_model, single_process_group
from workbench.checkpoint import load_checkpoint, read_metadata

root = Path(sys.argv[1])
hf = make_random_hf_model(root / "hf", "megatron-bert", hidden=60, layers=3, heads=6, vocab=999, positions=64)
mc = hf_to_megatron(hf, root / "mc", tp=2, pp=1, dtype="fp32", device="cpu", progress=False)
reshape(root / "mc", root / "mc_pp3", tp=1, pp=3)
megatron_to_hf(root / "mc_pp3", root / "hf_back", progress=False)
out = {"round_trip": compare_hf_dirs(hf, root / "hf_back"), "notes": mc.notes}

g = torch.Generator().manual_seed(0)
b, s = 3, 40
tokens = torch.randint(0, 999, (b, s), generator=g)
types = (torch.arange(s)[None] >= torch.tensor([[12], [20], [5]])).long()
lengths = torch.tensor([40, 31, 17])
mask = (torch.arange(s)[None] < lengths[:, None]).long()
ref = MegatronBertForPreTraining.from_pretrained(hf, attn_implementation="eager").eval()
with torch.no_grad():
    r = ref(input_ids=tokens, attention_mask=mask, token_type_ids=types * mask, position_ids=torch.arange(s)[None].expand(b, -1))
meta = read_metadata(root / "mc")
cfg = RunConfig.from_dict(meta["config"])
with single_process_group():
    model = build_full_model(cfg, "fp32")
    load_checkpoint(meta["path"], [model], load_optimizer=False)
    model.eval()
    with torch.no_grad():
        logits, binary = model(tokens, mask, tokentype_ids=types * mask)
real = mask.bool()
out["mlm_max_abs"] = float((logits[..., :999] - r.prediction_logits)[real].abs().max())
out["sop_max_abs"] = float((binary - r.seq_relationship_logits).abs().max())
out["padded_vocab"] = int(logits.shape[-1])
print(json.dumps(out))
'''


def test_round_trip_and_logits_match_hf(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    res = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert res["round_trip"]["identical"] and res["round_trip"]["tensors"] > 40, res["round_trip"]
    assert res["padded_vocab"] == 1024 and any("999 -> 1024" in n for n in res["notes"])
    assert res["mlm_max_abs"] < 1e-4 and res["sop_max_abs"] < 1e-4, res


def test_post_ln_bert_is_refused_with_the_reason(tmp_path):
    from transformers import BertConfig, BertForPreTraining

    BertForPreTraining(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64)).save_pretrained(tmp_path / "bert")
    from workbench.conversion.hf import read_hf_config
    from workbench.models.common.conversion_rules import ConversionError

    with pytest.raises(ConversionError, match="post-LN.*megatron-bert"):
        read_hf_config(tmp_path / "bert")
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "hf-to-megatron", "--hf", str(tmp_path / "bert"),
                           "--out", str(tmp_path / "out")], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "post-LN" in proc.stderr, proc.stderr[-2000:]


def test_convert_verify_runs_bert_at_tp2(tmp_path):
    """``workbench convert verify`` routes the forward through the BERT family (ids, padding mask, token types):
    a converted HF megatron-bert (saved at TP=1: vocab 301 padded to 384) run at TP=2 (padded to 512, the LM head's
    vocab-sized bias re-padded on load) gives HF's MLM logits within 1e-4 on the real positions."""
    from workbench.conversion.api import hf_to_megatron, make_random_hf_model

    hf = make_random_hf_model(tmp_path / "hf", "megatron-bert", hidden=48, layers=4, heads=4, vocab=301, positions=32)
    hf_to_megatron(hf, tmp_path / "mc", tp=1, pp=1, dtype="fp32", device="cpu", progress=False)
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "verify", "--ckpt", str(tmp_path / "mc"), "--hf", str(hf),
                           "--tp", "2", "--seq-length", "24", "--batch-size", "3"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("max |logits")][-1]
    assert "tp=2 pp=1" in line and float(line.split("| = ")[1].split()[0]) < 1e-4, line

    # reshape to TP=2 re-pads every vocab-sized tensor (the LM head's bias too), and the export is bit-identical
    from workbench.checkpoint import checkpoint_tensor_shapes
    from workbench.conversion.api import compare_hf_dirs, megatron_to_hf, reshape
    from workbench.checkpoint import find_checkpoint

    reshape(tmp_path / "mc", tmp_path / "mc_tp2", tp=2, pp=1)
    shapes = checkpoint_tensor_shapes(find_checkpoint(tmp_path / "mc_tp2"))
    assert shapes["output_layer.bias"][0] == (512,) and shapes["embedding.word_embeddings.weight"][0] == (512, 48)
    megatron_to_hf(tmp_path / "mc_tp2", tmp_path / "hf_back", progress=False)
    assert compare_hf_dirs(hf, tmp_path / "hf_back")["identical"]
