"""The kernel rule's decisions (workbench.kernel_rule), Transformer Engine's health probe and its guard.

What the backend really builds for each decision is checked in tests/backend/test_kernel_rule.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from workbench import kernel_rule
from workbench.config import preset
from tests.support import ROOT

GPU = preset("gpt2-small")  # cuda, compile_kernels and cuda_graphs on


def test_auto_prefers_the_compiled_layer_even_with_transformer_engine():
    for te in (False, True):
        k = kernel_rule.choose(GPU, te=te)
        assert (k.attention, k.layer, k.cuda_graphs, k.optimizer) == ("sdpa", "compiled", True, "fused")
    # a Llama layout (RoPE, RMSNorm, SwiGLU, GQA) is the compiled layer's too
    llama = preset("llama-small")
    assert (kernel_rule.choose(llama, te=True).layer, kernel_rule.choose(llama, te=True).attention) == ("compiled", "sdpa")
    # where the compiled layer does not apply: TE's layer replayed as megatron's CUDA graphs when TE is usable
    # (measured faster than megatron's stock SDPA layer), else the stock SDPA layer (faster than TE's ungraphed)
    drop = llama.replace(**{"data.reset_attention_mask": True})  # per-document masks
    graphed = kernel_rule.choose(drop, te=True)
    assert (graphed.attention, graphed.layer, graphed.cuda_graphs_impl) == ("te", "stock", "megatron")
    assert (kernel_rule.choose(drop, te=False).attention, kernel_rule.choose(drop, te=False).layer) == ("sdpa", "stock")
    eager = GPU.replace(**{"train.compile_kernels": False})
    assert kernel_rule.choose(eager, te=True).cuda_graphs_impl == "megatron"
    for ungraphed in (drop.replace(**{"train.cuda_graphs": False}), drop.replace(**{"parallel.recompute": "selective"}),
                      drop.replace(**{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2})):
        assert kernel_rule.choose(ungraphed, te=True).attention == "sdpa"
    # the rule and its evidence agree
    assert all(r < 1.0 for r in kernel_rule.AUTO_EVIDENCE["ungraphed"].values())
    assert all(r > 1.0 for r in kernel_rule.AUTO_EVIDENCE["graphed"].values())
    # FP8 there: only TE's layer runs it, graphed or not
    fp8 = drop.replace(**{"train.fp8": "delayed", "train.cuda_graphs": False})
    assert kernel_rule.choose(fp8, te=True).attention == "te"
    assert kernel_rule.choose(fp8, te=False).attention == "sdpa"  # fp8_problems refuses it
    # GPT's per-document masks arrive per call and replace causality: megatron's layer, and the rule says so
    docs = kernel_rule.choose(GPU.replace(**{"data.reset_attention_mask": True}), te=False)
    assert (docs.layer, docs.layer_reason) == ("stock", "per-document attention mask (data.reset_attention_mask)")
    alibi = GPU.replace(**{"model.position_embedding": "alibi"})
    assert kernel_rule.choose(alibi, te=True).attention == "sdpa"  # TE has no ALiBi
    assert kernel_rule.choose(GPU.replace(**{"parallel.device": "cpu"}), te=True).attention == "sdpa"  # TE is GPU-only


def test_sdpa_puts_cudnn_first_only_where_transformer_engine_is_usable():
    """TE's core library loads the system's cuDNN; torch then stops preferring cuDNN's SDPA (bench/README)."""
    assert kernel_rule.choose(GPU, te=True).sdpa_order == kernel_rule.SDPA_CUDNN_FIRST
    assert kernel_rule.choose(GPU, te=False).sdpa_order == ()
    assert kernel_rule.choose(GPU.replace(**{"parallel.device": "cpu"}), te=True).sdpa_order == ()
    assert kernel_rule.choose(GPU.replace(**{"model.attention_backend": "te"}), te=True).sdpa_order == ()  # TE's attention
    # torch trusts cuDNN's SDPA below 9.15.1 only for lengths that are multiples of 128: others keep torch's order
    assert kernel_rule.choose(GPU.replace(**{"model.seq_length": 1000}), te=True).sdpa_order == ()


