"""An unknown config key names the key it probably meant: a field given without its section
(``tensor_parallel=2`` -> ``parallel.tensor_parallel``), a misspelt field or section; otherwise the sections."""

from __future__ import annotations

import pytest

from workbench.config import ConfigError, preset


@pytest.mark.parametrize("key, meant", [
    ("tensor_parallel", "parallel.tensor_parallel"),          # no section
    ("parallel.tensor_paralel", "parallel.tensor_parallel"),  # a typo in the field
    ("modle.hidden_size", "model.hidden_size"),               # a typo in the section
    ("train.micro_batch", "train.micro_batch_size"),          # a field name cut short
    ("model__num_layerz", "model.num_layers"),                # the keyword-argument spelling (__ for .)
])
def test_an_unknown_key_says_which_key_it_meant(key, meant):
    with pytest.raises(ConfigError) as e:
        preset("tiny", **{key: 2})
    (problem,) = e.value.problems
    assert problem.field == key and f"did you mean '{meant}'?" in str(e.value)


def test_a_key_like_no_field_lists_the_sections():
    with pytest.raises(ConfigError) as e:
        preset("tiny", **{"zzzz_qqqq": 1})
    assert "did you mean" not in str(e.value) and "sections: checkpoint, data, model, parallel, train" in str(e.value)


def test_a_dotted_override_works_and_a_bare_field_is_found_in_its_section():
    assert preset("tiny", **{"parallel.tensor_parallel": 1}).parallel.tensor_parallel == 1
    with pytest.raises(ConfigError) as e:
        preset("tiny", seq_length=64)
    assert "did you mean 'model.seq_length'?" in str(e.value)
