import re
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


# gpt4-rumored's config (src/moekit/spec/presets/gpt4-rumored.json), restated so the test derives
# every figure of its explanation by hand instead of reading them back from the calculator.
D, V, L, HEADS, KV_HEADS, HEAD_DIM, E, K, F = 10_752, 100_277, 120, 84, 84, 128, 16, 2, 28_672
CONTEXT = 4_096  # the --context default


def gpt4_figures() -> dict[str, str]:
    """Every figure `moekit calc gpt4-rumored --explain` prints, derived by hand, as it prints them."""
    gib = lambda b: f"{b / 2**30:,.2f} GiB"
    q = D * HEADS * HEAD_DIM
    kv = D * KV_HEADS * HEAD_DIM
    attention = 2 * q + 2 * kv
    router, norms = D * E, 2 * D
    expert = 3 * D * F
    embedding = head = V * D
    total = L * (attention + router + E * expert + norms) + D + embedding + head
    routed_all, routed_active = L * E * expert, L * K * expert
    active = total - routed_all + routed_active
    always_on = total - routed_all
    kv_values = 2 * KV_HEADS * HEAD_DIM  # K and V per token per layer
    kv_cache = L * CONTEXT * kv_values * 2  # bf16
    ffn = K * 2 * F  # gate and up of the K experts
    activations = (4 * D + ffn) * 2 + (HEADS * CONTEXT + V) * 4
    read = total - routed_all - embedding + routed_active + D  # dense weights, K experts, one row
    per_expert = L * expert  # e: one expert over every layer
    experts_for_2pct = ((always_on + K * per_expert) / 0.02 - always_on) / per_expert
    return {
        "q_proj": f"= {q:,}", "attention, one layer": f"= {attention:,}", "router": f"= {router:,}",
        "one expert": f"= {expert:,}", "experts, one layer": f"= {E * expert:,}",
        "active per layer": f"= {K * expert:,}", "norms": f"= {norms:,}", "embedding": f"= {embedding:,}",
        "attention": f"= {L * attention:,}", "routers": f"= {L * router:,}", "routed (all E)": f"= {routed_all:,}",
        "all norms": f"= {L * norms + D:,}", "total": f"= {total:,} ({total / 1e12:.2f}T)",
        "routed active": f"= {routed_active:,}", "active": f"= {active:,} ({active / 1e9:.2f}B)",
        "excl input embedding": f"= {active - embedding:,} ({(active - embedding) / 1e9:.2f}B)",
        "non-embedding": f"= {active - embedding - head:,} ({(active - embedding - head) / 1e9:.2f}B)",
        "active_fraction": f"= {active / total:.2%}", "K / E": f"{K / E:.2%} of the routed experts",
        "always-on": f"({always_on / 1e9:.2f}B, {always_on / total:.2%} of total)",
        "always-on bytes": f"{always_on:,} × 16 / 8 = {2 * always_on:,} B ({gib(2 * always_on)})",
        "routed bytes": f"= {2 * routed_all:,} B ({gib(2 * routed_all)})",
        "weights": f"= {2 * total:,} B ({gib(2 * total)})",
        "KV per token": f"{L * kv_values:,} values × 16 / 8 = {2 * L * kv_values:,} B",
        "KV per sequence": f"= {kv_cache:,} B ({gib(kv_cache)})",
        "activations": f"= {activations:,} B ({activations / 2**20:.2f} MiB)",
        "memory total": f"= {2 * total + kv_cache + activations:,} B ({gib(2 * total + kv_cache + activations)})",
        "dense read": f"= {total - routed_all - embedding:,}", "params read": f"= {read:,}",
        "weight bytes": f"= {2 * read:,}", "bytes per token": f"= {2 * read + kv_cache:,} B ({gib(2 * read + kv_cache)})",
        "claimed": f"~1.80T total, ~280.00B per token → {280e9 / 1.8e12:.2%} active",
        "this config": f"{active / 1e9:.2f}B of {total / 1e12:.2f}T → {active / total:.2%} active",
        "non-embedding share": f"({(active - embedding - head) / total:.2%} without embedding and head)",
        "implied": f"imply {active / total:.2%}, not 2.00%",
        "e": f"e = one expert over all layers {per_expert / 1e9:.2f}B",
        "more experts": f"= (({always_on:,} + 2 × {per_expert:,}) / 0.02 − {always_on:,}) / {per_expert:,}"
                        f" = {experts_for_2pct:,.1f} experts per layer (total "
                        f"{(always_on + experts_for_2pct * per_expert) / 1e12:.2f}T)",
        "K = 1": f"K = 1 gives (A + e) / (A + E·e) = {(always_on + per_expert) / total:.2%}",
        "same total": f"2.00% of {total / 1e12:.2f}T is {0.02 * total / 1e9:.2f}B per token",
        "attention alone": f"(attention alone {L * attention / 1e9:.2f}B = {L * attention / total:.2%})",
    }


def test_every_figure_of_the_gpt4_explanation_is_the_hand_arithmetic():
    _, text = explained("gpt4-rumored")
    figures = gpt4_figures()
    missing = {name: figure for name, figure in figures.items() if figure not in text}
    assert not missing, missing
    # ...and the explanation prints no large figure that the hand arithmetic does not give.
    by_hand = " ".join(figures.values())
    big = set(re.findall(r"\d{1,3}(?:,\d{3}){2,}", text))  # a million or more, as printed
    assert {n for n in big if n not in by_hand} == set()
