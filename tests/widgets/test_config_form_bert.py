"""The config form offers BERT: its presets and ``model.arch``, BERT's own fields shown only for BERT (the
family declares them), its rules next to the field they name, and the plan of a BERT config."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from workbench.config import preset  # noqa: E402
from workbench.families import family_of  # noqa: E402
from workbench.widgets.config_form import ConfigForm  # noqa: E402

BERT_FIELDS = ("model.num_tokentypes", "model.add_binary_head", "model.add_pooler", "model.num_labels")


def test_form_offers_bert_and_its_presets():
    form = ConfigForm(preset("tiny"))
    assert "bert" in form.fields["model.arch"].options
    assert {"bert-tiny", "bert-base", "bert-large"} <= set(form.preset.options)
    assert not set(BERT_FIELDS) & set(form.shown_fields())  # a GPT config: BERT's fields are hidden

    form.preset.value = "bert-tiny"
    assert form.config.model.arch == "bert" and form.config.model.num_tokentypes == 2 and form.config.model.add_binary_head
    assert set(BERT_FIELDS) <= set(form.shown_fields())
    assert form.problems == [] and not form.launch_button.disabled
    assert family_of("bert").title in form.summary.value
    assert "lm_transform" in form.plan_text or "GiB" in form.plan_text or "MiB" in form.plan_text, form.plan_text

    form.set("model.arch", "gpt")  # switching the family hides BERT's fields again
    assert not set(BERT_FIELDS) & set(form.shown_fields())


def test_bert_rules_show_next_to_their_fields_and_classification_counts_its_head():
    form = ConfigForm(preset("bert-tiny"))
    base = form.config.derived().params.total
    form.set("model.num_labels", 2)
    assert [p.field for p in form.problems] == ["model.add_binary_head"]
    assert "sentence-order head would sit unused" in form.messages["model.add_binary_head"].value
    assert form.launch_button.disabled
    form.set("model.add_binary_head", False)
    assert form.problems == []
    h = form.config.model.hidden_size
    assert form.config.derived().params.total == base - (2 * h + 2) + (2 * h + 2)  # binary head (2 classes) -> classifier (2)

    form.set("data.tokenizer", "demo")
    assert "data.tokenizer" in [p.field for p in form.problems]
    assert "[CLS]" in form.messages["data.tokenizer"].value
