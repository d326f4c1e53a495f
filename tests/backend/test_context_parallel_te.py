"""Context parallelism through Transformer Engine (#53): with ``attention_backend: te`` a CP layout runs megatron-core's
own context parallelism in TE's attention instead of the workbench ring; the config rules, the kernel rule, the kernel
path and the benchmark rows say which ring runs.  TE is not importable here: the rule is asked as if it were
(``te=True``); the training itself is proved on GPUs (``tests/gpu_proofs/two_gpu_proof.py``, case
``llama-8k-cp2-te``)."""

from __future__ import annotations

from pathlib import Path

from workbench import kernel_rule
from workbench.backend.model import kernel_path
from workbench.config import preset, validate

CP2 = {"parallel.context_parallel": 2, "parallel.nproc_per_node": 2, "parallel.device": "cuda"}


def _cfg(name: str = "tiny", **over):
    return preset(name, **{**CP2, **over})


def test_te_context_parallel_is_accepted_for_causal_families_and_refused_where_it_cannot_run():
    assert validate(_cfg(**{"model.attention_backend": "te"})) == []
    (bert,) = [q for q in validate(_cfg("bert-tiny", **{"model.attention_backend": "te"})) if q.field == "model.attention_backend"]
    assert "padding mask" in bert.rule and "THD" in bert.rule and "sdpa" in bert.fix
    assert validate(_cfg("bert-tiny")) == []  # the workbench ring takes BERT's padding mask
    (local,) = [q for q in validate(_cfg(**{"model.attention_backend": "local"})) if q.field == "model.attention_backend"]
    assert "unfused local attention" in local.rule and "te" in local.fix


def test_the_kernel_rule_names_whose_ring_runs():
    te = kernel_rule.choose(_cfg(**{"model.attention_backend": "te", "train.cuda_graphs": True}), te=True, cuda_available=True)
    assert (te.attention, te.context_parallel, te.layer) == ("te", "te", "stock")
    assert not te.cuda_graphs and te.cuda_graphs_reason == kernel_rule.CP_TE_BLOCKER
    assert "context parallel in Transformer Engine" in te.describe()
    path = kernel_path(_cfg(**{"model.attention_backend": "te"}), te)["attention"]
    assert "megatron-core's, in Transformer Engine's attention" in path and "ring attention over the CP group" not in path
    auto = kernel_rule.choose(_cfg(), te=True, cuda_available=True)  # auto keeps the measured workbench ring
    assert (auto.attention, auto.context_parallel) == ("sdpa", "ring")
    assert "ring attention over the CP group" in kernel_path(_cfg(), auto)["attention"]
    one = kernel_rule.choose(preset("tiny", **{"parallel.device": "cuda", "model.attention_backend": "te"}), te=True,
                             cuda_available=True)
    assert one.context_parallel == "" and "context parallel" not in one.describe()


def test_the_benchmark_has_te_cp_rows_only_where_te_is_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    from bench import train_throughput as tt

    with_te = {v.name: v for v in tt.cp_variants(["llama3.2-1b"], have_te=True)}
    row = with_te["cp2-te-32k/llama3.2-1b"]
    assert row.overrides["model.attention_backend"] == "te" and row.overrides["parallel.context_parallel"] == 2
    assert row.baseline == "workbench-32k/llama3.2-1b" and row.reference == "cp2-32k/llama3.2-1b"
    assert validate(tt.bench_config(row)) == []
    assert not [n for n in (v.name for v in tt.cp_variants(["llama3.2-1b"])) if n.startswith("cp2-te")]
