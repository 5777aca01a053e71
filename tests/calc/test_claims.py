"""The gpt4-rumored preset encodes the July-2023 rumour; its counts must land on the rumour."""

import pytest

from moekit.calc.claims import claims_from_config, raw_config, share_analysis
from moekit.calc.params import count_params
from moekit.errors import SpecError
from moekit.spec import list_presets, load_spec


def rumour():
    s = load_spec("gpt4-rumored")
    return s, count_params(s)


def test_counts_land_on_the_rumoured_figures():
    s, c = rumour()
    b = c.breakdown
    assert s.num_layers == 120
    assert b.routed_experts_total / 16 == pytest.approx(111e9, rel=0.01)  # ~111B per expert
    assert b.attention == pytest.approx(55e9, rel=0.02)  # ~55B attention
    assert c.total_params == pytest.approx(16 * 111e9 + 55e9, rel=0.01)  # ~1.83T
    assert c.active_params == pytest.approx(2 * 111e9 + 55e9, rel=0.01)  # ~277B
    assert 0.14 < c.active_fraction < 0.16


def test_preset_says_it_is_a_rumour():
    config = raw_config("gpt4-rumored", list_presets())
    assert "rumour" in config["_comment"] and "never confirmed" in config["_comment"]
    claims = claims_from_config(config, "gpt4-rumored")
    assert claims.slogan_active_share == 0.02 and claims.total_params == 1.8e12


def test_share_analysis_reaches_the_target():
    s, c = rumour()
    a = share_analysis(s, c, 0.02)
    # Plugging the E it finds back into (A + K·e) / (A + E·e) gives the target share.
    e = a.expert_all_layers
    assert (a.always_on + 2 * e) / (a.always_on + a.experts_needed * e) == pytest.approx(0.02)
    assert a.routing_floor == 2 / 16
    assert a.always_on > a.budget_at_same_total  # 2% of the total is less than the always-on part
    assert a.attention_share == pytest.approx(c.breakdown.attention / c.total_params)


def test_other_presets_carry_no_claims():
    presets = list_presets()
    assert all(claims_from_config(raw_config(p, presets), p) is None for p in presets if p != "gpt4-rumored")


@pytest.mark.parametrize(
    "claims", [{"total_params": "lots"}, {"slogan_active_share": 2}, {"active_params": -1}, [1, 2]]
)
def test_malformed_claims_are_refused(claims):
    with pytest.raises(SpecError, match="_claims"):
        claims_from_config({"_claims": claims}, "x.json")
