"""Conversion streams: its memory is bounded by the largest tensor, not the model (a ~600 MB Llama-shaped model).

``bench/convert_stream.py --shape ci`` makes the HF checkpoint shard by shard, then runs HF -> TP=2 x PP=2
(``hf_to_megatron``) -> TP=1 (``reshape``) -> HF (``megatron_to_hf``) and the streaming comparison, each step
in a fresh process whose peak-RSS mark is reset after its imports.  Each step's peak above that baseline must
stay within ``largest tensor x 3 + 200 MB`` and below 40% of the model (a conversion that holds the model once,
as a whole-state-dict conversion does two or three times over, cannot pass), and the round trip must be
bit-identical.  A generation at TP=2 x PP=2 from the converted checkpoint: each rank holds its own shard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "convert_stream.py"
FACTOR, SLACK = 3, 200 * 2**20

pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.slow]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert-stream")
    out = work / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shape", "ci", "--workdir", str(work / "w"), "--out", str(out),
                           "--keep"], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r for r in map(json.loads, out.read_text().splitlines())}, work / "w"


@pytest.mark.parametrize("step", ["hf-to-megatron", "reshape", "megatron-to-hf", "compare"])
def test_each_step_peaks_at_a_few_tensors_not_the_model(rows, step):
    r = rows[0][step]
    assert r["peak_reset_after_imports"], "this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs)"
    used, largest, model = r["peak_minus_baseline_bytes"], r["largest_tensor_bytes"], r["model_bytes"]
    assert model > 500e6 and largest < model / 15, r  # the model is much more than its largest tensor
    assert used <= largest * FACTOR + SLACK, (f"{step}: {used / 1e6:.0f} MB above the baseline, more than "
                                              f"{FACTOR} x {largest / 1e6:.0f} MB + {SLACK / 1e6:.0f} MB", r)
    assert used < 0.4 * model, (f"{step}: {used / 1e6:.0f} MB above the baseline for a {model / 1e6:.0f} MB model", r)


def test_round_trip_is_bit_identical_and_rows_are_honest(rows):
    by_step, _ = rows
    assert by_step["compare"]["identical"] and by_step["compare"]["tensors"] == 24 * 9 + 3, by_step["compare"]
    for r in by_step.values():
        for key in ("device", "date", "git_commit", "wall_s", "peak_rss_bytes"):
            assert r[key], (key, r)
    for step in ("hf-to-megatron", "reshape", "megatron-to-hf"):
        r = by_step[step]
        assert r["bytes_read"] > 0.9 * r["model_bytes"] and r["bytes_written"] > 0.9 * r["model_bytes"], r
        assert r["pace_vs_copy"] > 0 and r["disk_copy_mb_per_s"] > 0, r


_RANK_PEAK = """
import json, resource, sys
from workbench.generation import generate
res = generate(sys.argv[1], prompt_ids=[[1, 2, 3, 4]], max_new_tokens=2, greedy=True, device="cpu",
               tp=int(sys.argv[2]), pp=int(sys.argv[3]))
print("RESULT " + json.dumps({"tokens": len(res[0].token_ids),
                              "children_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _rank_peak(ckpt: Path, tp: int, pp: int) -> int:
    """The largest peak RSS of any process of a ``generate`` run at TP x PP (a rank): ``RUSAGE_CHILDREN`` of a fresh
    process that runs it (torchrun and the supervisor wait for theirs, so the ranks' peaks reach it)."""
    proc = subprocess.run([sys.executable, "-c", _RANK_PEAK, str(ckpt), str(tp), str(pp)], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert got["tokens"] == 2, got
    return got["children_maxrss"]


def test_generation_ranks_load_their_own_shard(rows):
    """``generate --ckpt`` at TP=2 x PP=2 from the streamed checkpoint: each rank holds its quarter of the model, so
    the largest rank peaks at least half a model below the one rank of a TP=1 x PP=1 run (whatever both share:
    imports, the process group, the engine)."""
    by_step, work = rows
    model = by_step["hf-to-megatron"]["model_bytes"]
    one = _rank_peak(work / "tp1", 1, 1)
    four = _rank_peak(work / "tp2pp2", 2, 2)
    assert one - four >= 0.5 * model, (f"TP=1 x PP=1 rank {one / 1e6:.0f} MB, TP=2 x PP=2 rank {four / 1e6:.0f} MB, "
                                       f"model {model / 1e6:.0f} MB")
