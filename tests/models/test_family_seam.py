"""The family seam is what it says: every registered family declares its fields and answers every part's
protocol, the declarations (workbench/families/) stand below the config (and above the data tools, workbench/data/)
and import no torch, the backend never
imports a family's rank side (workbench/models/<family>/), the models never the rank entry point
(workbench/rank/), and none of them the conversion tools (workbench/conversion/) that run them, a family's
modules are loaded by name only by the one generic parts mechanism, and the generic code takes the loss name and
the default step from the family (a batch carries its run's step)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import init_single_process, teardown_single_process
from workbench.config import ModelConfig, RunConfig, preset
from workbench.families import FAMILIES
from workbench.families.family import PART_PROTOCOLS, ShapesPart, StepPart, part_problems
from workbench.models.parts import PART_MODULES, FamilyParts, parts_of

WORKBENCH = Path(__file__).resolve().parents[2] / "workbench"
#: the folders under workbench/models that are families (each holds a model.py), not shared code
FAMILY_PACKAGES = sorted(p.parent.name for p in (WORKBENCH / "models").glob("*/model.py"))


def test_every_declared_family_has_its_parts_package():
    assert FAMILY_PACKAGES == sorted(FAMILIES)
    for name, family in FAMILIES.items():
        parts = parts_of(name)
        assert isinstance(parts, FamilyParts) and parts.family is family and parts_of(family) is parts
        assert parts.package == f"workbench.models.{name}"
    assert set(PART_MODULES) == set(PART_PROTOCOLS)


def test_a_part_the_family_lacks_says_so():
    bert = FAMILIES["bert"]
    assert parts_of(bert).generation() is None and parts_of(bert).monitor() is None  # optional parts: None
    nowhere = FamilyParts(bert, "workbench.models.common")  # a package without the family's modules
    with pytest.raises(LookupError, match="the bert family has no model part: .*workbench.models.common.model"):
        nowhere.model()
    assert FamilyParts(bert, "workbench.models.no_such_package").hf() is None


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
    place under ``root``), with the names a ``from`` import takes (``from workbench.families import gpt`` names
    ``workbench.families.gpt``)."""
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


#: the floors of the rank side, bottom up: the backend's blocks, the families' models, the rank entry point; then
#: the conversion tools, which run the families' HF adapters and build their models (the rules the adapters are
#: written in stand in workbench/models/common/)
RANK_SIDE_FLOORS = ("workbench.backend", "workbench.models", "workbench.rank", "workbench.conversion")


def test_the_rank_side_imports_only_down():
    """The backend imports neither the models nor the rank entry point; the models do not import the rank entry
    point (it asks them for their parts, through workbench.models.parts); none of them imports conversion."""
    found = []
    for i, floor in enumerate(RANK_SIDE_FLOORS[:-1]):
        above = RANK_SIDE_FLOORS[i + 1:]
        for path in sorted((WORKBENCH / floor.split(".")[1]).rglob("*.py")):
            for line, module in _imported_modules(path):
                if any(module == a or module.startswith(a + ".") for a in above):
                    found.append(f"{path.relative_to(WORKBENCH.parent)}:{line} imports {module}")
    assert found == []


def test_the_family_import_check_finds_one(tmp_path):
    """The check above fails for any spelling of an import of a family from the backend."""
    probe = tmp_path / "workbench" / "backend" / "_seam_probe.py"  # where a backend module would stand
    probe.parent.mkdir(parents=True)
    for source in ("from workbench.models.gpt import model\n", "import workbench.models.t5.generate\n",
                   "from workbench.models import bert\n", "def f():\n    from ..models.gpt.step import loss\n"):
        probe.write_text(source)
        assert family_imports(probe, tmp_path), source
    probe.write_text("from workbench.families import family_of\nfrom workbench.models.parts import parts_of\n")
    assert family_imports(probe, tmp_path) == []


#: what the declarations (workbench/families/) may import of the workbench: themselves and what stands below the
#: config; the data checks of a family's ``data_rules`` read the data layer's tokenizer and index headers
FAMILIES_MAY_IMPORT = ("workbench.families", "workbench.config_fields", "workbench.config_text", "workbench.layout",
                       "workbench.data.errors", "workbench.data.tokenizer", "workbench.data.indexed")


def test_the_declarations_import_nothing_above_the_config():
    """workbench/families/ stands below the config: no declaration imports the config, a family's rank side
    (workbench/models/), the backend, conversion or anything else above it."""
    found = []
    for path in sorted((WORKBENCH / "families").rglob("*.py")):
        for line, module in _imported_modules(path):
            if module.startswith("workbench") and not module.startswith(FAMILIES_MAY_IMPORT) and module != "workbench":
                found.append(f"{path.relative_to(WORKBENCH.parent)}:{line} imports {module}")
    assert found == []


