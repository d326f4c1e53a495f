"""bench/train_throughput.py runs end to end (tiny config, CPU, 2 steps) and writes honest rows."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from tests.support import torchrun_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "train_throughput.py"


def test_cpu_smoke_writes_one_row_per_variant(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["reference/tiny", "workbench/tiny"]
    sys.path.insert(0, str(ROOT))
    from workbench.config import derive, preset

    cfg = preset("tiny")
    for r in rows:
        assert r["ok"], r
        for key in ("device", "date", "git_commit"):
            assert r[key], key
        assert r["steps_timed"] == 2 and r["step_s"] > 0 and r["warmup_steps"] >= 2
        assert r["measured"] == "protocol" and r["repeats"]["repeats"] == [r["tokens_per_s"]]  # the smoke: one repeat
        # FLOPs come from the config contract; throughput and MFU follow from the measured step time
        d = derive(cfg.replace(**{"train.global_batch_size": r["global_batch_size"]}))
        assert r["flops_per_step"] == d.flops_per_step
        assert math.isclose(r["tokens_per_s"], r["tokens_per_step"] / r["step_s"], rel_tol=1e-9)
        assert math.isclose(r["mfu"], r["flops_per_step"] / r["step_s"] / (r["peak_tflops"] * 1e12), rel_tol=1e-9)
        assert r["microbatches"] == 2 and r["tokens_per_step"] == 2 * cfg.train.micro_batch_size * cfg.model.seq_length
        # both sides train a freshly initialised model of the padded vocabulary: loss ~ ln(V)
        assert abs(r["first_loss"] - math.log(d.padded_vocab_size)) < 0.5, r["first_loss"]
    ref, wb = rows
    assert ref["ratio_to_reference"] == 1.0
    assert math.isclose(wb["ratio_to_reference"], wb["tokens_per_s"] / ref["tokens_per_s"])
    assert wb["ratio_to_reference_range"] == [wb["ratio_to_reference"]] * 2
    assert wb["kernel_path"]["schedule"] == "no pipelining"
    # where a repeat's wall time goes besides its steps; the GPUs were checked for strangers (none on CPU)
    assert 0 < wb["setup_s"] < wb["wall_s"] and 0 < wb["first_step_s"] < wb["wall_s"], wb
    assert wb["gpu_strangers"] == [] and wb["repeat_rows"][0]["gpu_strangers"] == []
    # the process ended after its result (the workbench side through the backend's teardown), within its wall time
    for r in rows:
        assert 0 <= r["exit_s"] < r["wall_s"] and r["repeat_rows"][0]["exit_s"] == r["exit_s"], r
        assert "exit_hung" not in r and "stacks" not in r and "result_at" not in r
    cost = wb["stream_cost"]
    # (each side's per-step time is a difference of two timed loops: its sign on a busy 2-core machine is noise, so
    # the test holds the loops and the arithmetic, not the timings; stop 83's CI saw step_s_bare at -0.05 s)
    assert cost["n"] == 3 and min(cost[k] for k in ("loop_s_n", "loop_s_2n", "bare_s_n", "bare_s_2n")) > 0, cost
    assert math.isclose(cost["step_s_loop_events_timing_every_step"], (cost["loop_s_2n"] - cost["loop_s_n"]) / 3)
    assert math.isclose(cost["step_s_bare"], (cost["bare_s_2n"] - cost["bare_s_n"]) / 3)
    assert "workbench/tiny" in proc.stdout and "tok/s" in proc.stdout  # the table


def test_a_process_that_does_not_end_after_its_result_is_cut_and_keeps_its_stacks(tmp_path):
    """A worker still running at ``--variant-timeout`` after writing its result (held there, as teardown hangs held
    two-GPU processes on H200s) is ended with its group: the row keeps its result, says the exit hung, and keeps
    each rank's stacks, dumped before the limit into a file of its own, the main thread's first."""
    import os

    out = tmp_path / "rows.jsonl"
    env = {**os.environ, "WORKBENCH_BENCH_HOLD_AFTER_RESULT_S": "120"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--variants", "reference/", "--variant-timeout", "25",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = [json.loads(l) for l in out.read_text().splitlines()]
    assert row["ok"] and row["tokens_per_s"] > 0 and row["exit_hung"] and row["repeat_rows"][0]["exit_hung"], row
    assert 0 < row["exit_s"] < row["wall_s"] and row["wall_s"] >= 25, row  # held from its result to the limit
    stacks = row["stacks"]["0"]  # one rank: the main thread first, innermost frame first, down to the worker
    assert stacks.startswith("Timeout (") and "most recent call first" in stacks.splitlines()[1], stacks[:2000]
    main = stacks.split("\nThread 0x")[1]  # after the "Timeout (...)!" line
    assert "train_throughput.py" in main and "in worker" in main, stacks


def test_the_exit_timer_ends_a_process_that_would_not_end(tmp_path):
    """_leave_later: a process whose exit would hang leaves with the code it was given once the timer runs out."""
    script = ("import sys, time; sys.path.insert(0, 'bench'); import train_throughput as tt; "
              "tt._leave_later(0.5, 7); time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr[-2000:]


def test_a_deadline_stops_before_a_repeat_that_would_end_past_it(tmp_path):
    """--deadline: the first repeat runs (nothing to estimate from); the next would end past the deadline by the first's
    wall time, so none starts: exit 3, the first repeat's row in the partial file, no final rows."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--deadline", "1", "--no-stream-cost", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "stopped before workbench/tiny repeat 1/1" in proc.stdout and "> --deadline 1 s" in proc.stdout, proc.stdout
    assert not out.exists()
    (row,) = [json.loads(l) for l in out.with_suffix(".partial.jsonl").read_text().splitlines()]
    assert row["variant"] == "reference/tiny" and row["ok"], row


