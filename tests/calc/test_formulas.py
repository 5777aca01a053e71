"""The formulas `--explain` prints are a second, independent count: they must agree with the
counter (moekit.calc.params) category by category, for every preset and every mixer kind."""

from dataclasses import asdict

import pytest
from tiny_configs import TINY_JAMBA, TINY_MIXTRAL, TINY_MLA, TINY_SLIDING, spec

from moekit.calc.formulas import CATEGORIES, layer_groups, model_formula
from moekit.calc.params import count_params
from moekit.spec import list_presets, load_spec


def assert_agrees(s):
    f, b = model_formula(s), asdict(count_params(s).breakdown)
    assert {k: f.categories[k] for k in CATEGORIES} == {k: b[k] for k in CATEGORIES}
    assert f.total == count_params(s).total_params


@pytest.mark.parametrize("preset", list_presets())
def test_formulas_agree_with_the_counter_on_every_preset(preset):
    assert_agrees(load_spec(preset))


@pytest.mark.parametrize("config", [TINY_MIXTRAL, TINY_MLA, TINY_SLIDING, TINY_JAMBA], ids=lambda c: c["model_type"])
def test_formulas_agree_on_every_mixer_kind(config):
    assert_agrees(spec(config))


def test_layers_group_by_parameters_not_by_window():
    # gpt-oss alternates sliding and full attention; their parameters are the same.
    assert [g.count for g in layer_groups(load_spec("gpt-oss-20b"))] == [24]
    # DeepSeek-V3: 3 dense layers, then 58 MoE layers.
    assert [g.count for g in layer_groups(load_spec("deepseek-v3"))] == [3, 58]
