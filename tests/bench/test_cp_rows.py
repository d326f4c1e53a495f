"""Context parallelism's rows of bench/train_throughput.py (bench/scale_call.sh CALL=10 to 13, #53): Llama-3.2-1B at
16k and 32k tokens, CP=2 on two GPUs against the one-GPU way at the same length (the recompute the planner says it
needs) and against torchtitan's CP=2, one global batch."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tt():
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    return tt


def _cp_rows(tt):
    return {v.name: v for v in tt.plan(["llama3.2-1b"], gpus=2, have_te=False, microbatches=4)
            if re.search(r"-(16k|32k)/", v.name)}


def test_cp_variants_share_the_length_and_batch_of_their_one_gpu_baseline():
    tt = _tt()
    from workbench.config import derive

    rows = _cp_rows(tt)
    assert set(rows) == {f"{n}-{L}/llama3.2-1b" for n in ("workbench", "cp2", "torchtitan-cp2") for L in ("16k", "32k")}
    for tag, seq in (("16k", 16384), ("32k", 32768)):
        base, cp2, titan = (rows[f"{n}-{tag}/llama3.2-1b"] for n in ("workbench", "cp2", "torchtitan-cp2"))
        assert base.gpus == 1 and base.baseline is None and base.kind == "workbench"
        assert cp2.gpus == titan.gpus == 2 and cp2.baseline == titan.baseline == base.name
        assert cp2.kind == "workbench" and titan.kind == "torchtitan"
        assert cp2.overrides["parallel.context_parallel"] == titan.overrides["parallel.context_parallel"] == 2
        cfgs = [tt.bench_config(v) for v in (base, cp2, titan)]
        for c in cfgs:
            assert c.validate() == [] and c.model.seq_length == seq and c.train.micro_batch_size == 1
            assert derive(c).tokens_per_step == tt.CP_TOKENS  # the same global batch on every side
        assert [c.parallel.context_parallel for c in cfgs] == [1, 2, 2]
        assert derive(cfgs[1]).data_parallel == 1 and derive(cfgs[1]).num_microbatches == tt.CP_TOKENS // seq


def test_the_baseline_takes_the_recompute_the_planner_says_it_needs(monkeypatch):
    tt = _tt()
    from workbench import planner

    rows = _cp_rows(tt)
    for tag, seq in (("16k", 16384), ("32k", 32768)):
        mode = rows[f"workbench-{tag}/llama3.2-1b"].overrides["parallel.recompute"]
        assert mode == tt.cp_one_gpu_recompute("llama3.2-1b", seq)
        # the planner's word: the first mode that fits the GPU (none fits at 32k and 16k on an H200)
        fits = planner.predict(tt.bench_config(rows[f"workbench-{tag}/llama3.2-1b"]), tt.CP_GPU, suggest=False).fits
        assert fits and mode == "none"
    # on a GPU where only full recompute fits, the baseline takes it; where nothing fits, full (the row shows the OOM)
    real = planner.predict

    class _Fits:
        def __init__(self, fits):
            self.fits = fits

    monkeypatch.setattr(planner, "predict", lambda cfg, gpu, suggest=False: _Fits(cfg.parallel.recompute == "full"))
    assert tt.cp_one_gpu_recompute("llama3.2-1b", 32768) == "full"
    monkeypatch.setattr(planner, "predict", lambda cfg, gpu, suggest=False: _Fits(cfg.parallel.recompute != "none"))
    assert tt.cp_one_gpu_recompute("llama3.2-1b", 32768) == "selective"
    monkeypatch.setattr(planner, "predict", real)
    # a GPU that holds less: an 80 GB H100 at 32k needs recompute by the planner
    assert tt.cp_one_gpu_recompute("llama3.2-1b", 65536, gpu="H100-80GB") in ("selective", "full")


def test_cp_rows_record_cp_and_recompute_and_scale_against_the_one_gpu_way():
    tt = _tt()
    rows = _cp_rows(tt)
    base, cp2 = rows["workbench-16k/llama3.2-1b"], rows["cp2-16k/llama3.2-1b"]
    res = {"ok": True, "step_times": [0.5, 0.5, 0.5], "mem_peak": 2**30}
    r_cp = tt.summarise(cp2, res, tt.bench_config(cp2), 989.0, 2)
    assert (r_cp["cp"], r_cp["dp"], r_cp["tp"], r_cp["recompute"], r_cp["seq_length"]) == (2, 1, 1, "none", 16384)
    assert r_cp["tokens_per_s"] == tt.CP_TOKENS / 0.5
    r_base = tt.summarise(base, {**res, "step_times": [0.9, 0.9, 0.9]}, tt.bench_config(base), 989.0, 2)
    assert r_base["cp"] == 1
    merged = [{**r, "repeats": {"repeats": [r["tokens_per_s"]] * 3}} for r in (r_base, r_cp)]
    tt.add_scaling(merged, [base, cp2])
    assert abs(merged[1]["scaling"] - 0.9 / 0.5) < 1e-9


def test_the_torchtitan_cp_row_asks_torchtitan_for_cp2(monkeypatch):
    """run_variant turns the config's parallel.context_parallel into torchtitan's context_parallel_degree (Options.cp)
    (torchtitan itself is not imported here: its train() is replaced)."""
    tt = _tt()
    import argparse

    import reference_torchtitan as rt

    seen = {}
    monkeypatch.setattr(rt, "train", lambda cfg, opts, measure, **kw: seen.update(cfg=cfg, opts=opts) or {"ok": True})
    a = argparse.Namespace(cpu_smoke=False, no_compile_reference=False, steps=10, repeats=1, warmup=5, warmup_max=60)
    rt.run_variant(_cp_rows(tt)["torchtitan-cp2-32k/llama3.2-1b"], a)
    assert seen["opts"].cp == 2 and seen["opts"].ac == "none" and seen["cfg"].model.seq_length == 32768
    rt.run_variant(tt.Variant("torchtitan/llama3.2-1b", "torchtitan", "llama3.2-1b", gpus=2), a)
    assert seen["opts"].cp == 1


def test_scale_calls_10_to_13_name_planned_variants_and_keep_the_protocol():
    """CALL=10 / 11: the one-GPU way beside CP=2 (the scaling row); CALL=12 / 13: CP=2 beside torchtitan's CP=2
    (cp2's yardstick row).  No call lowers the protocol's timed steps (>= 20: bench/harness.Protocol)."""
    tt = _tt()
    script = (ROOT / "bench" / "scale_call.sh").read_text()
    planned = {v.name: v for v in tt.plan(["llama3.2-1b"], gpus=2, have_te=False, microbatches=4)}
    calls = {"10": ["workbench-16k", "cp2-16k"], "11": ["workbench-32k", "cp2-32k"],
             "12": ["cp2-16k", "torchtitan-cp2-16k"], "13": ["cp2-32k", "torchtitan-cp2-32k"]}
    for call, want in calls.items():
        line = next(x for x in script.splitlines() if x.strip().startswith(f"{call})"))
        names = re.search(r'names ([^)]*)\)', line).group(1).split()
        assert names == want
        assert all(f"{n}/llama3.2-1b" in planned for n in names)
        assert "--steps" not in line
    assert '10|11|12|13|23) model="${MODEL:-llama3.2-1b}"' in script
    # CALL=23: TE's CP beside the ring in one call, with TE carried (WITH_TE=1); the TE row exists only where TE is
    with_te = {v.name for v in tt.plan(["llama3.2-1b"], gpus=2, have_te=True, microbatches=4)}
    line = next(x for x in script.splitlines() if x.strip().startswith("23)"))
    assert re.search(r'names ([^)]*)\)', line).group(1).split() == ["cp2-32k", "cp2-te-32k"]
    assert {"cp2-32k/llama3.2-1b", "cp2-te-32k/llama3.2-1b"} <= with_te and "cp2-te-32k/llama3.2-1b" not in planned
    assert re.search(r'case "\$call" in [0-9|]*\b23\) export WITH_TE=1', script)
    for tag in ("16k", "32k"):
        cp2 = planned[f"cp2-{tag}/llama3.2-1b"]
        assert cp2.baseline == f"workbench-{tag}/llama3.2-1b" and cp2.reference == f"torchtitan-cp2-{tag}/llama3.2-1b"


def test_a_row_is_compared_with_its_named_yardstick(capsys):
    """print_table's "vs ref" reads the variant's own yardstick row (cp2 -> torchtitan's CP=2), with its range."""
    tt = _tt()

    def row(name, tps, ref=None):
        return {"variant": name, "model": "llama3.2-1b", "gpus": 2, "ok": True, "tokens_per_s": tps, "mfu": 0.5,
                "mem_peak_gib": 1.0, "reference_variant": ref,
                "repeats": {"repeats": [tps * 0.99, tps, tps * 1.01], "median": tps, "spread": 0.02}}

    rows = [row("torchtitan-cp2-32k/llama3.2-1b", 100.0), row("cp2-32k/llama3.2-1b", 150.0, "torchtitan-cp2-32k/llama3.2-1b")]
    tt.print_table(rows)
    assert rows[1]["ratio_to_reference"] == pytest.approx(1.5)
    worst, best = rows[1]["ratio_to_reference_range"]
    assert worst == pytest.approx(0.99 * 150 / (1.01 * 100)) and best == pytest.approx(1.01 * 150 / (0.99 * 100))
    assert rows[0]["ratio_to_reference"] is None
