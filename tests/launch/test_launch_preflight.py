"""What would certainly fail after the start is refused before anything starts (exit 2, the field and the fix):

- a CUDA config whose memory plan is over every accelerator (the dry run: the GPUs are not this machine's) or over
  this machine's GPU (``nvidia-smi``: a stand-in program on ``PATH`` reporting one small GPU, the hardware boundary);
  ``--ignore-memory-plan`` lets it through; CPU configs are not planned;
- a run directory, ``checkpoint.save_dir`` or ``data.cache_dir`` on a read-only file system (a read-only tmpfs), on
  a full one (a 1 MiB tmpfs) or naming a file, in the dry run and in the real launch (no bare ``OSError``).

Mounting needs root (CAP_SYS_ADMIN); those tests are skipped, with the reason, where ``mount`` is refused.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from workbench.config import preset

GiB = 1024**3


def _workbench(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=cwd or ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.fixture()
def tmpfs(tmp_path):
    """``make(name, options)``: a tmpfs mounted at ``tmp_path/name`` (unmounted after the test); skips where ``mount``
    is refused."""
    mounted = []

    def make(name: str, options: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", str(d)], capture_output=True)


def _big(tmp_path) -> tuple[Path, object]:
    cfg = preset("gpt2-small", **{"model.seq_length": 131072, "model.max_position_embeddings": 131072})
    assert cfg.validate() == [] and cfg.parallel.device == "cuda"
    f = tmp_path / "big.json"
    cfg.save(f)
    return f, cfg


def test_a_plan_over_every_accelerator_is_refused_by_the_dry_run_unless_told(tmp_path):
    from workbench.config_fields import LARGEST_ACCELERATOR_BYTES
    from workbench.planner import predict

    f, cfg = _big(tmp_path)
    worst = predict(cfg, suggest=False).worst.total
    assert worst > LARGEST_ACCELERATOR_BYTES  # the config's own plan says no device can hold it
    p = _workbench("launch", f, "--dry-run", "--run-dir", tmp_path / "run")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"memory: the memory plan puts pipeline stage 0's ranks at {worst / GiB:.1f} GiB" in p.stderr, p.stderr
    assert "over the most memory any accelerator has" in p.stderr and "--ignore-memory-plan" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    p = _workbench("launch", f, "--dry-run", "--run-dir", tmp_path / "run", "--ignore-memory-plan")
    assert p.returncode == 0 and "-m workbench.rank" in p.stdout, p.stdout + p.stderr


def _fake_nvidia_smi(bin_dir: Path, mib: int) -> None:
    """One GPU of ``mib`` MiB, as ``nvidia-smi -L`` and ``--query-gpu=index,memory.total`` report it."""
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text("#!/bin/sh\ncase \"$1\" in\n  -L) echo 'GPU 0: NVIDIA Test GPU (UUID: GPU-0)';;\n"
                   f"  --query-gpu=*) echo '0, {mib}';;\nesac\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_a_plan_over_this_machines_gpu_is_refused_at_launch_and_cpu_is_not_planned(tmp_path, monkeypatch):
    from workbench.launch import launch_checks
    from workbench.planner import predict

    cfg = preset("gpt2-small")
    worst = predict(cfg, suggest=False).worst.total
    mib = worst // 2 // 2**20  # a GPU with half the memory the plan needs
    _fake_nvidia_smi(tmp_path / "bin", mib)
    f = tmp_path / "gpt2.json"
    cfg.save(f)
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    p = _workbench("launch", f, "--run-dir", tmp_path / "run", env={"PATH": path, "CUDA_VISIBLE_DEVICES": "0"})
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"at {worst / GiB:.1f} GiB" in p.stderr and f"over this machine's GPU ({(mib << 20) / GiB:.1f} GiB)" in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written

    monkeypatch.setenv("PATH", path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [x.field for x in launch_checks(cfg, run_dir=tmp_path / "run")] == ["memory"]
    assert launch_checks(cfg, run_dir=tmp_path / "run", ignore_memory_plan=True) == []
    cpu = cfg.replace(**{"parallel.device": "cpu"})  # the same model, over the same (fake) GPU's memory
    assert launch_checks(cpu, run_dir=tmp_path / "run") == []  # CPU: no GPU memory to plan against


def _tiny(tmp_path, name="tiny.json", **over) -> Path:
    f = tmp_path / name
    preset("tiny", **{"parallel.nproc_per_node": 1, **over}).save(f)
    return f


def test_a_read_only_run_dir_save_dir_or_cache_dir_is_refused_before_anything_starts(tmp_path, tmpfs):
    ro = tmpfs("ro", "size=1m,ro")
    cases = [(("--run-dir", ro / "run"), {}, "run_dir"),
             (("--run-dir", tmp_path / "r2"), {"checkpoint.save_dir": str(ro / "ckpts")}, "checkpoint.save_dir"),
             (("--run-dir", tmp_path / "r3"), {"data.cache_dir": str(ro / "cache")}, "data.cache_dir")]
    for i, (args, over, field) in enumerate(cases):
        f = _tiny(tmp_path, f"c{i}.json", **over)
        for dry in (["--dry-run"], []):  # the real launch too: no process, no bare OSError
            p = _workbench("launch", f, *args, *dry)
            assert p.returncode == 2, (field, dry, p.stdout + p.stderr)
            assert f"{field}: " in p.stderr and f"{ro} is on a read-only file system" in p.stderr, p.stderr
            assert "Traceback" not in p.stderr and "OSError" not in p.stderr
        assert not Path(args[1]).exists()


def test_a_full_file_system_or_a_file_is_refused(tmp_path, tmpfs):
    small = tmpfs("small", "size=1m")
    p = _workbench("launch", _tiny(tmp_path, **{"checkpoint.save_dir": str(small / "ckpts")}), "--dry-run",
                   "--run-dir", tmp_path / "run")
    assert p.returncode == 2, p.stdout + p.stderr
    m = re.search(r"checkpoint\.save_dir: (\S+): (\d+) MiB free on its file system, one checkpoint needs about (\d+) MiB",
                  p.stderr)
    assert m and m.group(1) == str(small / "ckpts") and int(m.group(2)) < int(m.group(3)), p.stderr
    p = _workbench("launch", _tiny(tmp_path, "b.json"), "--dry-run", "--run-dir", small / "run")
    assert p.returncode == 2 and f"run_dir: {small / 'run'}: " in p.stderr and "MiB free" in p.stderr, p.stderr


def test_a_save_dir_or_cache_dir_naming_a_file_is_refused_by_the_dry_run(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for field in ("checkpoint.save_dir", "data.cache_dir"):
        p = _workbench("launch", _tiny(tmp_path, **{field: str(a_file)}), "--dry-run", "--run-dir", tmp_path / "run")
        assert p.returncode == 2 and f"{field}: {a_file} is a file, not a directory" in p.stderr, p.stdout + p.stderr
        p = _workbench("launch", _tiny(tmp_path, **{field: str(a_file / "sub")}), "--dry-run", "--run-dir", tmp_path / "run")
        assert p.returncode == 2 and f"{field}: {a_file / 'sub'} cannot be made: {a_file} is a file" in p.stderr, p.stderr
    assert a_file.read_text() == "mine"
