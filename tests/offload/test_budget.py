"""--expert-memory: shares and sizes become bytes, bytes become slots per layer, bad input is one line."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moekit.errors import MoekitError
from moekit.offload.budget import parse_budget, parse_size, plan_slots, split_slots

TOTAL = 64 * 2**30  # 64 GiB of routed experts


@pytest.mark.parametrize(
    "text, want",
    [
        ("25%", TOTAL // 4),
        ("12.5%", TOTAL // 8),
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("300MB", 300_000_000),
        ("300mb", 300_000_000),
        ("4 KiB", 4096),
        ("1TiB", TOTAL),  # above the total: clamped
        ("123456", 123456),
        ("1e9", 1_000_000_000),
        ("150%", TOTAL),
        ("100%", TOTAL),
        ("  2gib ", 2 * 2**30),
    ],
)
def test_shares_and_sizes_become_bytes(text, want):
    assert parse_budget(text, TOTAL) == want


@pytest.mark.parametrize("text", ["", "abc", "0", "0%", "-5%", "-1GiB", "2G", "GiB", "1e", "nan", "inf", "25%%", "1,5GB"])
def test_bad_budgets_name_the_text_and_give_examples(text):
    with pytest.raises(MoekitError) as err:
        parse_budget(text, TOTAL)
    message = str(err.value)
    assert "\n" not in message
    assert repr(text) in message
    assert "2GiB" in message and "25%" in message


def test_a_model_without_routed_experts_has_no_budget():
    with pytest.raises(MoekitError, match="--expert-memory needs a model with routed experts; this one has none"):
        parse_budget("25%", 0)


EXPERT = 3 * 2**20  # 3 MiB per expert


def test_slots_are_what_the_budget_buys_per_layer():
    plan = plan_slots(10 * EXPERT * 4 + EXPERT, EXPERT, n_moe_layers=4, num_experts=64, top_k=8)
    assert plan.slots == 10
    assert plan.used_bytes == 10 * EXPERT * 4 <= plan.budget_bytes
    assert not plan.fully_resident and not plan.clamped


def test_a_budget_for_every_expert_is_fully_resident_and_more_is_clamped():
    exact = plan_slots(64 * EXPERT * 4, EXPERT, 4, 64, 8)
    assert exact.slots == 64 and exact.fully_resident and not exact.clamped
    more = plan_slots(100 * EXPERT * 4, EXPERT, 4, 64, 8)
    assert more.slots == 64 and more.fully_resident and more.clamped


def test_top_k_experts_per_layer_is_the_minimum():
    assert plan_slots(2 * EXPERT * 4, EXPERT, 4, 64, 2).slots == 2
    with pytest.raises(MoekitError) as err:
        plan_slots(2 * EXPERT * 4 - 1, EXPERT, 4, 64, 2, text="1MiB")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--expert-memory 1MiB is below the minimum: 2 experts per layer × 4 layers")
    assert "24.00 MiB" in message  # 2 × 4 × 3 MiB
    assert "3.1% of expert bytes" in message  # 2 of 64 experts


@given(
    budget=st.integers(0, 10**12),
    expert=st.integers(1, 10**8),
    layers=st.integers(1, 64),
    experts=st.integers(1, 256),
    k=st.integers(1, 8),
)
def test_slots_are_the_most_that_fit(budget, expert, layers, experts, k):
    k = min(k, experts)
    per_slot = expert * layers
    try:
        plan = plan_slots(budget, expert, layers, experts, k)
    except MoekitError:
        assert budget < k * per_slot
        return
    assert k <= plan.slots <= experts
    assert plan.used_bytes <= budget
    assert plan.fully_resident == (plan.slots == experts)
    if plan.slots < experts:
        assert (plan.slots + 1) * per_slot > budget  # one more slot per layer would not fit


@pytest.mark.parametrize("text, size", [("0", 0), ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000),
                                        ("123456", 123456)])
def test_parse_size_takes_sizes_and_zero(text, size):
    assert parse_size(text, "--prefix-cache-memory") == size


@pytest.mark.parametrize("text, message", [("25%", "expected a size"), ("lots", "expected a size"), ("-1", "must not be negative")])
def test_parse_size_refuses_shares_and_nonsense(text, message):
    with pytest.raises(MoekitError, match=message):
        parse_size(text, "--prefix-cache-memory")


def _curve(needed_per_slot: list[int]) -> list[int]:
    """A hit curve from the hits each added slot brings: curve[s] = sum of the first s."""
    out = [0]
    for gain in needed_per_slot:
        out.append(out[-1] + gain)
    return out


def test_a_split_moves_slots_from_a_layer_that_reuses_few_experts_to_one_that_cycles_through_many():
    few = _curve([50, 40, 1, 1, 0, 0, 0, 0])  # two slots catch nearly every reuse
    many = _curve([20, 19, 18, 17, 16, 15, 14, 13])
    split = split_slots({0: few, 1: many}, slots=4, low=2)
    assert split == {0: 2, 1: 6}
    assert few[2] + many[6] > few[4] + many[4]


def test_a_step_after_a_flat_stretch_is_still_found_and_flat_curves_split_equally():
    # Layer 1 gains nothing from slots 3 and 4 and everything from the 5th (a cycle of 5 experts).
    split = split_slots({0: _curve([9, 9, 1, 1, 1, 1]), 1: _curve([9, 9, 0, 0, 60, 0])}, slots=4, low=2)
    assert split == {0: 3, 1: 5}
    assert split_slots({0: [0] * 5, 1: [0] * 5}, slots=3, low=2) == {0: 3, 1: 3}


@given(
    gains=st.lists(st.lists(st.integers(0, 1000), min_size=8, max_size=8), min_size=1, max_size=6),
    slots=st.integers(2, 8),
)
def test_a_split_keeps_the_total_and_the_bounds_and_never_scores_fewer_hits_than_equal(gains, slots):
    curves = {l: _curve(g) for l, g in enumerate(gains)}
    split = split_slots(curves, slots=slots, low=2)
    assert sum(split.values()) == slots * len(curves)
    assert all(2 <= n <= 8 for n in split.values())
    assert sum(curves[l][n] for l, n in split.items()) >= sum(c[slots] for c in curves.values())
