"""`workbench plan` explains itself: the GPU it checks against (or that none was named), a CPU run's host memory,
where CUDA graphs put the activations, and what selective recompute means -- each only where it applies."""

from __future__ import annotations

import pytest

from workbench.cli import main
from workbench.config import preset
from workbench.planner import PlannerAssumptions, format_plan, predict

NO_TE = PlannerAssumptions(transformer_engine=False)  # the workbench's own layers, whatever this machine has


def plan_out(tmp_path, capsys, name: str, *args: str, **overrides) -> str:
    path = preset(name, **overrides).save(tmp_path / f"{name}.yaml")
    assert main(["plan", str(path), *args]) == 0
    return capsys.readouterr().out


def test_without_a_gpu_it_says_how_to_name_one(tmp_path, capsys):
    out = plan_out(tmp_path, capsys, "gpt2-medium")
    assert "no GPU named: pass --gpu H100-80GB|H200-141GB to check fit" in out
    assert "checked against GPU" not in out


def test_with_a_gpu_it_names_the_gpu_it_checks_against(tmp_path, capsys):
    out = plan_out(tmp_path, capsys, "gpt2-medium", "--gpu", "h200")
    assert "checked against GPU H200-141GB: 140.4 GiB per rank" in out
    assert "no GPU named" not in out and "fits: yes" in out


def test_a_cpu_config_is_host_memory_without_the_cuda_context_line(tmp_path, capsys):
    out = plan_out(tmp_path, capsys, "tiny")
    assert "parallel.device cpu: these are host memory (RAM) bytes per rank process" in out
    assert "reserved (decides fits, with CUDA context + NCCL)" not in out
    assert "no GPU named" not in out  # nothing to fit on a GPU
    gpu = plan_out(tmp_path, capsys, "gpt2-small")
    assert "reserved (decides fits, with CUDA context + NCCL)" in gpu and "host memory" not in gpu


def test_cuda_graphs_footnote_only_under_cuda_graphs():
    trees = PlannerAssumptions(transformer_engine=False, step_graph=False)  # the layers graphed one by one
    graphed = predict(preset("gpt2-medium"), gpu="H100", assumptions=trees)
    assert graphed.kernel_path.cuda_graphs and graphed.worst.reserved_terms.get("cuda_graph_pool")
    text = format_plan(graphed)
    assert "CUDA graphs:" in text and "graph pool holds the" in text and "~0" in text
    step = predict(preset("gpt2-medium"), gpu="H100", assumptions=NO_TE)
    assert step.kernel_path.cuda_graphs_impl == "step"
    assert "CUDA graphs (the step as one graph): the allocated peak is the last eager warm-up step" in format_plan(step)
    eager = predict(preset("gpt2-medium", **{"train.cuda_graphs": False}), gpu="H100", assumptions=NO_TE)
    assert not eager.kernel_path.cuda_graphs
    assert "CUDA graphs" not in format_plan(eager)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_selective_recompute_explained_only_when_selective(recompute):
    text = format_plan(predict(preset("gpt2-small", **{"parallel.recompute": recompute}), assumptions=NO_TE))
    line = [ln for ln in text.splitlines() if ln.startswith("selective recompute here means: ")]
    if recompute == "selective":
        assert line == ["selective recompute here means: the MLP's fc1 output and activation are rebuilt in backward, "
                        "not kept (the workbench's layers)"]
    else:
        assert "selective recompute" not in text