def test_the_sdpa_order_is_applied_on_hopper_only():
    import torch

    from workbench.backend.attention import apply_sdpa_order

    saved = torch._C._get_sdp_priority_order()
    try:
        assert apply_sdpa_order(kernel_rule.SDPA_CUDNN_FIRST, capability=(8, 0)) is None  # torch's own order on an A100
        assert torch._C._get_sdp_priority_order() == saved
        assert apply_sdpa_order((), capability=(9, 0)) is None
        assert apply_sdpa_order(kernel_rule.SDPA_CUDNN_FIRST, capability=(9, 0)) == list(kernel_rule.SDPA_CUDNN_FIRST)
        order = list(torch._C._get_sdp_priority_order())
        assert order[:4] == [3, 1, 2, 0] and sorted(order) == sorted(saved)  # cuDNN, flash, efficient, math; the rest kept
    finally:
        torch._C._set_sdp_priority_order(saved)


def test_explicit_backends_are_kept_and_the_layer_says_why_not():
    te = kernel_rule.choose(GPU.replace(**{"model.attention_backend": "te"}), te=True)
    assert (te.layer, te.layer_reason, te.norm, te.selective) == ("stock", "attention_backend te", "te", "core_attn")
    local = kernel_rule.choose(GPU.replace(**{"model.attention_backend": "local"}), te=False, apex=False)
    assert (local.attention, local.norm) == ("local", "torch")
    assert kernel_rule.choose(GPU.replace(**{"train.compile_kernels": False}), te=False).layer_reason == "train.compile_kernels is off"
    assert "GPU-only" in kernel_rule.choose(preset("tiny", **{"train.compile_kernels": True})).layer_reason


def test_cuda_graphs_on_transformer_engines_layer_are_megatrons():
    """TE's layer is host-bound (bench/README session 14): its layers replay as megatron's CUDA graphs."""
    assert kernel_rule.choose(GPU, te=True).cuda_graphs_impl == "step"  # the compiled layer, one process: the step
    te = kernel_rule.choose(GPU.replace(**{"model.attention_backend": "te"}), te=True)
    assert (te.cuda_graphs, te.cuda_graphs_impl) == (True, "megatron") and "megatron's CUDA graphs" in te.describe()
    sel = kernel_rule.choose(GPU.replace(**{"model.attention_backend": "te", "parallel.recompute": "selective"}), te=True)
    assert (sel.cuda_graphs, sel.cuda_graphs_impl) == (False, "") and "recompute" in sel.cuda_graphs_reason
    t5 = kernel_rule.choose(preset("t5-base", **{"model.attention_backend": "te"}), te=True)
    assert not t5.cuda_graphs and "not graphed" in t5.cuda_graphs_reason
    eager = kernel_rule.choose(GPU.replace(**{"data.reset_attention_mask": True}), te=False)  # megatron's stock SDPA layer
    assert (eager.cuda_graphs, eager.cuda_graphs_reason) == (False, "")
    off = kernel_rule.choose(GPU.replace(**{"model.attention_backend": "te", "train.cuda_graphs": False}), te=True)
    assert off.cuda_graphs_impl == ""


def test_apex_norm_only_where_the_layer_stays_stock():
    assert kernel_rule.choose(GPU, te=False, apex=True).norm == "workbench"  # the compiled graph fuses its own norm
    eager = GPU.replace(**{"train.compile_kernels": False})
    assert kernel_rule.choose(eager, te=False, apex=True).norm == "apex"
    assert kernel_rule.choose(eager.replace(**{"model.normalization": "rmsnorm"}), te=False, apex=True).norm == "workbench"


