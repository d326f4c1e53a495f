"""`workbench advise` / `advise()`: sorted rows, the planner's fits, refusals with the field (exit 2);
`workbench calibrate --cpu`: the measuring ranks under torchrun write a profile that loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.advisor import advise, format_advice
from workbench.advisor.profile import load_profile
from workbench.cli import main
from workbench.config import ConfigError, preset
from workbench.planner import predict

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, name="gpt2-medium", **over):
    cfg = preset(name, **over)
    return str(cfg.save(tmp_path / f"{name}.json"))


def test_advise_sorts_by_speed_and_asks_the_planner(tmp_path, capsys):
    path = _cfg(tmp_path)
    # --fp8: the FP8 recipes too (opt-in for GPT-2 medium: its rows measured FP8 slower than bf16), 756 layouts
    assert main(["advise", path, "--gpus", "2", "--gpu", "H200", "--json", "--top", "5", "--fp8"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert out["valid_layouts"] > 500 and out["gpu"] == "H200-141GB"
    speeds = [r["tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert [r["rank"] for r in rows if r["fits"]] == list(range(1, 6))
    cfg = preset("gpt2-medium")
    for r in rows:
        plan = predict(cfg.replace(**r["overrides"]), "H200-141GB", suggest=False)
        assert r["fits"] == plan.fits and r["memory_gib"] == pytest.approx(plan.worst.total / 2**30)
        assert sum(r["breakdown_s"].values()) == pytest.approx(r["step_s"])
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2)


def test_advise_marks_oom_layouts_faster_than_the_pick():
    cfg = preset("llama3.2-3b", **{"train.global_batch_size": 16})
    adv = advise(cfg, 2, gpu="H100-80GB", top=3)
    assert adv.best is not None and adv.best.fits
    before = adv.rows[:adv.rows.index(adv.best)]  # evaluated in order of speed: what comes first is faster and OOM
    assert before and all(r.fits is False and r.prediction.tokens_per_s >= adv.best.prediction.tokens_per_s for r in before)
    assert all(r.memory_gib > 80 for r in adv.rows if r.fits is False)
    text = format_advice(adv, 3)
    assert "do not fit (OOM" in text and text.splitlines()[-1].startswith("pick: ")


def test_advise_all_layouts_evaluated_with_top_none():
    cfg = preset("gpt2-small", **{"train.global_batch_size": 16})
    adv = advise(cfg, 1, top=None)
    assert len(adv.rows) == adv.valid_layouts == adv.memory_evaluated
    assert all(r.fits is not None for r in adv.rows)


@pytest.mark.parametrize("args, field", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "8", "--nodes", "3"], "--nodes"),
    (["--gpus", "2", "--gpu", "B300"], "--gpu"),
    (["--gpus", "2", "--gpu", "A100-80GB"], "--gpu"),  # no shipped profile: the fix names calibrate
    (["--gpus", "2", "--top", "0"], "--top"),
])
def test_bad_arguments_exit_2_with_the_field(tmp_path, capsys, args, field):
    path = _cfg(tmp_path)
    assert main(["advise", path, *args]) == 2
    err = capsys.readouterr().err
    assert field in err and "->" in err


def test_bad_config_exits_2_before_anything(tmp_path, capsys):
    path = _cfg(tmp_path, **{"model.num_attention_heads": 7})
    assert main(["advise", path, "--gpus", "2"]) == 2
    assert "model.hidden_size" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        advise(preset("gpt2-medium", **{"train.lr": -1.0}), 2)


def test_bad_profile_exits_2_with_the_field(tmp_path, capsys):
    path = _cfg(tmp_path)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"schema": "workbench.advisor.profile/1", "device": "x"}))
    assert main(["advise", path, "--gpus", "2", "--profile", str(prof)]) == 2
    assert "invalid profile" in capsys.readouterr().err


def test_no_layout_fits_exits_1(tmp_path, capsys):
    # 64 layers (~15B parameters): its bf16 weights and fp32 gradients alone (90 GB) outgrow one H100, offload or not
    path = _cfg(tmp_path, "llama3.1-8b", **{"train.global_batch_size": 4, "model.num_layers": 64})
    assert main(["advise", path, "--gpus", "1", "--gpu", "24GiB"]) == 2  # no shipped profile for a custom capacity
    assert main(["advise", path, "--gpus", "1", "--gpu", "H100-80GB", "--top", "1"]) == 1
    assert "no layout fits" in capsys.readouterr().err


def test_calibrate_cpu_writes_a_profile_that_loads(tmp_path):
    path = _cfg(tmp_path, "tiny")
    out = tmp_path / "cal.json"
    env_py = {"PYTHONPATH": str(ROOT)}
    import os

    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", path, "--cpu", "--nproc", "2", "--iters", "2",
                           "--out", str(out), "--gpu", "H100-80GB", "--timeout", "300"],
                          capture_output=True, text=True, timeout=400, env={**os.environ, **env_py}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    prof = load_profile(out)
    assert prof.device == "cpu" and "workbench calibrate" in prof.gemm_tflops[0].source
    assert len(prof.gemm_tflops) == 3  # TP 1, 2, 4 divide tiny's 4 heads
    assert all("over 2 ranks" in p.source for p in prof.collectives["all_reduce"])
    assert prof.host_us_per_layer["compiled"].source.startswith("from the shipped")
    assert main(["advise", path, "--gpus", "2", "--profile", str(out)]) == 0


@pytest.mark.parametrize("name", ["moe-research", "mixtral-8x7b"])
def test_an_moe_config_is_refused_with_model_moe_and_plan_as_the_way(tmp_path, capsys, name):
    """The advisor models no experts or expert parallelism: an MoE config exits 2 naming ``model.moe`` and
    ``workbench plan``, and advise() raises the same problem (what the widget shows) instead of ranking layouts."""
    path = _cfg(tmp_path, name)
    assert main(["advise", path, "--gpus", "8", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "model.moe" in out.err and "workbench plan" in out.err and "expert" in out.err
    with pytest.raises(ConfigError) as e:
        advise(preset(name), 8)
    assert [p.field for p in e.value.problems] == ["model.moe"]
    assert main(["advise", _cfg(tmp_path, name, **{"model.moe.num_experts": 0}), "--gpus", "8", "--top", "1"]) in (0, 1)


@pytest.mark.parametrize("args, flag", [
    (["--iters", "0"], "--iters 0"),
    (["--iters", "-3"], "--iters -3"),
    (["--timeout", "0"], "--timeout 0"),
    (["--timeout", "-5"], "--timeout -5"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--timeout", "inf"], "--timeout inf"),
    (["--nproc", "0"], "--nproc 0"),
])
def test_calibrate_bad_numbers_exit_2_before_anything_starts(tmp_path, capsys, args, flag):
    """Checked before the config is even read (a missing file would be exit 2 for another reason) and before any
    process starts: nothing is written, no supervisor or rank runs."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(tmp_path / "no-such-config.json"), "--cpu", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert flag in err and "->" in err and "no-such-config" not in err
    assert not out.exists()


def test_calibrate_ranks_that_overrun_the_timeout_are_stopped_without_a_traceback(tmp_path):
    """Ranks still measuring at ``--timeout`` (a huge ``--iters``): exit 1 with the flag and the fix, no traceback, no
    profile, and no process of the calibration left anywhere (its temporary directory is under ``tmp_path``)."""
    import os
    import time

    import psutil

    path = _cfg(tmp_path, "tiny")
    out = tmp_path / "cal.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(scratch)}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "calibrate", path, "--cpu", "--nproc", "2",
                           "--iters", "100000000", "--out", str(out), "--gpu", "H100-80GB", "--timeout", "20"],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    took = time.time() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "--timeout 20" in proc.stderr and "->" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and took < 120

    def leftovers():
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if str(scratch) in " ".join(p.info["cmdline"] or []):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    assert not leftovers(), [" ".join(p.cmdline()) for p in leftovers()]
    assert not list(scratch.glob("wb-calibrate-*"))  # its temporary run directory was cleaned up too
