from pathlib import Path

import pytest

from moekit.calc.claims import claims_from_config, raw_config
from moekit.calc.explain import explain
from moekit.calc.hardware import get_hardware
from moekit.calc.report import build_report
from moekit.calc.request import parse_request
from moekit.spec import list_presets, load_spec

GOLDEN = Path(__file__).parent / "golden"


def explained(name, hardware=None, **kwargs):
    req = parse_request(hardware=hardware, **kwargs)
    claims = claims_from_config(raw_config(name, list_presets()), name)
    r = build_report(load_spec(name), req, get_hardware(hardware) if hardware else None)
    return r, explain(r, claims)


def test_golden_mixtral_explanation():
    """Regenerate with `moekit calc mixtral-8x7b --explain > tests/calc/golden/mixtral-8x7b.explain.txt`
    only after checking the new derivation by hand."""
    _, text = explained("mixtral-8x7b")
    assert text == (GOLDEN / "mixtral-8x7b.explain.txt").read_text()


def test_golden_numbers_match_published_figures():
    text = (GOLDEN / "mixtral-8x7b.explain.txt").read_text()
    assert "(46.70B)" in text  # Mistral: 46.7B total
    assert "(12.88B)" in text  # Mistral: 12.9B active


@pytest.mark.parametrize("preset", list_presets())
def test_every_preset_explains_without_disagreement(preset):
    r, text = explained(preset, hardware="h100", dtype="fp8", context=8192, batch=4, sla_ms=30)
    assert "!" not in text  # the formulas and the counter agree
    for figure in (r.counts.total_params, r.counts.active_params, r.counts.active_params_excl_input_embedding):
        assert f"{figure:,}" in text
    assert "Roofline on h100-sxm" in text and "Latency budget 30 ms" in text
    assert "distinct experts per MoE layer" in text or not r.spec.moe_layers


def test_rumour_explanation_states_the_implied_share_and_what_2_percent_needs():
    r, text = explained("gpt4-rumored")
    c = r.counts
    assert f"imply {c.active_fraction * 100:.2f}%, not 2.00%" in text
    # More experts at K = 2: E = ((A + 2e) / 0.02 − A) / e.
    a = c.active_params - c.breakdown.routed_experts_active
    e = c.breakdown.routed_experts_total / 16
    assert f"= {((a + 2 * e) / 0.02 - a) / e:,.1f} experts per layer" in text
    # Attention alone is ~3% of the total: 2% is impossible at the same total.
    assert f"attention alone {c.breakdown.attention / 1e9:,.2f}B = {c.breakdown.attention / c.total_params * 100:.2f}%" in text
    assert "impossible without shrinking attention" in text
    assert "never confirmed" in text


def test_claims_section_only_where_the_config_has_claims():
    _, text = explained("mixtral-8x7b")
    assert "claim" not in text
