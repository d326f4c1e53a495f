"""Validating a config's ``train.forward_step`` / ``train.loss_func`` never runs code: the module a hook names is
looked for on disk (and among the modules already imported), never imported; a module that is not there is reported
with the field and the fix."""

from __future__ import annotations

import sys

import pytest

from workbench.config import preset


@pytest.fixture()
def marked_package(tmp_path, monkeypatch):
    """``marked_pkg`` (its ``__init__`` and ``sub`` write ``marker`` when imported) and ``marked_mod`` on sys.path."""
    code = tmp_path / "code"
    (code / "marked_pkg" / "inner").mkdir(parents=True)
    marker = tmp_path / "MARKER"
    payload = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\ndef fn(*a, **k):\n    return None\n"
    (code / "marked_pkg" / "__init__.py").write_text(payload)
    (code / "marked_pkg" / "sub.py").write_text(payload)
    (code / "marked_pkg" / "inner" / "__init__.py").write_text(payload)
    (code / "marked_pkg" / "inner" / "deep.py").write_text(payload)
    (code / "marked_mod.py").write_text(payload)
    monkeypatch.syspath_prepend(str(code))
    names = ("marked_pkg", "marked_pkg.sub", "marked_pkg.inner", "marked_pkg.inner.deep", "marked_mod")
    for name in names:
        sys.modules.pop(name, None)
    yield marker
    for name in names:
        sys.modules.pop(name, None)


def _hook_problems(**hooks):
    cfg = preset("tiny", **{f"train.{k}": v for k, v in hooks.items()})
    return {p.field: p for p in cfg.validate() if p.field.startswith("train.") and p.field.endswith(tuple(hooks))}


@pytest.mark.parametrize("hook", ["marked_pkg.sub:fn", "marked_pkg.inner.deep:fn", "marked_pkg.inner:fn", "marked_mod:fn",
                                  "marked_pkg.sub.fn"])
def test_validating_a_hook_path_imports_nothing(marked_package, hook):
    assert _hook_problems(forward_step=hook, loss_func=hook) == {}
    assert not marked_package.exists(), marked_package.read_text()  # no __init__, no module ran
    assert "marked_pkg" not in sys.modules and "marked_mod" not in sys.modules


@pytest.mark.parametrize("hook, missing", [("marked_pkg.nope:fn", "marked_pkg.nope"), ("marked_pkg.inner.nope:fn", "marked_pkg.inner.nope"),
                                           ("no_such_top_level_mod:fn", "no_such_top_level_mod"),
                                           ("marked_mod.sub:fn", "marked_mod.sub")])  # a module is no package
def test_a_missing_module_is_reported_without_importing(marked_package, hook, missing):
    found = _hook_problems(forward_step=hook)
    assert set(found) == {"train.forward_step"}
    p = found["train.forward_step"]
    assert f"'{missing}' is not importable" in p.rule and "PYTHONPATH" in p.fix
    assert not marked_package.exists(), marked_package.read_text()


def test_already_imported_modules_count(marked_package):
    import marked_pkg.sub  # noqa: F401  (runs the payload: this test's own import)

    marked_package.unlink()
    assert _hook_problems(forward_step="marked_pkg.sub:fn", loss_func="json.decoder:JSONDecoder") == {}
    assert _hook_problems(forward_step="workbench.hooks:default_forward_step") == {}
    assert not marked_package.exists()