def test_cuda_graphs_follow_the_layout():
    assert kernel_rule.choose(GPU, te=False, cuda_available=False).cuda_graphs_reason == "no GPU"
    # pipeline parallel: graphs off, with the reason (neither torch's trees nor megatron's manager worked there)
    for vpp in (1, 2):
        pp_cfg = GPU.replace(**{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2,
                                "parallel.virtual_pipeline_parallel": vpp})
        pp = kernel_rule.choose(pp_cfg, te=False)
        assert (pp.layer, pp.cuda_graphs, pp.grad_accumulation) == ("compiled", False, "workbench")
        assert pp.cuda_graphs_reason.startswith("pipeline parallel")
    assert kernel_rule.choose(GPU, te=False).cuda_graphs_impl == "step"
    te_pp = kernel_rule.choose(GPU.replace(**{"parallel.pipeline_parallel": 2, "parallel.nproc_per_node": 2,
                                          "model.attention_backend": "te"}), te=True)
    assert not te_pp.cuda_graphs and te_pp.cuda_graphs_reason.startswith("pipeline parallel on TE's layer")
    full = kernel_rule.choose(GPU.replace(**{"parallel.recompute": "full"}), te=False)
    assert not full.cuda_graphs and "full recompute" in full.cuda_graphs_reason
    off = kernel_rule.choose(GPU.replace(**{"train.cuda_graphs": False}), te=False)
    assert not off.cuda_graphs and off.cuda_graphs_reason == ""


@pytest.mark.parametrize("fields, why", [
    ({"parallel.nproc_per_node": 2}, "more than one process"),
    ({"parallel.tensor_parallel": 2, "parallel.nproc_per_node": 2}, "more than one process"),
    ({"train.precision": "fp16"}, "fp16"),
    ({"parallel.overlap_grad_reduce": True}, "overlap_grad_reduce"),
    ({"train.fp8": "tensorwise"}, "train.fp8"),
    ({"train.loss_func": "pkg.mod:fn"}, "custom train step"),
    ({"train.return_logits": True}, "custom train step"),
])
def test_the_whole_step_is_one_graph_only_where_a_replay_sees_everything(fields, why):
    """One process, bf16 / fp32, no FP8, no hooks: the step is captured whole; otherwise the compiled layers keep
    their own graphs (cudagraph trees), and the summary names the reason."""
    assert kernel_rule.step_graph_blocker(GPU) is None
    assert kernel_rule.choose(GPU.replace(**{"train.precision": "fp32"}), te=False).cuda_graphs_impl == "step"
    k = kernel_rule.choose(GPU.replace(**fields), te=False)
    assert k.layer == "compiled" and k.cuda_graphs_impl == "torch", k.describe()
    assert why in kernel_rule.step_graph_blocker(GPU.replace(**fields))
    assert "the step as one CUDA graph" in kernel_rule.choose(GPU, te=False).describe()
    assert "the step as one CUDA graph" not in k.describe()


