"""The family seam is what it says: every registered family declares its fields and answers every part's
protocol, the backend's building blocks never import a family, no family module is loaded by a hidden
import, and the generic code takes the loss name and the default step from the family."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.support import init_single_process, teardown_single_process
from workbench.config import ModelConfig, RunConfig, preset
from workbench.models import FAMILIES
from workbench.models.family import PART_PROTOCOLS, FamilyParts, ShapesPart, StepPart, part_problems
from workbench.models.parts import PARTS, check_registry, parts_of

WORKBENCH = Path(__file__).resolve().parents[2] / "workbench"
#: the folders under workbench/models that are families (each holds a parts.py), not shared code
FAMILY_PACKAGES = sorted(p.parent.name for p in (WORKBENCH / "models").glob("*/parts.py"))


def test_the_two_registries_name_the_same_families():
    assert check_registry() == []
    assert list(PARTS) == list(FAMILIES)
    assert FAMILY_PACKAGES == sorted(FAMILIES)
    for name, parts in PARTS.items():
        assert isinstance(parts, FamilyParts) and parts.family is FAMILIES[name]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_answers_every_part_protocol(name):
    family, parts = FAMILIES[name], parts_of(name)
    assert part_problems(family.shapes, ShapesPart) == []
    for accessor, protocol in PART_PROTOCOLS.items():
        part = getattr(parts, accessor)()
        if accessor in ("model", "step", "data"):
            assert part is not None, f"{name} has no {accessor} part"
        if part is not None:
            assert isinstance(part, protocol), f"{name}.{accessor}() is not a {protocol.__name__}"
            assert part_problems(part, protocol) == [], f"{name}.{accessor}()"
    # what the declaration promises, the parts hold
    assert (parts.hf() is not None) == bool(family.supports.hf_classes)
    assert (parts.generation() is not None) == family.supports.generation
    assert isinstance(parts.step().LOSS_NAME, str) and parts.step().LOSS_NAME


def test_part_problems_names_what_a_part_lacks():
    class HalfAStep:
        LOSS_NAME = 3  # not a string

        @staticmethod
        def forward_step(batch):  # no model, no return_logits
            return batch

    problems = part_problems(HalfAStep, StepPart)
    assert any(p.startswith("LOSS_NAME") for p in problems)
    assert any(p.startswith("forward_step()") for p in problems)
    assert "loss(): missing" in problems and "logits_forward(): missing" in problems


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_fields_are_mounted_on_the_model_config_with_their_keys(name):
    family = FAMILIES[name]
    mounted = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for dotted in family.fields:
        key = dotted.split(".", 1)[1]
        assert key in mounted
        own = {f.name: f for f in dataclasses.fields(family.model_fields)}[key]
        assert mounted[key].metadata == own.metadata  # its bound travels with it
        # a config file naming the field reads as before
        value = getattr(family.model_fields(), key)
        plain = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        cfg = RunConfig.from_dict({"model": {"arch": name, key: plain}})
        assert getattr(cfg.model, key) == value


def test_arch_choices_are_the_registry():
    from typing import get_args, get_type_hints

    assert get_args(get_type_hints(ModelConfig)["arch"]) == tuple(FAMILIES)


# --------------------------------------------------------------------------- the import graph


def _imported_modules(path: Path, root: Path = WORKBENCH.parent) -> list[tuple[int, str]]:
    """Every module an ``import`` / ``from ... import`` of the file names (relative ones resolved against its
    place under ``root``), with the names a ``from`` import takes (``from workbench.models import gpt`` names
    ``workbench.models.gpt``)."""
    rel = path.relative_to(root).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def family_imports(path: Path, root: Path = WORKBENCH.parent) -> list[str]:
    """The imports of a module of workbench/ (under ``root``) that reach into a family's package
    (``workbench.models.<family>``)."""
    bad = []
    for line, module in _imported_modules(path, root):
        parts = module.split(".")
        if parts[:2] == ["workbench", "models"] and len(parts) > 2 and parts[2] in FAMILY_PACKAGES:
            bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_no_backend_module_imports_a_family():
    backend = sorted((WORKBENCH / "backend").rglob("*.py"))
    assert len(backend) > 10
    assert [b for p in backend for b in family_imports(p)] == []


def test_the_family_import_check_finds_one(tmp_path):
    """The check above fails for any spelling of an import of a family from the backend."""
    probe = tmp_path / "workbench" / "backend" / "_seam_probe.py"  # where a backend module would stand
    probe.parent.mkdir(parents=True)
    for source in ("from workbench.models.gpt import model\n", "import workbench.models.t5.generate\n",
                   "from workbench.models import bert\n", "def f():\n    from ..models.gpt.step import loss\n"):
        probe.write_text(source)
        assert family_imports(probe, tmp_path), source
    probe.write_text("from workbench.models import family_of\nfrom workbench.models.parts import parts_of\n")
    assert family_imports(probe, tmp_path) == []


def test_no_hidden_imports_of_workbench_modules():
    """Modules of workbench/ are imported by import statements the graph shows (importlib / __import__ only load
    what a user's config names, a package's version, or a command module that may be absent)."""
    allowed = {"workbench/hooks.py",  # resolve(): the user's train.forward_step / loss_func hook, by dotted path
               "workbench/run/integrity.py",  # find_class(): the allow-listed globals of checkpoint metadata
               "workbench/backend/train.py"}  # _versions(): the versions of optional third-party packages
    found = []
    for path in sorted(WORKBENCH.rglob("*.py")):
        rel = str(path.relative_to(WORKBENCH.parent))
        text = path.read_text()
        if ("import_module(" in text or "__import__(" in text) and rel not in allowed:
            found.append(rel)
    assert found == []
    assert not any("importlib" in p.read_text() for p in (WORKBENCH / "models").rglob("*.py"))


# --------------------------------------------------------------------------- the family's step, asked for


def test_default_forward_step_runs_the_trained_familys_step():
    """A hook wrapping ``workbench.hooks.default_forward_step`` runs its run's family's forward (T5 here), not GPT's."""
    from workbench import hooks
    from workbench.backend.build import build_model

    cfg = preset("t5-tiny", **{"model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
                               "model.ffn_hidden_size": 64, "model.vocab_size": 160, "model.seq_length": 16,
                               "model.decoder_seq_length": 8, "data.source": "synthetic", "parallel.device": "cpu",
                               "train.precision": "fp32", "train.micro_batch_size": 2, "train.global_batch_size": 2})
    step = parts_of(cfg).step()
    hooks.bind_family_step(None)
    with pytest.raises(RuntimeError, match="inside a training run"):
        hooks.default_forward_step(None, None)
    was = init_single_process(cfg)
    try:
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        train, _, _ = parts_of(cfg).data().build_datasets(cfg, None)
        items = [train[i] for i in range(2)]
        raw = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch = hooks.Batch(tokens=raw.pop("tokens"), labels=raw.pop("labels"), loss_mask=raw.pop("loss_mask"), extra=raw)
        hooks.bind_family_step(step)
        with torch.no_grad():
            got = hooks.default_forward_step(batch, model)
            want = step.forward_step(batch, model)
        assert got.shape == (2, cfg.model.decoder_seq)  # the decoder's per-token losses
        assert torch.isfinite(got).all() and torch.equal(got, want)
    finally:
        hooks.bind_family_step(None)
        teardown_single_process(was)
