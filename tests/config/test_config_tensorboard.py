"""``train.tensorboard``: off by default; on, it needs the ``tensorboard`` package, and a config asking for it where the
package is not importable is refused before anything starts (exit 2, the field and the fix), found on disk without
importing it."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT
from workbench.config import preset


def _problems(cfg):
    return [p for p in cfg.validate() if p.field == "train.tensorboard"]


def test_tensorboard_is_off_by_default_and_valid_when_the_package_is_there():
    assert preset("tiny").train.tensorboard is False
    assert _problems(preset("tiny", **{"train.tensorboard": True})) == []


def test_tensorboard_without_the_package_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an import finds where the package is not installed
    (p,) = _problems(preset("tiny", **{"train.tensorboard": True}))
    assert "not importable" in p.rule and "pip install tensorboard" in p.fix and "tensorboard: false" in p.fix
    assert _problems(preset("tiny")) == []  # off: nothing asked of the package


def test_config_validate_exits_2_naming_the_field_where_tensorboard_is_missing(tmp_path):
    f = tmp_path / "tb.yaml"
    preset("tiny", **{"train.tensorboard": True}).save(f)
    code = ("import sys; sys.modules['tensorboard'] = None; from workbench.cli import main; "
            f"sys.exit(main(['config', 'validate', '--no-data', {str(f)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train.tensorboard:" in r.stderr and "pip install tensorboard" in r.stderr and "Traceback" not in r.stderr
