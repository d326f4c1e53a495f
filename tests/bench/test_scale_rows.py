"""The Llama-3.1-8B rows of bench/train_throughput.py (bench/scale_call.sh CALL=7-9): a model one GPU cannot hold,
so every two-GPU layout runs at one global batch beside torchtitan on the same two GPUs."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tt():
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    return tt


def test_8b_layouts_share_one_global_batch_and_are_judged_against_torchtitan():
    tt = _tt()
    from workbench.config import derive

    by_name = {v.name: v for v in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)}
    expect = {  # name: (tp, pp, dp, micro-batches a rank)
        "dp2-distopt/llama3.1-8b": (1, 1, 2, 4),
        "tp2-sp/llama3.1-8b": (2, 1, 1, 8),
        "pp2-m8/llama3.1-8b": (1, 2, 1, 8),
    }
    for name, (tp, pp, dp, micro) in expect.items():
        v = by_name[name]
        cfg = tt.bench_config(v)
        assert cfg.validate() == [], (name, cfg.validate())
        d = derive(cfg)
        assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, d.data_parallel, d.num_microbatches) == \
            (tp, pp, dp, micro), name
        assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.model.seq_length) == (8, 1, 2048), name
        assert v.baseline == "torchtitan/llama3.1-8b" and v.gpus == 2, name
    assert tt.bench_config(by_name["tp2-sp/llama3.1-8b"]).parallel.sequence_parallel
    titan = by_name["torchtitan/llama3.1-8b"]
    assert (titan.gpus, titan.baseline, tt.bench_config(titan).train.global_batch_size) == (2, None, 8)
    # no two-GPU row of the 8B is scaled over a one-GPU run (none could be measured) or named twice
    two = [v for v in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)
           if v.gpus == 2 and v.model == "llama3.1-8b"]
    assert len({v.name for v in two}) == len(two)
    assert all(by_name[v.baseline].gpus == 2 for v in two if v.baseline)


def test_8b_layouts_fit_an_h200_and_one_gpu_does_not_by_the_planner():
    tt = _tt()
    from workbench.planner import predict

    by_name = {v.name: v for v in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)}
    for name in ("dp2-distopt/llama3.1-8b", "tp2-sp/llama3.1-8b", "pp2-m8/llama3.1-8b"):
        assert predict(tt.bench_config(by_name[name]), "H200").fits, name
    assert not any(v.gpus == 1 for v in by_name.values() if v.model == "llama3.1-8b")  # none planned: none fits
    assert not predict(tt.bench_config(tt.Variant("workbench/llama3.1-8b", "workbench", "llama3.1-8b")), "H200").fits


def test_a_workbench_row_against_torchtitan_meets_its_target_only_on_its_worst_pairing_and_mfu():
    tt = _tt()
    v = {x.name: x for x in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)}
    row = lambda name, reps, mfu: {"variant": name, "ok": True, "repeats": {"repeats": reps}, "mfu": mfu}  # noqa: E731
    for reps, mfu, met in (([12.0, 12.1, 12.2], 0.50, True), ([12.0, 10.5, 12.2], 0.50, False),
                           ([12.0, 12.1, 12.2], 0.44, False)):
        rows = [row("torchtitan/llama3.1-8b", [10.0, 10.1, 10.2], 0.4), row("tp2-sp/llama3.1-8b", reps, mfu)]
        tt.add_scaling(rows, [v["torchtitan/llama3.1-8b"], v["tp2-sp/llama3.1-8b"]])
        assert rows[1]["meets_target"] is met, (reps, mfu)
        assert "torchtitan" in rows[1]["target"]


def test_the_offload_row_is_dp2_distopt_with_the_optimizer_on_the_host_and_fits_where_it_does_not():
    """CALL=14: the same DP=2 + distributed optimizer with optimizer CPU offload, scaled over it (its cost); by the
    planner it fits an 80 GB card where the layout without it does not (why the layout exists)."""
    tt = _tt()
    from workbench.planner import predict

    by_name = {v.name: v for v in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)}
    off, plain = by_name["dp2-distopt-offload/llama3.1-8b"], by_name["dp2-distopt/llama3.1-8b"]
    c_off, c_plain = tt.bench_config(off), tt.bench_config(plain)
    assert c_off.validate() == [] and off.baseline == plain.name and off.gpus == 2
    assert c_off.parallel.optimizer_cpu_offload == 1.0 and c_plain.parallel.optimizer_cpu_offload == 0.0
    assert c_off.replace(**{"parallel.optimizer_cpu_offload": 0.0}).to_dict() == c_plain.to_dict()
    assert predict(c_off, "H100-80GB").fits and not predict(c_plain, "H100-80GB").fits
    # 3B (one GPU's model too): the same pair, scaled over its DP=2 row (the host step's cost within one call)
    by_name = {v.name: v for v in tt.plan(["llama3.2-3b"], gpus=2, have_te=False, microbatches=4)}
    off, plain = by_name["dp2-distopt-offload/llama3.2-3b"], by_name["dp2-distopt/llama3.2-3b"]
    assert off.baseline == plain.name and tt.bench_config(off).replace(
        **{"parallel.optimizer_cpu_offload": 0.0}).to_dict() == tt.bench_config(plain).to_dict()


def test_a_variant_cut_by_its_timeout_keeps_its_slow_steps_times(monkeypatch):
    """The ranks' stacks dumped before the limit fill the log's tail: the row keeps the harness's progress lines from
    the whole log (how far the run got, what each slow step cost).  The process boundary (torchrun) is planted."""
    import argparse
    import subprocess

    tt = _tt()
    steps = [f"[harness] warm-up step {i}: {6 + i / 10:.2f} s" for i in range(1, 8)]
    stacks = "\n".join(f'  File "/x/y.py", line {i} in wait' for i in range(2000))  # far more than the tail keeps

    def timed_out(cmd, timeout, **kw):
        raise subprocess.TimeoutExpired(cmd, timeout, output="W1130 torchrun\n" + "\n".join(steps) + "\n",
                                        stderr="Thread 0x7f (most recent call first):\n" + stacks)

    monkeypatch.setattr(tt.harness, "run_group", timed_out)
    monkeypatch.setattr(tt.harness, "check_gpus", lambda name: [])
    v = {x.name: x for x in tt.plan(["llama3.2-3b"], gpus=2, have_te=False, microbatches=4)}["dp2-distopt-offload/llama3.2-3b"]
    res = tt._launch(v, argparse.Namespace(variant_timeout=200.0, cpu_smoke=False), [])
    assert not res["ok"] and res["error"] == "worker exited 124 without a result"
    assert res["log_tail"].startswith("timed out after 200.0s") and "warm-up step" not in res["log_tail"]
    assert res["progress"] == steps and res["gpu_strangers"] == []


def test_async_tp_rows_are_tp2_sp_with_async_tp_and_the_calls_name_planned_variants():
    """parallel.async_tp's rows (#50): at 3B beside TP=2 + SP without CUDA graphs (async TP runs none: its own
    effect) and beside the one-GPU default path (CALL=15 / 16); at 8B beside torchtitan (CALL=17).  Each validates
    and differs from its neighbour only where it says."""
    import re

    tt = _tt()
    three = {v.name: v for v in tt.plan(["llama3.2-3b"], gpus=2, have_te=False, microbatches=8)}
    eight = {v.name: v for v in tt.plan(["llama3.1-8b"], gpus=2, have_te=False, microbatches=4)}
    a3, g3 = (tt.bench_config(three[f"{n}/llama3.2-3b"]) for n in ("tp2-sp-async", "tp2-sp-nograph"))
    a8 = tt.bench_config(eight["tp2-sp-async/llama3.1-8b"])
    for cfg in (a3, g3, a8):
        assert cfg.validate() == [] and cfg.parallel.tensor_parallel == 2 and cfg.parallel.sequence_parallel
    assert a3.parallel.async_tp and a8.parallel.async_tp and not g3.parallel.async_tp and not g3.train.cuda_graphs
    assert eight["tp2-sp-async/llama3.1-8b"].baseline == "torchtitan/llama3.1-8b"
    script = (ROOT / "bench" / "scale_call.sh").read_text()
    calls = {"15": (["tp2-sp-nograph", "tp2-sp-async"], three, "llama3.2-3b"),
             "16": (["workbench", "tp2-sp-async"], three, "llama3.2-3b"),
             "17": (["tp2-sp-async", "torchtitan"], eight, "llama3.1-8b")}
    for call, (want, planned, model) in calls.items():
        line = next(x for x in script.splitlines() if x.strip().startswith(f"{call})"))
        assert re.search(r'names ([^)]*)\)', line).group(1).split() == want
        assert all(f"{n}/{model}" in planned for n in want) and "--steps" not in line
    assert '7|8|9|14|17) model="${MODEL:-llama3.1-8b}"' in script


def test_the_chunked_tp_row_is_tp2_sp_chunked_and_its_call_names_planned_variants():
    """parallel.tp_chunked's row (#50): TP=2 + SP with its GEMMs chunked beside TP=2 + SP at 3B (CALL=22); the config
    validates, differs from its neighbour only in the field, and gets the chunked kernel choice."""
    import re

    from workbench import kernel_rule

    tt = _tt()
    three = {v.name: v for v in tt.plan(["llama3.2-3b"], gpus=2, have_te=False, microbatches=8)}
    c, s = (tt.bench_config(three[f"{n}/llama3.2-3b"]) for n in ("tp2-sp-chunked", "tp2-sp"))
    assert c.validate() == [] and c.parallel.tp_chunked and not s.parallel.tp_chunked
    assert c.replace(**{"parallel.tp_chunked": False}) == s
    assert kernel_rule.choose(c, te=False).tp_overlap == "chunked"
    line = next(x for x in (ROOT / "bench" / "scale_call.sh").read_text().splitlines() if x.strip().startswith("22)"))
    assert re.search(r'names ([^)]*)\)', line).group(1).split() == ["tp2-sp-chunked", "tp2-sp"] and "--microbatches 8" in line
