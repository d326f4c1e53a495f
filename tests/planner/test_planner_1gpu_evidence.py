"""The one-GPU measurements: allocated AND reserved within 5% on every rank.

``tests/gpu_proofs/planner_measure.py --set 1gpu`` (one device call) wrote one line per layout to
``evidence/planner_1gpu.jsonl`` (GPT layouts), ``evidence/planner_1gpu_families.jsonl`` (BERT and T5
layouts, a second call), ``evidence/planner_1gpu_compiled_layer.jsonl`` (BERT, T5 and the Llama-1B shape once
the kernel rule put them on the compiled layer, a third call) and
``evidence/planner_1gpu_step_graph_qk_norms.jsonl`` (the Llama-1B shape on today's default path, the step as one
CUDA graph, and with q/k norms; a fourth call) and ``evidence/planner_1gpu_step_graph_families.jsonl`` (BERT, T5 and
selective recompute on the step graph; a fifth call): the peak of ``torch.cuda.max_memory_allocated()`` and of
``max_memory_reserved()`` over the whole run (set-up, the compile / CUDA-graph warm-up and
recording steps included), with device, date and commit.  This test re-plans every record with
today's planner, on the kernel path the run reported, and holds both to 5%.

Rows the planner does not yet meet are listed in ``KNOWN_MISSES`` with the measured error and
run as strict xfails: the bar is not loosened for them, and a fix that brings one within 5%
turns its xfail into a failure until it is taken off the list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench import kernel_rule
from workbench.config import RunConfig
from workbench.planner.evidence import BAR, ONE_GPU_FILES, evidence_table, replan

EVIDENCE, FAMILIES, COMPILED, STEP_QK, STEP_FAMILIES = ONE_GPU_FILES

#: (config, "allocated" | "reserved") -> why the planner misses it (error at the commit that listed it)
KNOWN_MISSES: dict[tuple[str, str], str] = {
    ("t5-base-compiled", "allocated"): "-9.5% at 8a7c5cc: T5's encoder on the compiled layer (relative bias + padding "
                                       "mask inside the graph) keeps ~0.6 GiB more than the stock layer's terms",
    ("t5-base-compiled", "reserved"): "-10.0% at 8a7c5cc: as allocated",
}
#: the same for the step graph's file (its ``llama1b`` is the default path today, not the older files' ``llama1b``)
STEP_QK_MISSES: dict[tuple[str, str], str] = {
    ("llama1b", "reserved"): "-7.0% at 84dd336: after the capture's empty_cache the default pool keeps 2.3 GiB of "
                             "segments split by Adam's moments (made in the first step's freed transients), which the "
                             "graph's own pool cannot use; the model's stranded term counts only the logits' block",
}

#: the same for the step graph's families file
STEP_FAMILY_MISSES: dict[tuple[str, str], str] = {
    ("t5-base-compiled", "allocated"): "-7.1% at d54655e: T5 on the step graph, as KNOWN_MISSES' T5 on the compiled "
                                       "layer (the encoder's relative bias and padding mask inside the graph)",
    ("t5-base-compiled", "reserved"): "-9.7% at d54655e: as allocated",
}


def _records(path: Path = EVIDENCE) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("status") == "ok" and r.get("measured_reserved")]


RECORDS = _ok(_records())
FAMILY_RECORDS = _ok(_records(FAMILIES))
COMPILED_RECORDS = _ok(_records(COMPILED))
STEP_QK_RECORDS = _ok(_records(STEP_QK))
STEP_FAMILY_RECORDS = _ok(_records(STEP_FAMILIES))
pytestmark = pytest.mark.skipif(not RECORDS, reason="no one-GPU evidence committed (run tests/gpu_proofs/planner_measure.py --set 1gpu)")


def errors(rec: dict) -> dict[str, float]:
    """Relative error of today's planner on one record: {"allocated": .., "reserved": ..}."""
    r = replan(rec).ranks[rec["rank"]]
    return {"allocated": (r.peak_allocated - rec["measured_allocated"]) / rec["measured_allocated"],
            "reserved": (r.peak_reserved - rec["measured_reserved"]) / rec["measured_reserved"]}


def test_evidence_is_one_device_call_and_covers_the_issue():
    assert all(r.get("device") and "cpu" not in r["device"].lower() for r in RECORDS)
    assert all(r.get("date") and r.get("commit") for r in RECORDS)
    assert len({(r["date"], r["commit"]) for r in RECORDS}) == 1  # one device call
    cfgs = {r["config"]: RunConfig.from_dict(r["run_config"]) for r in RECORDS}
    shapes = {(c.model.num_layers, c.model.hidden_size) for c in cfgs.values()}
    assert {(12, 768), (24, 1024), (36, 1280), (16, 2048), (6, 384)} <= shapes  # GPT-2 s/m/l, Llama 1B, demo-small
    assert {c.parallel.recompute for c in cfgs.values()} == {"none", "selective", "full"}
    assert any(c.parallel.distributed_optimizer for c in cfgs.values())
    paths = {(c.train.compile_kernels, replan(r).kernel_path.cuda_graphs) for r in RECORDS for c in [cfgs[r["config"]]]}
    assert {(True, True), (True, False), (False, False)} <= paths  # graphs on, compiled without graphs, compile off