def test_the_choice_is_torch_free_and_serialisable():
    out = subprocess.run([sys.executable, "-c", "import sys, workbench.kernel_rule as k, workbench.config as c; "
                          "d = k.choose(c.preset('gpt2-small')).to_dict(); "
                          "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, sorted(sys.modules); print(d['layer'])"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "compiled", out.stderr


def test_transformer_engine_absent_here():
    assert kernel_rule.te_status()[0] == "absent" and not kernel_rule.te_available()


@pytest.fixture()
def broken_te(tmp_path):
    """A transformer_engine package that fails its own import check, as TE does without its metadata."""
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise AssertionError("Could not find transformer-engine")\n')
    return tmp_path


def test_a_broken_transformer_engine_breaks_megatron_without_the_guard(broken_te):
    out = subprocess.run([sys.executable, "-c", "import megatron.core.models.gpt.gpt_layer_specs"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env={**_env(), "PYTHONPATH": str(broken_te)})
    assert out.returncode != 0 and "Could not find transformer-engine" in out.stderr


def test_a_broken_transformer_engine_is_reported_once_and_hidden(broken_te):
    code = textwrap.dedent("""
        import workbench, workbench.kernel_rule as k
        import megatron.core.models.gpt.gpt_layer_specs, megatron.core.optimizer
        import workbench.backend.model
        from workbench.config import preset
        k.guard_transformer_engine()  # a second call reports nothing more
        print("status", k.te_status()[0], "attention", k.choose(preset("llama-small")).attention)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**_env(), "PYTHONPATH": f"{broken_te}:{ROOT}"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "status broken attention sdpa" in out.stdout
    assert out.stderr.count("Transformer Engine is installed but unusable") == 1
    assert "distribution metadata" in out.stderr


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pypi_te(root, versions=("2.20.2", "2.20.2", "2.20.2"), extension=True):
    """TE as PyPI installs it: the package, its PyTorch extension in ``transformer_engine/wheel_lib``, three dists."""
    pkg = root / "transformer_engine"
    (pkg / "wheel_lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if extension:
        (pkg / "wheel_lib" / "transformer_engine_torch.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    for name, v in zip(("transformer_engine", "transformer_engine_torch", "transformer_engine_cu13"), versions):
        d = root / f"{name}-{v}.dist-info"
        d.mkdir()
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
    return root


def _te_status_with(path) -> str:
    out = subprocess.run([sys.executable, "-c", "import workbench.kernel_rule as k; print(*k.te_status(), sep='|')"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env={**_env(), "PYTHONPATH": f"{path}:{ROOT}"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_a_pypi_transformer_engine_is_found_where_te_itself_looks(tmp_path):
    # launch/install_te.sh's layout: the extension is transformer_engine/wheel_lib/transformer_engine_torch*.so
    assert _te_status_with(_pypi_te(tmp_path / "ok")).startswith("ok|transformer-engine 2.20.2")
    missing = _te_status_with(_pypi_te(tmp_path / "noext", extension=False))
    assert missing.startswith("broken|") and "no PyTorch extension" in missing
    mixed = _te_status_with(_pypi_te(tmp_path / "mixed", versions=("2.20.2", "2.19.0", "2.20.2")))
    assert mixed.startswith("broken|") and "2.19.0" in mixed and "fix:" in mixed


_TE_CUDNN = """
import glob, os, sys
import workbench
path = os.environ.get("CUDNN_PATH")
# Transformer Engine's own lookup (transformer_engine/common/__init__.py, _load_cuda_library_from_system)
libs = sorted((l for l in glob.glob(f"{path}/**/libcudnn.so*", recursive=True) if "stub" not in l),
              reverse=True, key=os.path.basename) if path else []
print(path, libs[0] if libs else None)
"""


def _torch_cudnn():
    """The libcudnn torch's wheel loads (torch/lib's RPATH: ../../nvidia/cudnn/lib), where it has one."""
    import pathlib

    import torch

    lib = pathlib.Path(torch.__file__).parent.parent / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9"
    return lib if lib.exists() else None


def test_transformer_engine_loads_torchs_own_cudnn(tmp_path):
    import importlib.util

    torch_lib = _torch_cudnn()
    if torch_lib is None:
        pytest.skip("this torch has no cuDNN of its own (a CPU-only wheel)")
    if kernel_rule.te_status()[0] != "absent":
        pytest.skip("a real Transformer Engine is installed here: the runs below plant their own")
    spec = importlib.util.find_spec("nvidia.cudnn")
    if spec is None or not any(os.path.samefile(loc, torch_lib.parent.parent) for loc in spec.submodule_search_locations):
        pytest.skip("nvidia.cudnn on the path is not the folder of torch's libcudnn")
    env = {k: v for k, v in _env().items() if k not in ("CUDNN_PATH", "CUDNN_HOME")}
    te = _pypi_te(tmp_path / "ok")

    def run(extra, path):
        out = subprocess.run([sys.executable, "-c", _TE_CUDNN], capture_output=True, text=True, cwd=ROOT, timeout=120,
                             env={**env, **extra, "PYTHONPATH": f"{path}:{ROOT}"})
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    # with TE usable, the first libcudnn TE's lookup finds is the very file torch loads
    folder, first = run({}, te)
    assert folder != "None" and first != "None" and os.path.samefile(first, torch_lib), (folder, first, torch_lib)
    # a cuDNN the user chose is kept
    mine = tmp_path / "my_cudnn"
    (mine / "lib").mkdir(parents=True)
    (mine / "lib" / "libcudnn.so.9").write_bytes(b"")
    assert run({"CUDNN_PATH": str(mine)}, te)[0] == str(mine)
    # without TE nothing is set (torch finds its own)
    assert run({}, tmp_path / "nothing")[0] == "None"
