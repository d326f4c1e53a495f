"""The README's "A first multi-GPU run" runs as written.

The commands and the Python snippet are read from README.md itself (the fenced blocks of that section), never
copied here, so a renamed command, option, field or preset in the README fails this file:

- the GPU block (``gpt2-medium``) runs on any machine up to the launch's own checks: ``config preset``, the ``sed``
  edit and ``plan --gpu`` as written, ``launch`` with ``--dry-run`` added (every check but this machine's GPUs); the
  plan's verdict the prose quotes must be what ``plan`` prints;
- the CPU block (``tiny``) and the Python snippet run as written: two real megatron-core processes under gloo each,
  both launches at the same time; the steps the README shows must be what the run prints (loss within 0.01);
- the "did you mean" the README quotes is what ``preset("tiny", tensor_parallel=2)`` raises.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## A first multi-GPU run"
BLOCK_RE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def section(text: str | None = None) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8") if text is None else text
    assert HEADING in text, f"README.md has no section {HEADING!r}"
    body = text.split(HEADING, 1)[1]
    return body.split("\n## ", 1)[0]


def blocks(lang: str, containing: str) -> list[str]:
    return [body for kind, body in BLOCK_RE.findall(section()) if kind == lang and containing in body]


def one_block(lang: str, containing: str) -> str:
    found = blocks(lang, containing)
    assert len(found) == 1, f"README {HEADING!r}: {len(found)} ```{lang} blocks naming {containing!r} (want 1)"
    return found[0]


def expected_output() -> str:
    """The untagged block after the CPU commands: what `workbench launch` prints."""
    found = blocks("", "run directory:")
    assert len(found) == 1, f"README {HEADING!r}: no single output block with 'run directory:'"
    return found[0]


def line_pattern(line: str) -> str:
    """A regex for one line of a shown output: ``...`` any text, ``<name>`` one word, a loss any number (the
    numbers are compared with a tolerance on their own)."""
    parts = re.split(r"(\.\.\.|<[^>]*>|(?<=loss )[\d.]+)", line)
    return "".join(re.escape(p) if i % 2 == 0 else ".*" if p == "..." else r"\S+" if p.startswith("<") else r"[\d.]+"
                   for i, p in enumerate(parts))


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the `workbench` console script
    env.pop("WORKBENCH_RUNS", None)  # runs/ under the working directory, as the README says
    env["PYTHONUNBUFFERED"] = "1"
    return env


def bash(script: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=environment(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, what: str, seconds: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {seconds} s\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{out[-6000:]}"
    return out


def test_section_holds_gpu_cpu_and_python_variants():
    gpu, cpu, py = one_block("bash", "gpt2-medium"), one_block("bash", "preset tiny"), one_block("python", "Run.launch")
    for block in (gpu, cpu):
        assert re.search(r"^workbench config preset \S+ --yaml > \S+\.yaml", block, re.M), block
        assert re.search(r"^workbench plan ", block, re.M) and re.search(r"^workbench launch ", block, re.M), block
    assert "--gpu" in gpu and "--gpu" not in cpu
    assert '"parallel.tensor_parallel": 2' in py and ".replace(" in py
    expected_output()


def test_quoted_did_you_mean_is_what_preset_says():
    from workbench.config import ConfigError, preset

    quoted = re.search(r"`(preset\(\"tiny\", tensor_parallel=2\))` is refused:\s+`([^`]+)`", section())
    assert quoted, "the README no longer quotes what an undotted field says"
    with pytest.raises(ConfigError) as e:
        eval(quoted.group(1), {"preset": preset})
    assert quoted.group(2) in str(e.value)
    keyword = re.search(r"as a keyword: `(\w+)__(\w+)=(\d+)`", section())
    assert keyword, "the README no longer shows the keyword form of a dotted key"
    section_name, name, value = keyword.groups()
    cfg = preset("tiny", **{f"{section_name}__{name}": int(value)})
    assert getattr(getattr(cfg, section_name), name) == int(value)


def test_gpu_commands_run_up_to_the_launch_checks(tmp_path):
    script = one_block("bash", "gpt2-medium")
    launch = re.findall(r"^(workbench launch \S+)(.*)$", script, re.M)
    assert len(launch) == 1, script
    dry = script.replace("".join(launch[0]), f"{launch[0][0]} --dry-run{launch[0][1]}")
    out = finish(bash(dry, tmp_path), "the README's GPU commands (launch --dry-run)", 120)
    yaml_text = next(tmp_path.glob("*.yaml")).read_text()
    assert re.search(r"^  tensor_parallel: 2$", yaml_text, re.M) and re.search(r"^  nproc_per_node: 2$", yaml_text, re.M)
    prose = section().split("```", 3)[2]  # the paragraph after the GPU block: what `plan` prints
    verdict = re.search(r"`(fits: yes; largest\s+micro-batch that fits: \d+)`", prose)
    assert verdict, prose
    assert " ".join(verdict.group(1).split()) in out, out
    total = re.search(r"`total` ([\d.]+) and `fits` yes on both", prose)
    assert total, prose
    for rank in (0, 1):
        assert re.search(rf"^\s+{rank}\s.*\s{re.escape(total.group(1))}\s+yes$", out, re.M), out
    assert "--nproc-per-node 2" in out and "torchrun" in out


def assert_tp2(run_dir: Path) -> None:
    """The run trained what the README says: TP=2 on two CPU processes."""
    parallel = json.loads((run_dir / "config.json").read_text())["parallel"]
    assert (parallel["tensor_parallel"], parallel["nproc_per_node"], parallel["device"]) == (2, 2, "cpu"), parallel


@pytest.mark.slow
def test_cpu_commands_and_python_snippet_train_on_two_processes(tmp_path):
    (tmp_path / "cli").mkdir()
    (tmp_path / "py").mkdir()
    cli = bash(one_block("bash", "preset tiny"), tmp_path / "cli")
    py = subprocess.Popen([sys.executable, "-c", one_block("python", "Run.launch")], cwd=tmp_path / "py",
                          env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cli_out = finish(cli, "the README's CPU commands")
    py_out = finish(py, "the README's Python snippet")

    # the CLI: every line the README shows ("..." and "<...>" stand for any text), with the same losses
    expected = expected_output()
    lines = cli_out.splitlines()
    for line in expected.splitlines():
        if line.strip() in ("", "..."):
            continue
        pattern = line_pattern(line)
        assert any(re.fullmatch(pattern, got) for got in lines), (line, pattern, cli_out[-3000:])
    shown = dict(re.findall(r"^iteration (\d+): loss ([\d.]+)$", expected, re.M))
    got = dict(re.findall(r"^iteration (\d+): loss ([\d.]+)$", cli_out, re.M))
    assert shown and set(shown) <= set(got), (shown, got)
    assert all(abs(float(got[i]) - float(v)) < 0.01 for i, v in shown.items()), (shown, got)
    runs = list((tmp_path / "cli" / "runs").glob("tiny-*"))
    assert len(runs) == 1 and len(list((runs[0] / "events").glob("rank-*.jsonl"))) == 2, runs
    assert_tp2(runs[0])

    # Python: the plan it prints and the run's end
    assert "fits: yes" in py_out and py_out.rstrip().splitlines()[-1] == "finished", py_out[-3000:]
    runs = list((tmp_path / "py" / "runs").glob("tiny-*"))
    assert len(runs) == 1, runs
    assert_tp2(runs[0])
    steps = [line for line in (runs[0] / "events" / "rank-0.jsonl").read_text().splitlines() if '"event": "step"' in line]
    assert len(steps) == 20, len(steps)
