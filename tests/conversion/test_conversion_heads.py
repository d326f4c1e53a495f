"""Every model family's HF conversion, with a tied and an untied LM head (tiny random models, fp32, CPU):

- HF -> workbench checkpoint -> HF gives the same files, tensor for tensor (nothing dropped: a tensor HF
  would re-initialise on load is a missing one);
- the exported directory's logits, loaded by ``from_pretrained``, equal the original model's (what a user of
  the export gets; an untied BERT head's ``cls.predictions.decoder.bias`` left out was re-initialised by HF);
- the converted checkpoint's megatron-core logits equal HF's (the family's ``verify_inputs`` / ``hf_logits`` /
  ``step.logits_forward``, the parts ``workbench convert verify`` uses).

Three subprocesses serve every case (megatron-core's process groups stay out of the test process, and HF's
models are built where megatron-core never ran); each case is its own test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

#: case -> (HF model_type, make_random_hf_model keywords, the workbench config's tie_embeddings after import)
CASES = {
    "gpt2-tied": ("gpt2", {"tied": True}, True),
    "gpt2-untied": ("gpt2", {"tied": False}, False),
    "llama-tied": ("llama", {"tied": True}, True),
    "llama-untied": ("llama", {"tied": False}, False),
    "megatron-bert-tied": ("megatron-bert", {"tied": True}, True),
    "megatron-bert-untied": ("megatron-bert", {"tied": False}, False),
    "t5-tied": ("t5", {"tied": True, "feed_forward_proj": "relu"}, True),
    "t5-untied": ("t5", {"tied": False, "feed_forward_proj": "gated-gelu"}, False),
    "mt5-untied": ("mt5", {}, False),
}

#: phase 1 (no megatron-core in the process): the random HF models
MAKE = r'''
import json, sys
from pathlib import Path
from workbench.conversion.hf import hf_adapter

root, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
for name, (mt, kw) in cases.items():
    shape = dict(hidden=48, layers=2, heads=4, vocab=123, positions=32, seed=7)  # vocab 123: padded on import
    if mt == "llama":
        shape["kv_heads"] = 2
    hf_adapter(mt).make_random_hf_model(root / name / "hf", mt, **shape, **kw)
'''

#: phase 2: HF -> workbench checkpoint -> HF, and the checkpoint's megatron-core logits on the family's verify inputs
CONVERT = r'''
import json, sys, torch
from pathlib import Path
from workbench.checkpoint import load_checkpoint, read_metadata
from workbench.conversion.api import compare_hf_dirs, hf_to_megatron, megatron_to_hf
from workbench.models.common.one_process import build_full_model, single_process_group
from workbench.conversion.hf import hf_adapter
from workbench.models.parts import parts_of
from workbench.checkpoint import checkpoint_config

root, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
for name, (mt, kw) in cases.items():
    d = root / name
    res = hf_to_megatron(d / "hf", d / "mc", dtype="fp32", device="cpu", progress=False)
    megatron_to_hf(d / "mc", d / "back", progress=False)
    inputs = hf_adapter(mt).verify_inputs(123, 2, 12, seed=1)
    meta = read_metadata(d / "mc")
    cfg = checkpoint_config(meta)
    with single_process_group():
        model = build_full_model(cfg, "fp32")
        load_checkpoint(meta["path"], [model], load_optimizer=False)
        model.eval()
        with torch.no_grad():
            torch.save(parts_of(cfg).step().logits_forward(model, inputs)[..., :123].contiguous(), d / "mcore.pt")
    out = {"round_trip": compare_hf_dirs(d / "hf", d / "back"), "tied": res.config.model.tie_embeddings}
    print("CASE " + json.dumps({name: out}), flush=True)
'''

#: phase 3 (no megatron-core in the process: HF models built after it has run can start from uninitialised buffers):
#: the original's and the export's HF logits, and the distance of each from megatron-core's
LOGITS = r'''
import json, sys, torch
from pathlib import Path
from workbench.conversion.hf import hf_adapter

root, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
for name, (mt, kw) in cases.items():
    d = root / name
    hf = hf_adapter(mt)
    inputs = hf.verify_inputs(123, 2, 12, seed=1)
    ref, where = hf.hf_logits(d / "hf", inputs)
    back, _ = hf.hf_logits(d / "back", inputs)
    delta = (torch.load(d / "mcore.pt") - ref).abs()
    out = {"export_max_abs": float((back - ref).abs().max()), "scale": float(ref.abs().max()),
           "mcore_max_abs": float((delta[where] if where is not None else delta).max())}
    print("CASE " + json.dumps({name: out}), flush=True)
'''

#: tensors of an HF checkpoint that its model never reads, so a round trip need not keep their values
UNUSED = {"megatron-bert-untied": ["cls.predictions.bias"]}  # untied, HF's logits take the decoder's own bias


def _phase(script: str, root: Path, cases: dict) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", script, str(root), json.dumps(cases)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            out.update(json.loads(line[5:]))
    return out, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    cases = {k: (mt, kw) for k, (mt, kw, _) in CASES.items()}
    _, log = _phase(MAKE, root, cases)
    results, log2 = _phase(CONVERT, root, cases)
    logits, log3 = _phase(LOGITS, root, {k: v for k, v in cases.items() if k in results})
    for k, v in logits.items():
        results[k].update(v)
    return results, log + log2 + log3


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_and_logits_of_tied_and_untied_heads(converted, case):
    results, proc_log = converted
    assert case in results, proc_log
    r = results[case]
    assert r["tied"] is CASES[case][2]
    assert not r["round_trip"]["missing"], r["round_trip"]  # no tensor dropped (HF would re-initialise it)
    assert sorted(r["round_trip"]["differing"]) == UNUSED.get(case, []), r["round_trip"]  # none changed that HF reads
    assert "mcore_max_abs" in r, proc_log
    tol = 1e-4 * max(r["scale"], 1.0)
    assert r["export_max_abs"] <= tol, r  # the export, loaded by HF, is the original model
    assert r["mcore_max_abs"] <= tol, r  # the converted checkpoint is the original model
