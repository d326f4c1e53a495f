"""Hostile input through every entry point: `workbench config validate`, `workbench launch` (dry run and
real), `Run.launch`, the config form, `workbench sweep` / `notebook run`: exit 2 (or ConfigError) naming the
field or the file, with the fix, no traceback, and nothing started or created."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from workbench.cli import main
from workbench.config import ConfigError, preset
from workbench.notebook import sweep


def _tiny(**changes) -> dict:
    d = preset("tiny").to_dict()
    for k, v in changes.items():
        section, name = k.split(".")
        d[section][name] = v
    return d


def _bomb() -> str:
    lines = ["train:", "  hook_kwargs:", '    l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"    l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 7)]
    return "\n".join(lines) + "\n"


HOSTILE_FILES = {  # file name -> (text, what the message must name)
    "nan.yaml": (yaml.safe_dump(_tiny(**{"train.lr": math.nan})), "train.lr"),
    "inf.json": (json.dumps(_tiny(**{"model.rotary_base": math.inf})), "model.rotary_base"),
    "empty.yaml": ("", "empty.yaml"),
    "dup.yaml": ("name: a\nname: b\n", "duplicate key 'name'"),
    "dup.json": ('{"model": {"num_layers": 2, "num_layers": 3}}', "duplicate key 'model.num_layers'"),
    "deep.json": (json.dumps(_tiny(**{"model.num_layers": 1e9})), "model.num_layers"),
    "bomb.yaml": (_bomb(), "aliases expand"),
    "neglr.yaml": (yaml.safe_dump(_tiny(**{"train.lr": -1.0})), "train.lr"),
}


@pytest.fixture
def hostile(tmp_path):
    files = {}
    for name, (text, _) in HOSTILE_FILES.items():
        files[name] = tmp_path / name
        files[name].write_text(text)
    return files


@pytest.mark.parametrize("name", list(HOSTILE_FILES))
def test_config_validate_and_launch_dry_run_exit_2_naming_the_problem(name, hostile, tmp_path, capsys):
    f = hostile[name]
    must = HOSTILE_FILES[name][1]
    for argv in (["config", "validate", "--no-data", str(f)], ["launch", str(f), "--dry-run", "--run-dir", str(tmp_path / "r")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert must in err and "->" in err and "Traceback" not in err, (argv, err)
        if name == "neglr.yaml":
            assert "min_lr" not in err, err  # the root problem only
    assert not (tmp_path / "r").exists()


def test_a_real_launch_of_a_hostile_config_starts_nothing(hostile, tmp_path, capsys):
    for name in ("nan.yaml", "bomb.yaml", "deep.json"):
        run_dir = tmp_path / f"run-{name}"
        assert main(["launch", str(hostile[name]), "--run-dir", str(run_dir), "--detach"]) == 2, name
        assert HOSTILE_FILES[name][1] in capsys.readouterr().err
        assert not run_dir.exists(), name


def test_run_launch_refuses_a_config_built_in_python(tmp_path):
    from workbench.launch import Run

    cfg = preset("tiny")
    cfg.train.lr = math.nan
    with pytest.raises(ConfigError) as e:
        Run.launch(cfg, tmp_path / "run")
    assert [p.field for p in e.value.problems] == ["train.lr"]
    assert not (tmp_path / "run").exists()


def test_the_config_form_reports_the_root_problem_and_refuses_launch():
    from workbench.widgets.config_form import ConfigForm

    form = ConfigForm(preset("tiny"), show_dashboard=False)
    form.set("train.lr", -1.0)
    assert [p.field for p in form.problems] == ["train.lr"] and form.launch_button.disabled
    assert "min_lr" not in form.summary.value
    form.set("train.lr", math.nan)
    assert [p.field for p in form.problems] == ["train.lr"] and form.launch_button.disabled
    form.set("train.lr", 1e-3)
    form.set("model.num_layers", 10**9)
    assert [p.field for p in form.problems] == ["model.num_layers"] and "at most 1024" in form.problems[0].rule


@pytest.mark.parametrize("model, parallel, field", [
    ({"num_layers": 10**9}, {"pipeline_parallel": 2, "nproc_per_node": 2}, "model.num_layers"),
    ({"num_attention_heads": 10**12, "hidden_size": 10**12}, {"tensor_parallel": 3, "nproc_per_node": 3}, "model.num_attention_heads"),
])
def test_absurd_sizes_exit_2_promptly_through_the_console_script(model, parallel, field, tmp_path):
    d = preset("tiny").to_dict()
    d["model"].update(model)
    d["parallel"].update(parallel)
    f = tmp_path / "absurd.yaml"
    f.write_text(yaml.safe_dump(d))
    r = subprocess.run([sys.executable, "-m", "workbench.cli", "config", "validate", "--no-data", str(f)],
                       capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert r.returncode == 2 and field in r.stderr and "beyond any real model" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# --------------------------------------------------------------------------- sweep and notebook run


NOT_NOTEBOOKS = {
    "notes.txt": b"just some text\n",
    "latin1.ipynb": b'{"cells": [], "metadata": {"author": "J\xf6rg"}}',
    "cells.ipynb": b'{"cells": 3, "nbformat": 4, "nbformat_minor": 5, "metadata": {}}',
    "list.ipynb": b"[1, 2, 3]",
}


@pytest.mark.parametrize("name", list(NOT_NOTEBOOKS))
def test_sweep_and_notebook_run_refuse_a_file_that_is_not_a_notebook(name, tmp_path, capsys):
    nb = tmp_path / name
    nb.write_bytes(NOT_NOTEBOOKS[name])
    out = tmp_path / "out"
    for argv in (["sweep", str(nb), "--grid", "x=1,2", "--out", str(out)], ["notebook", "run", str(nb), "--out", str(out)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert str(nb) in err and "->" in err and "Traceback" not in err, err
        assert ("UTF-8" in err) == (name == "latin1.ipynb"), err
    assert not out.exists()
    with pytest.raises(ConfigError) as e:
        sweep(nb, {"x": [1, 2]}, out, progress=False)
    assert e.value.problems[0].field == str(nb)
    assert not out.exists()


def test_sweep_refuses_an_output_path_that_is_a_file_and_a_grid_that_is_no_list(tmp_path, capsys):
    import nbformat

    nb = tmp_path / "one.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), str(nb))
    taken = tmp_path / "taken"
    taken.write_text("a file")
    assert main(["sweep", str(nb), "--grid", "x=1", "--out", str(taken)]) == 2
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(ConfigError) as e:
        sweep(nb, {"x": 0.1}, tmp_path / "o", progress=False)
    assert e.value.problems[0].field == "grid.x" and not (tmp_path / "o").exists()
