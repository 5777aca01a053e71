"""SLA tiers' arithmetic: parsing the operator's targets, the start estimate, admission with a
stubbed clock (Admission takes a clock function), and goodput's per-request verdict."""

from __future__ import annotations

import pytest

from moekit.errors import MoekitError
from moekit.serve.sla import Admission, Goodput, Load, TierTargets, estimate_start_steps, parse_duration, parse_tiers


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_tiers_parse_targets_and_a_routing_policy():
    tiers = parse_tiers(["S=ttft:200ms,itl:50ms", "A=adaptive:0.85", "a=ttft:1.5s"])
    assert tiers["S"] == TierTargets(ttft_s=0.2, itl_s=0.05)
    assert tiers["A"] == TierTargets(ttft_s=1.5, routing="adaptive:0.85")


@pytest.mark.parametrize("bad", ["S", "X=ttft:1s", "S=", "S=ttft:200", "S=ttft:fast", "S=itl:-3ms", "A=top1,adaptive:0.8"])
def test_bad_tiers_are_one_line_naming_the_problem(bad):
    with pytest.raises(MoekitError, match="--tier"):
        parse_tiers([bad])


def test_durations_need_a_unit():
    assert parse_duration("250ms", "x") == 0.25 and parse_duration("2s", "x") == 2.0
    with pytest.raises(MoekitError, match="not a duration"):
        parse_duration("250", "x")


def test_start_estimate_by_hand():
    assert estimate_start_steps([5, 3], max_batch=4, ahead=[]) == 0  # a free row
    assert estimate_start_steps([5, 3], max_batch=2, ahead=[]) == 3  # the row with 3 tokens left
    # two free rows then the 3-token row go to the three ahead; the next row frees at step 5 (the 5-token row)
    assert estimate_start_steps([5, 3], max_batch=4, ahead=[10, 10, 1]) == 4  # 3 + 1: the third ahead frees it at 4
    assert estimate_start_steps([], max_batch=1, ahead=[7]) == 7


def busy(left, waiting=None, max_batch=2):
    return Load(max_batch=max_batch, running_left=left, waiting=waiting or {})


def test_admission_rejects_what_cannot_start_within_its_tiers_ttft():
    clock = Clock()
    admission = Admission({"S": TierTargets(ttft_s=0.2)}, "reject", clock)
    assert admission.decide("S", busy([50, 50])).tier == "S"  # nothing measured yet: admitted
    admission.step_done(0.05)
    assert admission.estimate_ttft_s("S", busy([1, 50])) == pytest.approx(0.1)  # 1 step to a row + its prefill
    assert admission.decide("S", busy([1, 50])).tier == "S"
    refused = admission.decide("S", busy([10, 50]))  # (10 + 1) × 50 ms = 550 ms > 200 ms
    assert refused.tier is None and "200 ms" in refused.reason and "550 ms" in refused.reason
    assert admission.decide("B", busy([10, 50])).tier == "B"  # B has no target


def test_demotion_goes_to_the_first_lower_tier_that_meets_its_own_target():
    clock = Clock()
    tiers = {"S": TierTargets(ttft_s=0.2), "A": TierTargets(ttft_s=1.0), "B": TierTargets(ttft_s=0.3)}
    admission = Admission(tiers, "demote", clock)
    admission.step_done(0.05)
    assert admission.decide("S", busy([10, 50])).tier == "A"  # 550 ms: over S's 200, within A's 1 s
    waiting = {"S": [30], "A": [30]}  # ahead of an A request: both; of a B request: both too
    assert admission.decide("S", busy([10, 50], waiting)).tier is None  # S 2 s, A 2.05 s, B 2.05 s: none


def test_step_time_is_a_moving_mean_that_forgets_an_old_burst():
    clock = Clock()
    admission = Admission({"S": TierTargets(ttft_s=0.2)}, "reject", clock, memory_s=30.0, alpha=0.5)
    admission.step_done(0.1)
    clock.now += 1
    admission.step_done(0.3)
    assert admission.step_s == pytest.approx(0.2)
    clock.now += 31  # the server idled past memory_s: the old steps no longer speak
    assert admission.step_s is None and admission.decide("S", busy([100, 100])).tier == "S"
    admission.step_done(0.01)
    assert admission.step_s == pytest.approx(0.01)


def test_a_bad_action_is_refused():
    with pytest.raises(MoekitError, match="--sla-action"):
        Admission({}, "drop")


def test_goodput_meets_both_targets_or_neither():
    goodput = Goodput({"S": TierTargets(ttft_s=0.2, itl_s=0.05)})
    assert goodput.observe("S", 10.0, [10.1, 10.14, 10.18])  # TTFT 100 ms, mean ITL 40 ms
    assert not goodput.observe("S", 10.0, [10.3, 10.31])  # TTFT 300 ms
    assert not goodput.observe("S", 10.0, [10.1, 10.2, 10.3])  # mean ITL 100 ms
    assert goodput.observe("B", 10.0, [99.0])  # no targets: met
    assert goodput.attainment("S") == pytest.approx(1 / 3) and goodput.attainment("A") is None
