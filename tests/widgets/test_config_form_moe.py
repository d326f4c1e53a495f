"""The config form's mixture-of-experts settings: a widget per field (no JSON text box), in a group labelled
optional that a dense config shows collapsed, with only ``num_experts`` in it; an MoE preset opens it with every
field; a family without MoE layers does not show it."""

from __future__ import annotations

import pytest

W = pytest.importorskip("ipywidgets")

from workbench.config import preset  # noqa: E402
from workbench.widgets.config_form import ConfigForm  # noqa: E402


def _moe(names):
    return [n for n in names if n.startswith("model.moe")]


def test_a_dense_config_shows_the_moe_group_collapsed_with_its_switch_alone():
    form = ConfigForm(preset("tiny"))
    assert _moe(form.shown_fields()) == ["model.moe.num_experts"]
    box = form.groups["model.moe"]
    assert box.selected_index is None and "optional" in box.get_title(0)
    assert not [w for w in form.fields.values() if isinstance(w, W.Textarea) and "moe" in w.description]
    assert isinstance(form.fields["model.moe.num_experts"], W.IntText)


def test_an_moe_preset_opens_the_group_with_a_widget_per_field_and_edits_them():
    cfg = preset("moe-tiny")
    form = ConfigForm(cfg)
    assert form.groups["model.moe"].selected_index == 0
    shown = _moe(form.shown_fields())
    assert len(shown) > 10 and "model.moe.top_k" in shown and "model.moe.load_balancing" in shown
    assert isinstance(form.fields["model.moe.load_balancing"], W.Dropdown)
    assert isinstance(form.fields["model.moe.grouped_gemm"], W.Checkbox)
    assert form.config.to_dict() == cfg.to_dict()
    form.fields["model.moe.top_k"].value = 1  # typed into its box, as a user would
    assert form.config.model.moe.top_k == 1
    form.set("model.moe", {"top_k": 2, "aux_loss_coeff": 0.001})  # the section as a dict, from code
    assert (form.config.model.moe.top_k, form.config.model.moe.aux_loss_coeff) == (2, 0.001) and not form.problems
    form.set("model.moe.num_experts", 0)  # back to dense: the other fields go out of sight
    assert _moe(form.shown_fields()) == ["model.moe.num_experts"]


def test_a_family_without_moe_layers_hides_the_group():
    form = ConfigForm(preset("bert-tiny"))
    assert not _moe(form.shown_fields()) and form.groups["model.moe"].layout.display == "none"
