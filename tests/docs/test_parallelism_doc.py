"""docs/parallelism.md names real config fields, every ``parallel`` field, and rules the validator enforces.

- every dotted field it names (```parallel.tensor_parallel```, ```model.moe.num_experts```, ...) is a field of
  ``RunConfig``, and every field of ``ParallelConfig`` is named;
- each "Rules" paragraph's rule is what ``workbench.config.validate`` says for a config that breaks it;
- the worked numbers (GPT-2 medium's TP choices and 2-stage split, Llama-3.2-1B's largest TP) are the code's;
- docs/index.md lists every doc in docs/.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from workbench.config import ParallelConfig, RunConfig, pipeline_stage_layers, preset

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "parallelism.md"
SECTIONS = ("model", "parallel", "train", "data", "checkpoint")


def dotted_fields(d: dict, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in d.items():
        out.add(prefix + key)
        if isinstance(value, dict):
            out |= dotted_fields(value, f"{prefix}{key}.")
    return out


def test_every_named_field_exists_and_every_parallel_field_is_named():
    text = DOC.read_text(encoding="utf-8")
    known = dotted_fields(RunConfig().to_dict())
    named = set(re.findall(r"`((?:%s)\.[\w.]+)" % "|".join(SECTIONS), text))
    assert named, "no dotted fields found"
    assert sorted(named - known) == []
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks would shift the pairing
    spans = set(re.findall(r"`([^`\n]+)`", prose))
    words = {w for span in spans for w in re.findall(r"[\w.]+", span)}
    missing = [f.name for f in dataclasses.fields(ParallelConfig)
               if f.name not in words and f"parallel.{f.name}" not in words]
    assert missing == [], f"docs/parallelism.md does not name parallel fields {missing}"


def rules(name: str, **overrides) -> list[str]:
    return [f"{p.field}: {p.rule}" for p in preset(name, **overrides).validate()]


P = "parallel."


@pytest.mark.parametrize("name, overrides, field, says", [
    ("gpt2-medium", {P + "tensor_parallel": 3, P + "nproc_per_node": 3}, "parallel.tensor_parallel", "num_attention_heads 16 is not divisible"),
    ("llama3.2-1b", {P + "tensor_parallel": 16, P + "nproc_per_node": 16}, "model.num_query_groups", "not divisible by tensor_parallel 16"),
    ("gpt2-medium", {P + "nproc_per_node": 3, P + "tensor_parallel": 2}, "parallel.nproc_per_node", "not divisible by tp*pp"),
    ("gpt2-medium", {P + "sequence_parallel": True}, "parallel.sequence_parallel", "needs tensor_parallel > 1"),
    ("tiny", {P + "sequence_parallel": True, P + "tensor_parallel": 2, P + "nproc_per_node": 2, "model.seq_length": 63},
     "model.seq_length", "must be divisible by tensor_parallel"),
    ("tiny", {P + "pipeline_parallel": 8, P + "nproc_per_node": 8}, "parallel.pipeline_parallel", "fewer than pipeline_parallel"),
    ("t5-base", {P + "pipeline_parallel": 2, P + "nproc_per_node": 2}, "parallel.pipeline_parallel", "no pipeline parallelism for T5"),
    ("gpt2-medium", {P + "virtual_pipeline_parallel": 2}, "parallel.virtual_pipeline_parallel", "needs pipeline_parallel >= 2"),
    ("gpt2-medium", {P + "pipeline_parallel": 2, P + "virtual_pipeline_parallel": 5, P + "nproc_per_node": 2},
     "parallel.virtual_pipeline_parallel", "not divisible by pp*vpp"),
    ("gpt2-medium", {P + "pipeline_parallel": 2, P + "virtual_pipeline_parallel": 2, P + "nproc_per_node": 2,
                     "train.global_batch_size": 24}, "train.global_batch_size", "divisible by pipeline_parallel 2"),
    ("gpt2-medium", {P + "nproc_per_node": 2, "train.global_batch_size": 12}, "train.global_batch_size", "micro_batch_size*dp"),
    ("gpt2-medium", {P + "overlap_param_gather": True}, "parallel.overlap_param_gather", "needs the distributed optimizer"),
    ("gpt2-medium", {P + "expert_parallel": 2, P + "nproc_per_node": 2}, "parallel.expert_parallel", "needs experts"),
    ("mixtral-8x7b", {P + "expert_parallel": 3, P + "nproc_per_node": 3}, "parallel.expert_parallel", "num_experts 8 is not divisible"),
    ("mixtral-8x7b", {P + "expert_parallel": 4, P + "nproc_per_node": 2}, "parallel.expert_parallel", "expert_tensor_parallel x expert_parallel"),
    ("mixtral-8x7b", {P + "tensor_parallel": 2, P + "nproc_per_node": 2}, "parallel.sequence_parallel", "only with sequence parallelism"),
    ("mixtral-8x7b", {P + "recompute": "selective"}, "parallel.recompute", "selective recompute"),
    ("tiny", {P + "nproc_per_node": 9, "train.global_batch_size": 18}, "parallel.device", "1-8 processes"),
    ("tiny", {P + "context_parallel": 2, P + "nproc_per_node": 2, "model.seq_length": 66}, "model.seq_length", "not divisible by 2*context_parallel"),
    ("tiny", {P + "context_parallel": 2, P + "nproc_per_node": 3}, "parallel.nproc_per_node", "not divisible by tp*cp*pp"),
    ("t5-tiny", {P + "context_parallel": 2, P + "nproc_per_node": 2}, "parallel.context_parallel", "not the t5 family"),
    ("tiny", {P + "context_parallel": 2, P + "nproc_per_node": 2, "model.attention_backend": "local"}, "model.attention_backend", "not megatron's unfused local attention"),
    ("bert-tiny", {P + "context_parallel": 2, P + "nproc_per_node": 2, "model.attention_backend": "te"}, "model.attention_backend", "padding mask under Transformer Engine's context parallelism"),
])
def test_each_documented_rule_is_enforced(name, overrides, field, says):
    found = rules(name, **overrides)
    assert any(f.startswith(field + ":") and says in f for f in found), found


def test_worked_numbers():
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    assert "GPT-2 medium (16 heads) takes TP 1, 2, 4, 8 or 16" in text
    for tp in (1, 2, 4, 8, 16):
        assert rules("gpt2-medium", **{P + "tensor_parallel": tp, P + "nproc_per_node": tp}) == [], tp
    assert "Llama-3.2-1B (32 heads, 8 query groups) at most TP 8" in text
    assert rules("llama3.2-1b", **{P + "tensor_parallel": 8, P + "nproc_per_node": 8}) == []
    assert "GPT-2 medium on 2 stages: 14 + 10" in text
    assert pipeline_stage_layers(preset("gpt2-medium", **{P + "pipeline_parallel": 2, P + "nproc_per_node": 2})) == (14, 10)


def test_index_lists_every_doc():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    docs = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert sorted(docs - listed) == [], "docs/index.md does not list these docs"