def test_bad_arguments_exit_2_with_a_message(tmp_path):
    for args, needle in ((["--models", "gpt5"], "unknown model"), (["--cpu-smoke", "--variants", "nope"], "matches nothing"),
                         (["--cpu-smoke", "--steps", "0"], "--steps"), (["--cpu-smoke", "--deadline", "-1"], "--deadline"),
                         (["--cpu-smoke", "--deadline", "nan"], "--deadline")):
        proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "x.jsonl")], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr)
        assert needle in proc.stderr, (args, proc.stderr)


def test_planned_layouts_are_valid_configs_with_the_intended_layout():
    """Every variant the benchmark would launch on 2 GPUs is a valid RunConfig with its layout."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    from workbench.config import derive

    variants = tt.plan(["gpt2-small", "gpt2-medium"], gpus=2, have_te=False, microbatches=4)
    names = [v.name for v in variants]
    assert names[:6] == ["reference/gpt2-small", "workbench/gpt2-small", "workbench-nograph/gpt2-small",
                         "reference/gpt2-medium", "workbench/gpt2-medium", "workbench-nograph/gpt2-medium"]
    assert "workbench-te/gpt2-small" not in names  # only when Transformer Engine is importable
    expect = {  # name: (tp, pp, dp, micro-batches, micro-batch size)
        "workbench/gpt2-small": (1, 1, 1, 4, 16),
        "workbench/gpt2-medium": (1, 1, 1, 4, 8),
        "dp2/gpt2-medium": (1, 1, 2, 4, 8),
        "dp2-distopt/gpt2-small": (1, 1, 2, 4, 16),
        "tp2/gpt2-large": (2, 1, 1, 4, 8),
        "workbench/gpt2-large": (1, 1, 1, 4, 8),
        "pp2-m8/gpt2-medium": (1, 2, 1, 8, 8),
        "pp1-m8/gpt2-medium": (1, 1, 1, 8, 8),
        "tp2-nograph/gpt2-large": (2, 1, 1, 4, 8),
        "tp2-sp/gpt2-large": (2, 1, 1, 4, 8),
    }
    # CUDA graphs asked for by default, in the PP rows and their one-GPU baseline too (scaling is over the one-GPU
    # default path; the kernel rule keeps them off under pipelining and says why); off in the -nograph rows
    graphs = {n: tt.bench_config(v).train.cuda_graphs for n, v in {v.name: v for v in variants}.items()}
    assert graphs["workbench/gpt2-medium"] and graphs["tp2/gpt2-large"]
    assert graphs["pp1-m8/gpt2-medium"] and graphs["pp2-m8/gpt2-medium"] and graphs["pp2-vpp2-m8/gpt2-medium"]
    assert not graphs["workbench-nograph/gpt2-medium"] and not graphs["tp2-nograph/gpt2-large"]
    assert not graphs["pp2-m8-nograph/gpt2-medium"]
    by_name = {v.name: v for v in variants}
    assert {by_name[n].baseline for n in ("pp2-m8/gpt2-medium", "pp2-vpp2-m8/gpt2-medium")} == {"pp1-m8/gpt2-medium"}
    assert tt.bench_config(by_name["pp2-vpp2-m8/gpt2-medium"]).parallel.virtual_pipeline_parallel == 2
    # the TP rows differ only in SP, graphs, comm overlap, launch queues or the diagnostic bound
    for name, sp, overlap in (("tp2/gpt2-large", False, True), ("tp2-nograph/gpt2-large", False, True),
                              ("tp2-sp/gpt2-large", True, True), ("tp2-no-overlap/gpt2-large", False, False),
                              ("tp2-sp-no-overlap/gpt2-large", True, False), ("tp2-8queues/gpt2-large", False, True),
                              ("tp2-bound/gpt2-large", False, True), ("tp2-sp-bound/gpt2-large", True, True)):
        cfg = tt.bench_config(by_name[name])
        assert (cfg.parallel.sequence_parallel, cfg.parallel.tp_comm_overlap) == (sp, overlap), name
    assert by_name["tp2-8queues/gpt2-large"].env == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert [v.name for v in variants if v.bound] == ["tp2-bound/gpt2-large", "tp2-sp-bound/gpt2-large"]
    for name, (tp, pp, dp, micro, mbs) in expect.items():
        cfg = tt.bench_config(by_name[name])
        assert cfg.validate() == [], (name, cfg.validate())
        d = derive(cfg)
        assert (cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel, d.data_parallel, d.num_microbatches,
                cfg.train.micro_batch_size) == (tp, pp, dp, micro, mbs), name
        assert cfg.model.seq_length == 1024 and cfg.train.precision == "bf16"
    # every scaled row names a one-GPU baseline of the same model that is also planned
    for v in variants:
        if v.baseline:
            assert v.baseline in by_name and by_name[v.baseline].gpus == 1 and by_name[v.baseline].model == v.model
    assert by_name["dp2-distopt/gpt2-small"].overrides["parallel.overlap_param_gather"] is True


def test_fp8_rows_are_valid_configs_scaled_against_their_bf16_row(monkeypatch):
    """The torch-native FP8 rows (and TE's, where TE is importable) train the default row's config with train.fp8 set."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    from workbench import kernel_rule

    monkeypatch.setattr(kernel_rule, "te_available", lambda: True)  # the TE rows' configs as a TE machine validates them
    by_name = {v.name: v for v in tt.plan(["gpt2-medium", "llama3.2-1b"], gpus=1, have_te=True, microbatches=4)}
    for m in ("gpt2-medium", "llama3.2-1b"):
        base = tt.bench_config(by_name[f"workbench/{m}"])
        for name, recipe, impl, baseline in ((f"workbench-fp8-tensorwise/{m}", "tensorwise", "torch", f"workbench/{m}"),
                                             (f"workbench-fp8-rowwise/{m}", "rowwise", "torch", f"workbench/{m}"),
                                             (f"workbench-fp8-delayed/{m}", "delayed", "torch", f"workbench/{m}"),
                                             (f"workbench-te-fp8-tensorwise/{m}", "tensorwise", "te", f"workbench-te/{m}"),
                                             (f"workbench-te-fp8-delayed/{m}", "delayed", "te", f"workbench-te/{m}")):
            v = by_name[name]
            cfg = tt.bench_config(v)
            assert cfg.validate() == [], (name, cfg.validate())
            assert v.baseline == baseline and kernel_rule.choose(cfg).fp8_impl == impl and cfg.train.fp8 == recipe
            assert cfg.replace(**{"train.fp8": "off", "model.attention_backend": base.model.attention_backend}).to_dict() == base.to_dict()


def test_allreduce_probe_runs_over_two_ranks(tmp_path):
    """bench/allreduce_probe.py over gloo (--cpu): one all-reduce and one send/recv row, stamped."""
    out = tmp_path / "probe.jsonl"
    proc = subprocess.run([sys.executable, *torchrun_args(2),
                           str(ROOT / "bench" / "allreduce_probe.py"), "--cpu", "--iters", "3", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [(r["op"], r["mib"]) for r in rows] == [("all_reduce", 1), ("sendrecv", 1)]  # rank 0 writes, once
    for r in rows:
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] and r["git_commit"]
        factor = 2 * (2 - 1) / 2 if r["op"] == "all_reduce" else 1.0  # nccl-tests' bus bandwidth, n = 2
        assert r["ms"] > 0 and math.isclose(r["busbw_gbs"], factor * 2**20 / r["ms"] / 1e6)


def test_cpu_smoke_of_a_llama_model_runs_the_llama_reference(tmp_path):
    """--models llama3.2-1b under --cpu-smoke: the tiny preset in the Llama layout, against bench/reference_llama.py."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--models", "llama3.2-1b", "--no-stream-cost",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["reference/tiny-llama", "workbench/tiny-llama"]
    assert rows[0]["kernel_path"]["model"] == "ReferenceLlama"
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    from workbench.config import derive

    cfg = tt.bench_config(tt.Variant("workbench/tiny-llama", "workbench", "tiny-llama", microbatches=2), cpu_smoke=True)
    assert (cfg.model.position_embedding, cfg.model.activation, cfg.model.query_groups) == ("rope", "swiglu", 2)
    for r in rows:
        assert r["ok"], r
        assert r["flops_per_step"] == derive(cfg).flops_per_step
        assert abs(r["first_loss"] - math.log(derive(cfg).padded_vocab_size)) < 0.5, r["first_loss"]


def test_llama_rows_are_valid_configs_at_seq_2048():
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    from workbench.config import derive

    variants = {v.name: v for v in tt.plan(["llama3.2-1b", "llama3.2-3b"], gpus=1, have_te=False, microbatches=4)}
    for model, mbs in (("llama3.2-1b", 4), ("llama3.2-3b", 2)):
        for kind in ("reference", "workbench"):
            cfg = tt.bench_config(variants[f"{kind}/{model}"])
            assert cfg.validate() == [], cfg.validate()
            assert (cfg.model.seq_length, cfg.train.micro_batch_size, derive(cfg).num_microbatches) == (2048, mbs, 4)
            assert (cfg.model.num_query_groups, cfg.model.normalization, cfg.train.precision) == (8, "rmsnorm", "bf16")
    assert tt.bench_config(tt.Variant("workbench/gpt2-small", "workbench", "gpt2-small")).model.seq_length == 1024


def test_the_bound_makes_each_tp_collective_a_local_copy_of_its_shape(monkeypatch):
    """tp2-bound / tp2-sp-bound (a diagnostic): the compiled layer's all-reduce returns its input, SP's all-gather
    gives the gathered shape (this rank's shard repeated) and its reduce-scatter the scattered one, without a group."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    from workbench.backend import compiled_layer as cl

    for name in ("_all_reduce_sum", "_all_gather_seq", "_reduce_scatter_seq"):
        monkeypatch.setattr(cl, name, getattr(cl, name))  # the real collectives come back after the test
    tt._skip_tp_collectives(2)
    x = torch.arange(24.0).reshape(6, 2, 2)  # [sequence shard, batch, hidden]
    assert torch.equal(cl._all_reduce_sum(x, "no-group"), x)
    gathered = cl._all_gather_seq(x, "no-group")
    assert gathered.shape == (12, 2, 2) and torch.equal(gathered[:6], x) and torch.equal(gathered[6:], x)
    assert torch.equal(cl._reduce_scatter_seq(gathered, "no-group"), x)


def test_a_ranks_stacks_put_the_main_thread_first(tmp_path):
    """faulthandler writes the threads newest first, the main thread (the one a hang is about) last: _rank_stacks
    moves it to the front, so a cut keeps it."""
    import faulthandler
    import threading

    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput as tt

    stop = threading.Event()
    helpers = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
    for t in helpers:
        t.start()
    try:
        with open(tmp_path / "stacks-1.txt", "w") as fh:
            faulthandler.dump_traceback(file=fh, all_threads=True)
    finally:
        stop.set()
    (tmp_path / "stacks-0.txt").write_text("")  # a rank that dumped nothing is left out
    found = tt._rank_stacks(tmp_path)
    assert list(found) == ["1"]
    first = found["1"].split("\n\n")[0]
    assert first.startswith(("Current thread 0x", "Thread 0x")) and "test_a_ranks_stacks_put_the_main_thread_first" in first, found
    assert found["1"].count("Thread 0x") + found["1"].count("thread 0x") >= 4  # every thread kept