def test_family_evidence_is_one_device_call_and_covers_bert_and_t5():
    assert FAMILY_RECORDS, "no BERT/T5 evidence committed (tests/gpu_proofs/planner_measure.py --only bert-base,...,t5-base-full)"
    assert all(r.get("device") and "cpu" not in r["device"].lower() for r in FAMILY_RECORDS)
    assert len({(r["date"], r["commit"]) for r in FAMILY_RECORDS}) == 1
    cfgs = [RunConfig.from_dict(r["run_config"]) for r in FAMILY_RECORDS]
    assert {c.model.arch for c in cfgs} == {"bert", "t5"}
    t5 = [c for c in cfgs if c.model.arch == "t5"]
    assert {c.model.activation for c in t5} >= {"relu", "geglu"}  # v1.0 and v1.1 layouts
    assert {c.parallel.recompute for c in t5} >= {"none", "full"}


def test_compiled_layer_evidence_is_one_device_call_and_covers_the_families():
    assert len({(r["date"], r["commit"]) for r in COMPILED_RECORDS}) == 1
    assert all("compiled dense layer" in r["kernel_path"]["fast_layer"] for r in COMPILED_RECORDS)
    archs = {RunConfig.from_dict(r["run_config"]).model.arch for r in COMPILED_RECORDS}
    assert archs == {"gpt", "bert", "t5"}
    assert any(RunConfig.from_dict(r["run_config"]).model.position_embedding == "rope" for r in COMPILED_RECORDS)


def test_step_graph_and_qk_norm_evidence_is_one_device_call_and_covers_them():
    """The default path today (the step as one CUDA graph) and the q/k norms (per head, all heads), measured."""
    assert len({(r["date"], r["commit"]) for r in STEP_QK_RECORDS}) == 1
    assert any(r["kernel_path"].get("fast_cuda_graphs") == kernel_rule.STEP_GRAPH_NOTE for r in STEP_QK_RECORDS)
    cfgs = [RunConfig.from_dict(r["run_config"]) for r in STEP_QK_RECORDS]
    assert {c.model.qk_norm_scope for c in cfgs if c.model.qk_layernorm} == {"head", "all_heads"}


def test_step_graph_families_evidence_is_one_device_call_and_covers_them():
    """BERT and T5 on the step graph (BERT's masked-LM head on its masked rows), and selective recompute on it."""
    assert len({(r["date"], r["commit"]) for r in STEP_FAMILY_RECORDS}) == 1
    assert all(r["kernels"]["cuda_graphs_impl"] == "step" and not r["step_graph_failed"] for r in STEP_FAMILY_RECORDS)
    cfgs = [RunConfig.from_dict(r["run_config"]) for r in STEP_FAMILY_RECORDS]
    assert {c.model.arch for c in cfgs} == {"gpt", "bert", "t5"}
    assert {c.parallel.recompute for c in cfgs if c.model.arch == "gpt"} == {"selective"}


def _cases():
    files = [(RECORDS + FAMILY_RECORDS + COMPILED_RECORDS, KNOWN_MISSES), (STEP_QK_RECORDS, STEP_QK_MISSES),
             (STEP_FAMILY_RECORDS, STEP_FAMILY_MISSES)]
    for recs, misses in files:
        yield from _file_cases(recs, misses)


def _file_cases(recs: list[dict], misses: dict[tuple[str, str], str]):
    for r in recs:
        for kind in ("allocated", "reserved"):
            miss = misses.get((r["config"], kind))
            marks = [pytest.mark.xfail(strict=True, reason=miss)] if miss else []
            yield pytest.param(r, kind, id=f"{r['config']}-rank{r['rank']}-{kind}", marks=marks)


@pytest.mark.parametrize("rec,kind", list(_cases()))
def test_planner_within_5_percent(rec, kind):
    err = errors(rec)[kind]
    assert abs(err) <= BAR, f"{rec['config']} rank {rec['rank']} {kind}: {100 * err:+.1f}% (bar {100 * BAR:.0f}%)"


def test_the_notebook_table_is_these_records_and_errors():
    table = evidence_table()
    recs = RECORDS + FAMILY_RECORDS + COMPILED_RECORDS + STEP_QK_RECORDS + STEP_FAMILY_RECORDS
    assert len(table) == len(recs)
    for (_, row), rec in zip(table.iterrows(), recs):
        e = errors(rec)
        assert row["config"] == rec["config"]
        assert abs(row["alloc err %"] - 100 * e["allocated"]) < 0.01 and abs(row["reserved err %"] - 100 * e["reserved"]) < 0.01
