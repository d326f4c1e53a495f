"""HF T5 / mT5 <-> megatron-core T5: round trip bit-exact through TP=2 and a reshape to TP=3, logits within
1e-4 of HF (fp32, CPU) on random odd-shaped models (vocab 203 padded, 6 heads of 10 != d_model / heads,
3 encoder / 2 decoder layers, padded encoder inputs): t5 v1.0 (ReLU, tied head scaled by d_model^-0.5),
t5 v1.1 layout (gated GELU, no scaling) and mt5."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

SCRIPT = r'''
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForSeq2SeqLM
from workbench.config import RunConfig
from workbench.conversion.api import hf_to_megatron, megatron_to_hf, reshape, compare_hf_dirs
from workbench.models.common.one_process import build_full_model, single_process_group
from workbench.checkpoint import load_checkpoint, read_metadata
from workbench.models.t5.hf import make_random_hf_model
from workbench.models.t5.step import encoder_mask

def case(root, mt, ff):
    hf = make_random_hf_model(root / "hf", mt, hidden=48, layers=3, decoder_layers=2, heads=6, d_kv=10, vocab=203,
                              feed_forward_proj=ff)
    mc = hf_to_megatron(hf, root / "mc", tp=2, pp=1, dtype="fp32", device="cpu", progress=False)
    reshape(root / "mc", root / "mc_tp3", tp=3, pp=1)
    megatron_to_hf(root / "mc_tp3", root / "hf_back", progress=False)
    out = {"round_trip": compare_hf_dirs(hf, root / "hf_back"),
           "config_back": json.loads((root / "hf_back" / "config.json").read_text())}
    g = torch.Generator().manual_seed(0)
    B, S, T = 3, 19, 11
    enc = torch.randint(2, 203, (B, S), generator=g)
    am = (torch.arange(S)[None] < torch.tensor([[19], [12], [5]])).long()
    dec = torch.randint(2, 203, (B, T), generator=g)
    dec[:, 0] = 0
    ref = AutoModelForSeq2SeqLM.from_pretrained(hf).eval()
    with torch.no_grad():
        r = ref(input_ids=enc, attention_mask=am, decoder_input_ids=dec).logits
    meta = read_metadata(root / "mc_tp3")
    cfg = RunConfig.from_dict(meta["config"])
    out["tied"], out["activation"] = cfg.model.tie_embeddings, cfg.model.activation
    with single_process_group():
        model = build_full_model(cfg, "fp32")
        load_checkpoint(meta["path"], [model], load_optimizer=False)
        model.eval()
        mask = encoder_mask(am)
        with torch.no_grad():
            logits = model(enc, dec, mask, None, mask)
    out["max_abs"] = float((logits[..., :203] - r).abs().max())
    out["scale"] = float(r.abs().max())
    out["padded_vocab"] = int(logits.shape[-1])
    return out


# one process for every case (importing torch and megatron-core is most of a case's time), then the mT5 checkpoint
# that ``convert verify`` runs
root = Path(sys.argv[1])
print(json.dumps({name: case(root / name, mt, ff) for name, mt, ff in json.loads(sys.argv[2])}))
from workbench.models.t5.hf import make_random_hf_model
h = make_random_hf_model(root / "verify" / "hf", "mt5", hidden=48, layers=2, heads=6, d_kv=10, vocab=203)
hf_to_megatron(h, root / "verify" / "mc", tp=1, dtype="fp32", device="cpu", progress=False)
'''

CASES = {"t5_v1_0": ("t5", "relu", True, "relu"), "t5_v1_1": ("t5", "gated-gelu", False, "geglu"),
         "mt5": ("mt5", "gated-gelu", False, "geglu")}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(every case's results, the root): one process runs :data:`SCRIPT` for every case and writes the mT5 checkpoint
    (``<root>/verify/mc``, from ``<root>/verify/hf``) that ``convert verify`` runs."""
    root = tmp_path_factory.mktemp("t5-conversion")
    cases = [(name, mt, ff) for name, (mt, ff, _, _) in CASES.items()]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root), json.dumps(cases)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1]), root


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_and_logits_match_hf(converted, case):
    mt, ff, tied, act = CASES[case]
    out = converted[0][case]
    assert out["round_trip"]["identical"], out["round_trip"]
    assert out["tied"] is tied and out["activation"] == act
    assert out["config_back"]["model_type"] == mt
    assert out["padded_vocab"] > 203  # padded for TP=3 rows, stripped on export
    assert out["max_abs"] <= 1e-4 * max(out["scale"], 1.0), out


def test_workbench_convert_verify_runs_t5_at_tp2(converted):
    """``workbench convert verify`` asks the checkpoint's family for inputs, HF logits and the forward: a converted
    mT5 checkpoint run at TP=2 on CPU ranks within 1e-4 of HF."""
    tmp_path = converted[1] / "verify"  # the mT5 model (2 layers) and its TP=1 conversion, written by the fixture
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "convert", "verify", "--ckpt", str(tmp_path / "mc"),
                           "--hf", str(tmp_path / "hf"), "--tp", "2"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "max |logits(mcore tp=2 pp=1) - logits(HF)|" in proc.stdout