#: what the data tools (workbench/data/) may import of the workbench: themselves and the stdlib helpers below them (the
#: writable-path check; the kernel-quiet progress bar); a run config's datasets (workbench/datasets.py) and the data
#: commands (workbench/data_cli.py) stand above the config
DATA_MAY_IMPORT = ("workbench.data", "workbench.writable", "workbench.noise")


def test_the_data_tools_stand_below_the_declarations():
    """workbench/data/ stands below the families that read its tokenizers and index headers: it imports no family,
    no config, no run directory code, nothing above it."""
    found = []
    for path in sorted((WORKBENCH / "data").rglob("*.py")):
        for line, module in _imported_modules(path):
            allowed = any(module == m or module.startswith(m + ".") for m in DATA_MAY_IMPORT)
            if module.startswith("workbench") and not allowed and module != "workbench":
                found.append(f"{path.relative_to(WORKBENCH.parent)}:{line} imports {module}")
    assert found == []


def test_the_declarations_config_and_planner_are_torch_free():
    """With torch and megatron-core unimportable, the registry, the config (validation of every family's presets)
    and the planner (a plan of each family) still import and answer."""
    code = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "megatron", "transformer_engine"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, NoTorch())
import workbench.families, workbench.config, workbench.planner
from workbench.families import FAMILIES, all_presets
from workbench.config import preset
for name, (family, _) in all_presets().items():
    assert preset(name).validate() == [], name
for tiny in ("gpt2-small", "bert-tiny", "t5-tiny"):
    assert workbench.planner.predict(preset(tiny), "H100").ranks, tiny
assert not any(m.split(".")[0] in ("torch", "megatron") for m in sys.modules)
print(sorted(FAMILIES))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=WORKBENCH.parent, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(sorted(FAMILIES))


def test_no_hidden_imports_of_workbench_modules():
    """Modules of workbench/ are imported by import statements the graph shows (importlib / __import__ only load
    what a user's config names, a package's version, or a command module that may be absent)."""
    allowed = {"workbench/hooks.py",  # resolve(): the user's train.forward_step / loss_func hook, by dotted path
               "workbench/checkpoint/safe_load.py",  # find_class(): the allow-listed globals of checkpoint metadata
               "workbench/rank/train.py",  # _versions(): the versions of optional third-party packages
               "workbench/models/parts.py"}  # FamilyParts: the modules of workbench.models.<family>, by PART_MODULES
    found = []
    for path in sorted(WORKBENCH.rglob("*.py")):
        rel = str(path.relative_to(WORKBENCH.parent))
        text = path.read_text()
        if ("import_module(" in text or "__import__(" in text) and rel not in allowed:
            found.append(rel)
    assert found == []
    assert not any("importlib" in p.read_text() for name in FAMILY_PACKAGES for p in (WORKBENCH / "models" / name).rglob("*.py"))


# --------------------------------------------------------------------------- the family's step, asked for


def test_default_forward_step_runs_the_batchs_familys_step(tmp_path):
    """A hook wrapping ``workbench.hooks.default_forward_step`` runs its run's family's forward (T5 here), not GPT's:
    the trainer's batches carry that step (``Batch.family_step``), no module holds it."""
    from workbench import hooks
    from workbench.rank.build import build_model
    from workbench.rank.train import Trainer

    cfg = preset("t5-tiny", **{"model.num_layers": 1, "model.hidden_size": 32, "model.num_attention_heads": 2,
                               "model.ffn_hidden_size": 64, "model.vocab_size": 160, "model.seq_length": 16,
                               "model.decoder_seq_length": 8, "data.source": "synthetic", "parallel.device": "cpu",
                               "train.precision": "fp32", "train.micro_batch_size": 2, "train.global_batch_size": 2})
    step = parts_of(cfg).step()
    assert not hasattr(hooks, "bind_family_step") and not hasattr(hooks, "_family_step")
    with pytest.raises(RuntimeError, match="on a batch of a training run"):
        hooks.default_forward_step(hooks.Batch(), None)
    trainer = Trainer(cfg, tmp_path)
    assert trainer._to_batch({"tokens": None}).family_step is trainer.step is step
    was = init_single_process(cfg)
    try:
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        train, _, _ = parts_of(cfg).data().build_datasets(cfg, None)
        items = [train[i] for i in range(2)]
        raw = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        batch = hooks.Batch(tokens=raw.pop("tokens"), labels=raw.pop("labels"), loss_mask=raw.pop("loss_mask"), extra=raw,
                            family_step=step)
        with torch.no_grad():
            got = hooks.default_forward_step(batch, model)
            want = step.forward_step(batch, model)
        assert got.shape == (2, cfg.model.decoder_seq)  # the decoder's per-token losses
        assert torch.isfinite(got).all() and torch.equal(got, want)
    finally:
        teardown_single_process(was)
